/*
 * y = x @ W^T + bias, bf16 in and out, on a copy of W packed once at load: 5-32 rows (batched
 * decodes) and, in slabs of 32 rows, prefill chunks.
 *
 * Past 4 rows the AVX512-BF16 GEMV (cpu_gemv.c) runs out of dot-product throughput, and oneDNN's
 * blocked kernel does not keep up with memory at these row counts. W is packed once, at load,
 * into the layout of AMX's tiles:
 *
 *   packed[b][kb] = 16 x 16 pairs: row r, column c = W[16 b + c][32 kb + 2 r], W[16 b + c][32 kb + 2 r + 1]
 *
 * so that each block b of 16 output columns reads one contiguous run of 1 KB tiles. Two copies
 * of the product read it: on AMX tiles (cpu_tile_gemm_amx.h), where a tile of it is a tile
 * product's operand, and on AVX512-BF16 dot products (cpu_tile_gemm_avx512.h), where a row of
 * a tile is a vdpbf16ps operand (16 columns' pair of weights). The compiler's ISA macros decide
 * which copies are built; AMX runs where both are and Linux grants the tile state
 * (tile_gemm_use_amx). Without either, tile_gemm_supported() is 0 and oneDNN keeps the products.
 *
 * tile_gemm_silu_mul_bf16 runs a merged gate/up weight with SiLU-and-multiply in the epilogue:
 * its groups pair gate's column blocks with up's, half the weight apart, so the (m, n) product
 * never goes to memory: it is neither written nor read back by a separate SiLU-and-multiply.
 *
 * Layouts: x (m, k) contiguous; W (n, k) as nn.Linear stores it; y (m, n); k % 32 == 0,
 * n % 16 == 0 (tile_gemm_fits). Accumulation in float32, one rounding to bf16 at the end.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "layer_ops.h"

#define MAX_ROWS 32

int tile_gemm_fits(int64_t n, int64_t k) { return n > 0 && k > 0 && n % 16 == 0 && k % 32 == 0; }

/* W (n, k) -> the tile layout above; any CPU can pack. */
int tile_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    if (!tile_gemm_fits(n, k)) return 1;
    const int64_t kblocks = k / 32;
    for (int64_t b = 0; b < n / 16; ++b)
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            uint16_t *tile = packed + (b * kblocks + kb) * 512;
            for (int64_t r = 0; r < 16; ++r)
                for (int64_t c = 0; c < 16; ++c)
                    for (int64_t p = 0; p < 2; ++p)
                        tile[(r * 16 + c) * 2 + p] = w[(16 * b + c) * k + 32 * kb + 2 * r + p];
        }
    return 0;
}

/* Units (blocks of 16 columns, or gate/up pairs of them) per group, smallest to largest: the
 * fewest units on the busiest thread (ties to the larger group). 36 blocks on 2 threads are 12
 * groups of 3, 18 blocks each, where groups of 4 would give one thread 20 and the other 16
 * while both share the memory's bandwidth. */
static inline int64_t units_per_group(int64_t nblocks, int64_t threads, int64_t smallest, int64_t largest) {
    int64_t best = largest, best_load = INT64_MAX;
    for (int64_t size = largest; size >= smallest; --size) {
        const int64_t groups = (nblocks + size - 1) / size;
        const int64_t load = (groups + threads - 1) / threads * size;
        if (load < best_load) best = size, best_load = load;
    }
    return best;
}

/* The column blocks of one group: the plain product's are consecutive (b0, b0 + 1, ..); the
 * SiLU-and-multiply's are gate blocks j0 .. j0 + pairs - 1, then the up blocks half later. */
static inline int64_t group_block(int fused, int64_t b0, int64_t pairs, int64_t half, int64_t i) {
    return !fused ? b0 + i : i < pairs ? b0 + i : b0 + half + i - pairs;
}

#ifdef VLLM_LAYER_OPS_X16
/* silu(gate) * up of 16 columns' float32 sums (bias added), each value rounded to bf16 where
 * torch rounds it: gate_up's output, silu's, and (when stored) the product. */
static inline __m512 silu_mul_x16(__m512 gate, __m512 up) {
    return _mm512_mul_ps(round_bf16x16(silu_x16(round_bf16x16(gate))), round_bf16x16(up));
}
#endif

#include "cpu_tile_gemm_amx.h"
#include "cpu_tile_gemm_avx512.h"

int tile_gemm_supported(void) {
#if defined(HAVE_TILE_GEMM_AMX) && !defined(HAVE_TILE_GEMM_AVX512)
    return amx_request_tiles() ? MAX_ROWS : 0;
#elif defined(HAVE_TILE_GEMM_AVX512)
    return MAX_ROWS;
#else
    return 0;
#endif
}

/* y (m, n) = x @ W^T + bias, or (fused) y (m, n / 2) = silu(gate) * up of it. */
static int product(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t m, int64_t n, int64_t k, int fused) {
    if (m < 1 || !tile_gemm_fits(n, k) || (fused && n % 32)) return 1;
#ifdef HAVE_TILE_GEMM_AMX
    if (amx_ready) {
        amx_gemm(x, packed, bias, y, m, n, k, fused);
        return 0;
    }
#endif
#ifdef HAVE_TILE_GEMM_AVX512
    avx512_gemm(x, packed, bias, y, m, n, k, fused);
    return 0;
#else
    (void)x; (void)packed; (void)bias; (void)y;
    return 1;
#endif
}

int tile_gemm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t m, int64_t n, int64_t k) {
    return product(x, packed, bias, y, m, n, k, 0);
}

/* y (m, n / 2) = silu(gate) * up of gate_up = x @ W^T + bias, W's rows gate then up (n of
 * them, n % 32 == 0): the products of gate's block j and up's block j meet in one group, and
 * the group's epilogue writes the activation, so gate_up never goes to memory. */
int tile_gemm_silu_mul_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k) {
    return product(x, packed, bias, y, m, n, k, 1);
}
