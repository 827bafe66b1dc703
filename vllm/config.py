"""Validated configuration objects shared by the engine, the scheduler and the worker.

User-facing values are checked here once, with a `ValueError` that names the field; the rest of
the code asserts only its own invariants.
"""

from dataclasses import dataclass, field
from typing import Any

# dtype names accepted from users -> torch attribute names. This module imports no torch, so
# the scheduler (which reads SchedulerConfig) stays torch-free.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def resolve_dtype(dtype: Any, default: Any) -> Any:
    """Maps a vLLM-style dtype ("auto", "bfloat16", torch.float16, ...) to a torch dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        if str(dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; use one of float32, bfloat16, float16")
        return dtype
    if dtype == "auto":
        return default
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(set(_DTYPES))}")
    return getattr(torch, _DTYPES[dtype])


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """What to run: the checkpoint, its Hugging Face config and the compute dtype."""

    model: str
    tokenizer: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: Any  # torch.dtype
    max_model_len: int
    seed: int = 0
    gguf_file: str | None = None  # set when `model` is a single .gguf file
    # "gguf": the file's quantized tensors stay in their blocks; "int8": linear weights quantized
    # per output channel at load (vllm/model_executor/layers/quantization/int8_weights.py).
    quantization: str | None = None
    max_logprobs: int = 20  # largest `logprobs` / `prompt_logprobs` a request may ask for
    trust_remote_code: bool = False  # transformers may run the checkpoint's own code
    # "auto": the model's generation_config.json gives the default sampling parameters; "vllm":
    # SamplingParams' own defaults; else the directory of the generation_config.json to use.
    generation_config: str = "auto"
    # The non-default fields of the generation config in use (the model's for "auto" and "vllm"):
    # its EOS ids end requests whatever the mode.
    generation_config_fields: dict = field(default_factory=dict)
    override_generation_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require_positive("max_model_len", self.max_model_len)
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits: the token ids it can produce."""
        return self.hf_config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's EOS ids from its generation config (Llama 3 Instruct has several)."""
        ids = self.generation_config_fields.get("eos_token_id")
        return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)

    def get_diff_sampling_param(self) -> dict:
        """Default sampling parameters the model's generation config sets (vLLM's names), after
        `override_generation_config`; empty with generation_config="vllm"."""
        config = {} if self.generation_config == "vllm" else dict(self.generation_config_fields)
        config.update(self.override_generation_config)
        names = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
        params = {name: config[name] for name in names if config.get(name) is not None}
        if "max_new_tokens" in params:  # Hugging Face's name for max_tokens
            params["max_tokens"] = params.pop("max_new_tokens")
        return params

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def get_num_attention_heads(self, parallel: "ParallelConfig") -> int:
        """Query heads on `parallel.rank` (vllm/distributed/partition.py)."""
        return self._head_shard(parallel).num_heads

    def get_num_kv_heads(self, parallel: "ParallelConfig") -> int:
        """KV heads on `parallel.rank`; rank 0 holds the most."""
        return self._head_shard(parallel).num_kv_heads

    def verify_with_parallel_config(self, parallel: "ParallelConfig") -> None:
        """Raises ValueError when the heads cannot be split over the tensor-parallel ranks."""
        from vllm.distributed.partition import check_tensor_parallel_split

        check_tensor_parallel_split(self.hf_config.num_attention_heads, self.num_kv_heads,
                                    parallel.tensor_parallel_size)

    def _head_shard(self, parallel: "ParallelConfig"):
        from vllm.distributed.partition import attention_head_shard

        return attention_head_shard(self.hf_config.num_attention_heads, self.num_kv_heads,
                                    parallel.tensor_parallel_size, parallel.rank)


@dataclass
class CacheConfig:
    """Paged KV cache geometry.

    The number of blocks is derived from `kv_cache_memory_bytes` (the memory the cache may take,
    over all layers, keys and values) unless `num_gpu_blocks_override` pins it, as in vLLM.
    With `enable_prefix_caching`, full blocks are shared between requests whose tokens begin
    alike (vllm/core/prefix_cache.py).
    """

    block_size: int = 128
    kv_cache_memory_bytes: int = 2 * 1024**3
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    num_blocks: int = field(default=0, init=False)  # filled in by the worker once it knows the model

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)
        _require_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None:
            _require_positive("num_gpu_blocks_override", self.num_gpu_blocks_override)


SCHEDULING_POLICIES = ("fcfs", "priority")  # see vllm/core/scheduling_policy.py


@dataclass
class SchedulerConfig:
    """Token budget and admission policy of one engine step.

    With chunked prefill (SARATHI) a step holds every running decode plus prefill chunks that
    fill the rest of `max_num_batched_tokens`. Without it, a step is either whole prompts only or
    decodes only (vLLM's classic policy), so a prompt must fit the budget in one piece.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 4
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    # Chunked prefill: the predicted step time to stay under (None: the budget is
    # max_num_batched_tokens every step). See vllm/core/step_time_model.py.
    max_step_latency_ms: float | None = None
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES

    def check_priority(self, priority: int) -> None:
        """Raises ValueError unless `priority` is an int this policy can serve."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.policy != "priority":
            raise ValueError(f"got priority {priority}, but the scheduling policy is {self.policy!r}: "
                             "set scheduling_policy='priority'")

    @property
    def long_prompt_threshold(self) -> int:
        """Prompts with more tokens left to compute than this are long (0: none is).

        `long_prefill_token_threshold` when set. Otherwise, with several partial prefills, 4% of
        `max_model_len`, vLLM's rule; vLLM then also caps every chunk at that number, while here
        only a threshold set by the user caps chunks (`_chunk_size`), so a long prompt alone
        still fills the budget. With one partial prefill no prompt is long: FCFS SARATHI.
        """
        if self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        if self.max_num_partial_prefills > 1:
            return max(1, int(self.max_model_len * 0.04))
        return 0

    def __post_init__(self) -> None:
        _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive("max_num_seqs", self.max_num_seqs)
        _require_positive("max_model_len", self.max_model_len)
        _require_positive("max_num_partial_prefills", self.max_num_partial_prefills)
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: derived), "
                             f"got {self.long_prefill_token_threshold}")
        if self.max_step_latency_ms is not None:
            if not self.max_step_latency_ms > 0:
                raise ValueError(f"max_step_latency_ms must be > 0 (or None), got {self.max_step_latency_ms}")
            if not self.enable_chunked_prefill:
                raise ValueError("max_step_latency_ms sizes prefill chunks: it needs "
                                 "enable_chunked_prefill=True")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills={self.max_long_partial_prefills} must be "
                             f"in [1, max_num_partial_prefills={self.max_num_partial_prefills}]")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): without chunked prefill a whole prompt must "
                "fit in one step. Raise max_num_batched_tokens, lower max_model_len, or set "
                "enable_chunked_prefill=True.")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running decode needs one token of the budget")


EXECUTOR_BACKENDS = ("mp", "ray", "uni")


@dataclass
class ParallelConfig:
    """How the model is split over processes: `tensor_parallel_size` ranks, each a worker that
    holds a shard of every layer and of the KV cache, run by the `distributed_executor_backend`
    ("uni": the engine's own process, for one rank; "mp": worker processes on this host; "ray":
    Ray actors, on one host or several). `rank` is the worker's own, set in each worker."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            _require_positive(name, getattr(self, name))
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: "
                             "layers are split across ranks by tensor parallelism only; use "
                             "pipeline_parallel_size=1")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp" if self.tensor_parallel_size > 1 else "uni"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is "
                             f"not supported; use one of {list(EXECUTOR_BACKENDS)}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but "
                             f"tensor_parallel_size={self.tensor_parallel_size}; use 'mp' or 'ray'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    enforce_eager: bool = True
    disable_log_stats: bool = False  # read by the server's periodic statistics
