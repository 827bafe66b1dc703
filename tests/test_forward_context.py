"""The forward context: attention finds the step's metadata and backend there, and only inside
the block."""

import pytest
import torch

from vllm.attention.backends.abstract import SeqSpan
from vllm.attention.backends.cpu_attn import paged_attention, write_to_kv_cache
from vllm.attention.backends.cpu_metadata import build_attention_metadata
from vllm.attention.layer import attention
from vllm.forward_context import ForwardContext, forward_context, get_forward_context


class _TorchBackend:
    """The CPU backend's attention without its engine configuration."""

    def forward(self, query, key, value, key_cache, value_cache, metadata, scale):
        write_to_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_attention(query, key, value, key_cache, value_cache, metadata, scale)


def _step():
    # One 3-token prompt in a cache of 2 blocks of 4 (+ the pad block).
    meta = build_attention_metadata([SeqSpan(0, 3, 0, [1])], 0, [4, 5, 6], 4, 1, None, 2,
                                    torch.device("cpu"))
    return meta, (torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8))


def test_attention_outside_a_forward_context_is_an_error():
    q, kv = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    _, (key_cache, value_cache) = _step()
    with pytest.raises(RuntimeError, match="forward_context"):
        attention(q, kv, kv, key_cache, value_cache, 0.5)
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_attention_writes_the_layers_cache_and_the_context_ends_with_the_block():
    meta, (key_cache, value_cache) = _step()
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    with forward_context(ForwardContext(meta, _TorchBackend())):
        out = attention(q, k, v, key_cache, value_cache, 8 ** -0.5)     # (T, H * D)
    assert out.shape == (3, 16)
    torch.testing.assert_close(key_cache[1, :3], k)  # slots 4..6 = block 1, offsets 0..2
    torch.testing.assert_close(value_cache[1, :3], v)
    # The first token attends to itself only: its output is its own value.
    torch.testing.assert_close(out[0].view(2, 8), v[0])
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_forward_contexts_do_not_nest():
    meta, _ = _step()
    with forward_context(ForwardContext(meta, _TorchBackend())):
        with pytest.raises(AssertionError):
            with forward_context(ForwardContext(meta, _TorchBackend())):
                pass
