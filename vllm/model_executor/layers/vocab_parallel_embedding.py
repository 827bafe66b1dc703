"""The embedding and the lm_head split over the tensor-parallel ranks by vocabulary rows.

Every rank holds `ceil(vocab / tp)` rows: rank r the token ids [r * rows, (r + 1) * rows), the
last rank's tail past the vocabulary zero-filled so that all shards have one shape (the logits
gather needs it):

    vocab 10, tp 2:  rank 0 ids 0-4    rank 1 ids 5-9
    vocab 9,  tp 2:  rank 0 ids 0-4    rank 1 ids 5-8 + one zero row (its logit column is dropped)

The embedding looks up the ids of its range (others give zero rows) and the ranks' rows are
all-reduced. The lm_head computes the logits of its range; they are gathered on rank 0 only,
which samples.
"""

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import get_tp_group
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.quantization import gguf_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.shard_rows = -(-vocab_size // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.shard_rows
        # Created empty, in the run dtype: the model's load_weights writes every row.
        self.weight = nn.Parameter(torch.empty(self.shard_rows, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quantized = False  # the weight holds GGUF blocks (gguf_linear.mark_quantized)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint embedding has shape {tuple(loaded.shape)}, expected "
                             f"{(self.vocab_size, param.shape[1])}")
        rows = min(self.shard_rows, self.vocab_size - self.vocab_start)
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (T,) -> (T, hidden)."""
        lookup = gguf_linear.embedding if self.quantized else F.embedding
        if self.tp.world_size == 1:
            return lookup(input_ids, self.weight)
        local = input_ids - self.vocab_start                                     # (T,)
        outside = (local < 0) | (local >= self.shard_rows)
        rows = lookup(local.masked_fill(outside, 0), self.weight)               # (T, hidden)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(1), 0))


class ParallelLMHead(Linear):
    """The lm_head: this rank's vocabulary rows (those of `embedding`, whose weight it shares
    when the model ties them)."""

    def __init__(self, embedding: VocabParallelEmbedding, tie_word_embeddings: bool) -> None:
        hidden_size = embedding.weight.shape[1]
        super().__init__(hidden_size, embedding.shard_rows, False, embedding.weight.dtype)
        self.embedding = [embedding]  # a list: not a submodule of the head
        if tie_word_embeddings:
            self.weight = embedding.weight
        else:
            self.weight.weight_loader = embedding.weight_loader

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """local: (R, shard rows), this rank's logits -> (R, vocab) on rank 0, None elsewhere."""
        full = self.embedding[0].tp.gather(local, dim=-1)                       # (R, tp * shard rows)
        return None if full is None else full[:, :self.embedding[0].vocab_size]
