"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened token dimension.

Inputs are `input_ids`/`positions` of shape (num_tokens,) holding every sequence of the step
back to back; only attention knows where one sequence ends, through its metadata. Parameter
names are Hugging Face's, except that q/k/v and gate/up are fused into one matmul each;
`load_weights` maps the separate checkpoint tensors onto the shards of the fused ones. Each
attention layer holds its slice of the paged KV cache once the runner binds it (`bind_kv_caches`).

With tensor parallelism (vllm/distributed/) every rank builds the model with its share of the
heads (split by KV-head groups, vllm/distributed/partition.py), of the MLP's intermediate rows
and of the vocabulary; each layer's parameter copies only its rank's slice of a checkpoint tensor
(its `weight_loader`). The ranks' partial sums meet in one all-reduce after attention's o_proj
and one after the MLP's down_proj, and the embedding's rows in one more.
"""

from collections.abc import Iterable

import torch
from torch import nn

from vllm.attention.layer import attention
from vllm.distributed import attention_head_shard, get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import silu_and_mul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import silu_mul_linear
from vllm.model_executor.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import gguf_linear
from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlocks
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama_cpu_layers import FusedLayers


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if config.model_type == "qwen2":
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_index = layer_index
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = d = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        if total_heads % total_kv_heads:
            raise ValueError(f"num_attention_heads ({total_heads}) must be a multiple of "
                             f"num_key_value_heads ({total_kv_heads})")
        tp = get_tp_group()
        shard = attention_head_shard(total_heads, total_kv_heads, tp.world_size, tp.rank)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads  # this rank's
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        kv_slice = (shard.kv_start * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [total_heads * d, total_kv_heads * d, total_kv_heads * d],
            [(shard.q_start * d, self.q_size), kv_slice, kv_slice], qkv_bias, dtype)
        self.o_proj = RowParallelLinear(
            total_heads * d, config.hidden_size,
            getattr(config, "attention_bias", False) and config.model_type != "qwen2", dtype,
            input_slice=(shard.q_start * d, self.q_size))
        self.scale = self.head_dim ** -0.5
        self.c_kernels = False  # the CPU backend's element-wise C ops (cpu_layer_ops)
        # (num_blocks + 1, block_size, KVH, D) each, bound by the runner: buffers, so that a
        # captured graph takes them as inputs it writes (the attention op declares it).
        self.register_buffer("key_cache", None, persistent=False)
        self.register_buffer("value_cache", None, persistent=False)

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden: (T, hidden) -> rotated q (T, H, D), rotated k and v (T, KVH, D)."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                                         # (T, q + 2 kv)
        # q and k sit side by side: one rotation serves both.
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                     self.head_dim)        # (T, H + KVH, D)
        q, k = apply_rotary(qk, cos, sin, self.c_kernels).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return q, k, v                                                      # (T, H | KVH, D)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden) -> (T, hidden); K/V go to this layer's paged cache."""
        q, k, v = self.project(hidden, cos, sin)
        out = attention(q, k, v, self.key_cache, self.value_cache, self.scale)  # (T, H * D)
        return self.o_proj(out)                                                 # (T, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = ColumnParallelLinear.evenly(config.hidden_size, [config.intermediate_size] * 2,
                                                        bias, dtype)
        self.intermediate_size = self.gate_up_proj.out_features // 2  # this rank's
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, dtype)
        self.c_kernels = False  # the CPU backend's element-wise C ops (cpu_layer_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = silu_mul_linear(self.gate_up_proj, x)                            # (T, I) or None
        if act is None:
            act = silu_and_mul(self.gate_up_proj(x), self.c_kernels)           # (T, I)
        return self.down_proj(act)                                              # (T, hidden)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer_index, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's MLP output, still to be added to `residual`, the stream
        before it (None at the first layer, where hidden is the embedding). Returns this layer's
        MLP output and the stream before it, (T, hidden) each: every add is fused into the norm
        that follows it."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Set by LlamaForCausalLM.enable_fused_layers: the layers in C for the steps whose
        # attention and rows the C kernels take (llama_cpu_layers.py). Never inside a captured graph.
        self.fused_layers = None
        # Each layer's (key, value) cache, as bind_kv_caches gave them: read once per step here
        # instead of through 30 submodule attribute lookups.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden).

        Attention reads the step's metadata and backend from the current forward_context.
        """
        hidden = self.embed_tokens(input_ids)                                   # (T, hidden)
        if self.fused_layers is not None and not torch.compiler.is_compiling():
            context = get_forward_context()
            if self.fused_layers.accepts(context.metadata, input_ids.shape[0]):
                return self.fused_layers(hidden, positions, context.metadata, self.kv_caches)  # (T, hidden)
        cos, sin = self.rotary(positions)                                       # (T, 1, D) each
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor -> (fused parameter, shard index) for the fused projections.
    _STACKED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.sliding_window = _sliding_window(config)
        self.model = LlamaModel(config, max_position, dtype)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, self.tie_word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)                                # (T, hidden)

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Gives each layer its (key, value) cache, one pair per layer in order."""
        assert len(kv_caches) == len(self.model.layers)
        for layer, (key_cache, value_cache) in zip(self.model.layers, kv_caches):
            layer.self_attn.key_cache, layer.self_attn.value_cache = key_cache, value_cache
        self.model.kv_caches = list(kv_caches)

    def enable_fused_layers(self) -> FusedLayers | None:
        """CPU, bf16 or float32: from now on eager steps that the C kernels take run their layers in C
        (llama_cpu_layers.py), where the kernels build here. Call once the weights are loaded
        (and packed); returns the C path. None with tensor parallelism: the C layers have no all-reduce, so
        sharded layers run op by op."""
        if get_tp_group().world_size > 1:
            return None
        self.model.fused_layers = FusedLayers.build(self.model)
        return self.model.fused_layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (S, hidden) for the tokens that sample -> (S, this rank's vocab rows) float32
        logits; `gather_logits` joins the ranks' columns."""
        return self.lm_head(hidden).float()

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """(S, this rank's vocab rows) -> (S, vocab) on rank 0; None on the other ranks."""
        return self.lm_head.gather_logits(local)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFBlocks]]) -> None:
        """Copies checkpoint tensors in, each parameter its rank's slice (its `weight_loader`);
        every parameter must be written, every shape must match. A weight given as GGUF blocks
        becomes rows of those blocks (gguf_linear.load_blocks); all of its tensors must be."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue  # some checkpoints store the tied copy too
                target, shard = name, None
                for part, (fused, index) in self._STACKED.items():
                    if f".{part}." in name:
                        target, shard = name.replace(f".{part}.", f".{fused}."), index
                        break
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[target]
                if isinstance(tensor, GGUFBlocks) or gguf_linear.is_quantized(param):
                    tensor = self._blocks_for(param, target, tensor, loaded)
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    try:
                        loader(param, tensor, shard)
                    except ValueError as e:
                        raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(param.shape)}")
                    param.copy_(tensor)
                loaded.add(target if shard is None else f"{target}#{shard}")
        expected = {n if getattr(p, "num_shards", 1) == 1 else f"{n}#{i}"
                    for n, p in params.items() for i in range(getattr(p, "num_shards", 1))}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}"
                             + (" ..." if len(missing) > 8 else ""))
        gguf_linear.mark_quantized(self)

    @staticmethod
    def _blocks_for(param: nn.Parameter, target: str, tensor: torch.Tensor | GGUFBlocks,
                    loaded: set[str]) -> torch.Tensor:
        """The rows of blocks to copy into `param` (made a weight of blocks on its first tensor);
        a parameter is loaded from all GGUF blocks (dequantized where their types differ) or all
        dense tensors."""
        written = any(name.split("#")[0] == target for name in loaded)
        if not isinstance(tensor, GGUFBlocks) or (written and not gguf_linear.takes_blocks(param)):
            raise ValueError(f"{target} is loaded from both quantized and unquantized GGUF tensors")
        return gguf_linear.load_blocks(param, tensor)
