"""Q4_K and Q6_K blocks for the tests: the gguf package dequantizes them but cannot quantize them
in Python.

A Q4_K super-block is 256 weights in 144 bytes: d and dmin (fp16), 12 bytes packing the 6-bit
scale sc_s and minimum m_s of its 8 sub-blocks of 32, and 128 bytes of nibbles; weight i of
sub-block s is (d * sc_s) * q_i - dmin * m_s. A Q6_K super-block is 256 weights in 210 bytes:
128 bytes of the codes' low 4 bits, 64 of their high 2 bits, 16 int8 scales sc_r of runs of 16
and d (fp16); weight i of run r is (d * sc_r) * (q_i - 32). The layouts:
vllm/csrc/cpu/cpu_gguf_gemv_blocks.h.
"""

import numpy as np

Q4_K = 12  # GGMLQuantizationType.Q4_K
Q6_K = 14  # GGMLQuantizationType.Q6_K
SUPER_BLOCK = 256


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, k / 256 * 144) uint8: n rows of random super-blocks, every bit of the scales and codes
    random, with d and dmin drawn per super-block so that the weights are of order 0.01-2."""
    blocks = rng.integers(0, 256, (n, k // SUPER_BLOCK, 144), dtype=np.uint8)
    size = rng.uniform(0.01, 2.0, (n, 1))  # a row's weights span about [-size, size]
    d = (size * rng.uniform(0.5, 1.0, (n, k // SUPER_BLOCK)) / (63 * 15 / 2)).astype(np.float16)
    dmin = (size * rng.uniform(0.5, 1.0, (n, k // SUPER_BLOCK)) / 63).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """(n, k) float32 -> (n, k / 256 * 144) uint8 Q4_K blocks, by a plain per-sub-block min/max
    rule (llama.cpp searches its scales; any valid blocks serve the tests, which compare the
    kernels with the gguf package's dequantization of the same blocks)."""
    n, k = weights.shape
    sub = weights.astype(np.float32).reshape(n, k // SUPER_BLOCK, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)                        # (n, super-blocks, 8)
    step = (sub.max(axis=-1) - low) / 15                           # a sub-block's scale
    d = (step.max(axis=-1) / 63).astype(np.float16)                # (n, super-blocks)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    scale, minimum = (d32 * sc)[..., None], (dmin32 * m)[..., None]
    q = np.clip(np.rint(np.divide(sub + minimum, scale, out=np.zeros_like(sub), where=scale > 0)), 0, 15)
    q, sc, m = q.astype(np.uint8), sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                             (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], axis=-1)   # (n, super-blocks, 12)
    codes = (q[..., 0::2, :] | q[..., 1::2, :] << 4).reshape(n, k // SUPER_BLOCK, 128)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales, codes], axis=-1)
    return blocks.reshape(n, -1)


def random_q6_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, k / 256 * 210) uint8: n rows of random super-blocks, every bit of the codes and scales
    random, with d drawn per super-block so that the weights are of order 0.01-2."""
    blocks = rng.integers(0, 256, (n, k // SUPER_BLOCK, 210), dtype=np.uint8)
    size = rng.uniform(0.01, 2.0, (n, 1))
    d = (size * rng.uniform(0.5, 1.0, (n, k // SUPER_BLOCK)) / (128 * 32)).astype(np.float16)
    blocks[..., 208:210] = d[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """(n, k) float32 -> (n, k / 256 * 210) uint8 Q6_K blocks, by a plain per-run absolute maximum
    (llama.cpp searches its scales; the tests compare with the gguf package's dequantization of
    the same blocks)."""
    n, k = weights.shape
    runs = weights.astype(np.float32).reshape(n, k // SUPER_BLOCK, 16, 16)
    amax = np.abs(runs).max(axis=-1)                                         # (n, super-blocks, 16)
    d = (amax.max(axis=-1) / (127 * 31)).astype(np.float16)                  # (n, super-blocks)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(amax, 31 * d32, out=np.zeros_like(amax), where=d32 > 0)), -128, 127)
    scale = (d32 * sc)[..., None]
    q = np.clip(np.rint(np.divide(runs, scale, out=np.zeros_like(runs), where=scale != 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, k // SUPER_BLOCK, 2, 4, 32)          # (.., half h, j, l)
    ql = np.concatenate([q[..., 0, :] & 15 | (q[..., 2, :] & 15) << 4,
                         q[..., 1, :] & 15 | (q[..., 3, :] & 15) << 4], axis=-1)     # (.., h, 64)
    qh = q[..., 0, :] >> 4 | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4 | (q[..., 3, :] >> 4) << 6
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.astype(np.int8).view(np.uint8),
                             d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(n, -1)
