/*
 * Part of cpu_gguf_gemv.c, the tiled product's dequantization.
 *
 * Past a few rows the weight-stationary products (cpu_gguf_gemv_rows.h) run out of arithmetic:
 * each weight block is unpacked and rescaled once per row of x. The bf16 tile GEMM
 * (cpu_tile_gemm.c) does far more multiply-adds per instruction, so for more rows W is
 * dequantized, a panel of rows at a time, into a bf16 scratch in the tile GEMM's layout:
 *
 *   tiles[b][kb] = 16 x 16 pairs: row r, column c = W[16 b + c][32 kb + 2 r], W[16 b + c][32 kb + 2 r + 1]
 *
 * (block kb of output row 16 b + c is column c of tile (b, kb)), and the tile GEMM multiplies x
 * into the panel. A panel is at most PANEL_BYTES of bf16 so that it stays in the cache between
 * its dequantization and its product. Which product serves which rows: gguf_product_path.
 */
#ifndef VLLM_CPU_GGUF_GEMV_TILES_H
#define VLLM_CPU_GGUF_GEMV_TILES_H

#include "bf16.h"
#include "cpu_gguf_gemv_blocks.h"

#define PANEL_BYTES (512 * 1024)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* One stage of transpose16, with s a constant in each call (the index vectors fold). */
static inline __attribute__((always_inline)) void transpose_stage(__m512i r[16], const int s) {
    const __m512i j = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 upper = _mm512_test_epi32_mask(j, _mm512_set1_epi32(s));  /* j & s */
    /* row i takes b[j - s] (as index 16 + j - s) where j & s; row i + s takes a[j + s] where not */
    const __m512i ilo = _mm512_mask_add_epi32(j, upper, j, _mm512_set1_epi32(16 - s));
    const __m512i ihi = _mm512_mask_add_epi32(_mm512_add_epi32(j, _mm512_set1_epi32(s)), upper, j,
                                              _mm512_set1_epi32(16));
    for (int i = 0; i < 16; ++i) {
        if (i & s) continue;
        const __m512i a = r[i], b = r[i + s];
        r[i] = _mm512_permutex2var_epi32(a, ilo, b);
        r[i + s] = _mm512_permutex2var_epi32(a, ihi, b);
    }
}

/* r (16 x 16 32-bit words) -> its transpose: each stage swaps the off-diagonal s x s blocks of
 * every 2s x 2s block, [[A, B], [C, D]] -> [[A, C], [B, D]], for s = 8, 4, 2, 1. */
static inline void transpose16(__m512i r[16]) {
    transpose_stage(r, 8);
    transpose_stage(r, 4);
    transpose_stage(r, 2);
    transpose_stage(r, 1);
}
#endif

/* Rows [j0, j0 + rows) of W (rows % 16 == 0) -> tiles, bf16, rounded to nearest even. */
static void dequantize_tiles(const uint8_t *w, int type, int64_t j0, int64_t rows, int64_t k, uint16_t *tiles) {
    const int64_t rb = row_bytes(type, k), nb = k / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < rows / 16; ++b)
        for (int64_t kb = 0; kb < nb; ++kb) {
            uint32_t *tile = (uint32_t *)(tiles + (b * nb + kb) * 512);
            const uint8_t *first = w + (j0 + 16 * b) * rb;  /* the tile's row 0 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            __m512i pairs[16];  /* row c: its block's 16 pairs (w_2r, w_2r+1); transposed: tile row r */
            for (int c = 0; c < 16; ++c) {
                __m512 lo, hi;
                dequantize_row_block16(first + c * rb, kb, type, &lo, &hi);
                pairs[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            }
            transpose16(pairs);
            for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * 16, pairs[r]);
#else
            for (int c = 0; c < 16; ++c) {
                float block[QK];
                dequantize_row_block(first + c * rb, kb, type, block);
                for (int r = 0; r < 16; ++r)
                    tile[r * 16 + c] = (uint32_t)float_to_bf16(block[2 * r]) |
                                       (uint32_t)float_to_bf16(block[2 * r + 1]) << 16;
            }
#endif
        }
}

#endif  /* VLLM_CPU_GGUF_GEMV_TILES_H */
