/* Part of cpu_tile_gemm.c: the product on AVX512-BF16 dot products (avx512_gemm,
 * HAVE_TILE_GEMM_AVX512), for CPUs without AMX.
 *
 * It reads the packed weight the AMX copy reads. Row r of tile packed[b][kb] holds, for the
 * block's 16 output columns, their pair of weights at k = 32 kb + 2 r, 2 r + 1: one vector of
 * 16 pairs, as vdpbf16ps takes them. With x's pair at the same k broadcast to the 16 lanes, one
 * vdpbf16ps adds both products to the 16 columns' float32 sums:
 *
 *   acc[i][c] (row i of x, the 16 columns of block c) += broadcast(x[i][2p], x[i][2p + 1]) . packed[c] row p
 *
 * A block's tiles follow each other, so its rows of pairs p = 0 .. k/2 - 1 are one contiguous
 * stream. A step over one pair multiplies `rows` rows of x by `blocks` column blocks (up to 24
 * accumulators of the 32 vector registers): each weight vector serves `rows` products, each
 * broadcast `blocks`. The sums stay in registers over all of k and are rounded to bf16 once,
 * with the bias, in the epilogue (SiLU-and-multiply's too).
 *
 * Each thread takes groups of column blocks (2-4 blocks, or 1-2 gate/up pairs; units_per_group)
 * and passes every block of rows of x by them: the group's weights come from memory for the
 * first block of rows and from L2 for the others. Where there are others, it prefetches its next
 * group's weights into L2 meanwhile, spread over the passes, so that the memory does not idle
 * while a group computes from L2.
 */
#ifndef VLLM_CPU_TILE_GEMM_AVX512_H
#define VLLM_CPU_TILE_GEMM_AVX512_H

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(VLLM_LAYER_OPS_X16)
#define HAVE_TILE_GEMM_AVX512 1

#include "prefetch.h"

#define DOT_ACCUMULATORS 24  /* of the 32 registers; the rest hold weights and a broadcast */
#define DOT_MAX_ROWS 12      /* rows of x per block of rows (one or two column blocks) */
#define PREFETCH_PAIRS 8     /* pairs of k per step of the prefetches (k / 2 is a multiple of 16) */

/* One group of column blocks: where their weights start, and where their outputs go. */
struct dot_group {
    const uint16_t *w[4];   /* block c's pairs: w[c] + 32 p is pair row p */
    int64_t column[4];      /* the block's first column in W's output (the bias's index) */
    int blocks, fused;      /* fused: blocks / 2 gate blocks, then the matching up blocks */
};

/* Rows x[0 .. ROWS) by the group's BLOCKS blocks, over all of k, then the epilogue into y
 * (rows of y_stride elements: n, or n / 2 fused), a step of the two prefetch streams `ahead` for
 * every PREFETCH_PAIRS pairs of k. ROWS and BLOCKS are constants in every copy
 * (dot_rows_blocks), so that the sums are registers. */
static inline __attribute__((always_inline)) void dot_rows(const int ROWS, const int BLOCKS, const uint16_t *x,
                                                           const struct dot_group *g, const uint16_t *bias,
                                                           uint16_t *y, int64_t y_stride, int64_t n, int64_t k,
                                                           prefetch_stream ahead[2]) {
    __m512 acc[DOT_MAX_ROWS][4];
    for (int i = 0; i < ROWS; ++i)
        for (int c = 0; c < BLOCKS; ++c) acc[i][c] = _mm512_setzero_ps();
    const uint16_t *w[4];
    for (int c = 0; c < BLOCKS; ++c) w[c] = g->w[c];
    for (int64_t p = 0; p < k / 2; ++p) {
        if (p % PREFETCH_PAIRS == 0) {
            prefetch_step(&ahead[0]);
            prefetch_step(&ahead[1]);
        }
        __m512bh wv[4];
        for (int c = 0; c < BLOCKS; ++c) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w[c] + 32 * p));
        for (int i = 0; i < ROWS; ++i) {
            const __m512bh xv = broadcast_bf16_pair(x + i * k + 2 * p);
            for (int c = 0; c < BLOCKS; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xv, wv[c]);
        }
    }
    if (!g->fused) {
        for (int i = 0; i < ROWS; ++i)
            for (int c = 0; c < BLOCKS; ++c) {
                const int64_t j = g->column[c];
                store_bf16x16(y + i * y_stride + j,
                              bias ? _mm512_add_ps(acc[i][c], bf16x16_to_float(bias + j)) : acc[i][c]);
            }
        return;
    }
    const int pairs = BLOCKS / 2;
    for (int i = 0; i < ROWS; ++i)
        for (int c = 0; c < pairs; ++c) {
            const int64_t j = g->column[c];  /* gate's column, = up's - n / 2 = y's */
            __m512 gate = acc[i][c], up = acc[i][c + pairs];
            if (bias) {
                gate = _mm512_add_ps(gate, bf16x16_to_float(bias + j));
                up = _mm512_add_ps(up, bf16x16_to_float(bias + n / 2 + j));
            }
            store_bf16x16(y + i * y_stride + j, silu_mul_x16(gate, up));
        }
}

typedef void (*dot_rows_fn)(const uint16_t *x, const struct dot_group *g, const uint16_t *bias, uint16_t *y,
                            int64_t y_stride, int64_t n, int64_t k, prefetch_stream ahead[2]);

#define DOT_ROWS(R, B)                                                                                  \
    static void dot_rows_##R##_##B(const uint16_t *x, const struct dot_group *g, const uint16_t *bias,  \
                                   uint16_t *y, int64_t y_stride, int64_t n, int64_t k,                 \
                                   prefetch_stream ahead[2]) {                                          \
        dot_rows(R, B, x, g, bias, y, y_stride, n, k, ahead);                                           \
    }
/* dot_max_rows(B) copies for each B: 12 rows by 1-2 blocks, 8 by 3, 6 by 4. */
#define DOT_ROWS_1_TO_6(B) DOT_ROWS(1, B) DOT_ROWS(2, B) DOT_ROWS(3, B) DOT_ROWS(4, B) DOT_ROWS(5, B) DOT_ROWS(6, B)
#define DOT_ROWS_7_TO_8(B) DOT_ROWS(7, B) DOT_ROWS(8, B)
#define DOT_ROWS_9_TO_12(B) DOT_ROWS(9, B) DOT_ROWS(10, B) DOT_ROWS(11, B) DOT_ROWS(12, B)
DOT_ROWS_1_TO_6(1) DOT_ROWS_7_TO_8(1) DOT_ROWS_9_TO_12(1)
DOT_ROWS_1_TO_6(2) DOT_ROWS_7_TO_8(2) DOT_ROWS_9_TO_12(2)
DOT_ROWS_1_TO_6(3) DOT_ROWS_7_TO_8(3)
DOT_ROWS_1_TO_6(4)

/* The copy for `rows` rows (1 .. dot_max_rows(blocks)) and `blocks` blocks (1-4). */
static dot_rows_fn dot_rows_blocks(int rows, int blocks) {
#define DOT_1_TO_6(B) dot_rows_1_##B, dot_rows_2_##B, dot_rows_3_##B, dot_rows_4_##B, dot_rows_5_##B, dot_rows_6_##B
#define DOT_7_TO_12(B) dot_rows_7_##B, dot_rows_8_##B, dot_rows_9_##B, dot_rows_10_##B, dot_rows_11_##B, dot_rows_12_##B
    static const dot_rows_fn table[4][DOT_MAX_ROWS] = {
        {DOT_1_TO_6(1), DOT_7_TO_12(1)}, {DOT_1_TO_6(2), DOT_7_TO_12(2)},
        {DOT_1_TO_6(3), dot_rows_7_3, dot_rows_8_3}, {DOT_1_TO_6(4)}};
#undef DOT_1_TO_6
#undef DOT_7_TO_12
    return table[blocks - 1][rows - 1];
}

/* The most rows whose sums by `blocks` blocks fit in the accumulators. */
static inline int dot_max_rows(int blocks) {
    return DOT_ACCUMULATORS / blocks < DOT_MAX_ROWS ? DOT_ACCUMULATORS / blocks : DOT_MAX_ROWS;
}

/* y = x @ W^T + bias (fused: silu(gate) * up of it), as tile_gemm_bf16 takes them. */
static void avx512_gemm(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k, int fused) {
    const int64_t nblocks = n / 16, half = nblocks / 2, threads = omp_get_max_threads();
    const int64_t units = fused ? half : nblocks;  /* blocks, or gate/up pairs of them */
    const int64_t size = fused ? units_per_group(units, threads, 1, 2) : units_per_group(units, threads, 2, 4);
    const int64_t groups = (units + size - 1) / size, y_stride = fused ? n / 2 : n;
    #pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t b0 = gi * size, count = units - b0 < size ? units - b0 : size;
        struct dot_group g = {.blocks = (int)(fused ? 2 * count : count), .fused = fused};
        for (int c = 0; c < g.blocks; ++c) {
            const int64_t b = group_block(fused, b0, count, half, c);
            g.w[c] = packed + b * 16 * k;
            g.column[c] = 16 * b;
        }
        /* Blocks of rows as even as the accumulators allow: 32 rows by 4 blocks are 5 x 4 + 6 + 6. */
        const int64_t most = dot_max_rows(g.blocks), row_blocks = (m + most - 1) / most;
        /* The next group (this thread's but after its last), prefetched over all the passes: its
         * blocks, or its gate blocks and its up blocks. In one pass, the group's own reads keep
         * the memory busy. */
        prefetch_stream ahead[2] = {prefetch_spread(packed, 0, 1), prefetch_spread(packed, 0, 1)};
        const int64_t next = b0 + size, next_count = units - next < size ? units - next : size;
        if (row_blocks > 1 && next < units)
            for (int r = 0; r < (fused ? 2 : 1); ++r)
                ahead[r] = prefetch_spread(packed + group_block(fused, next, next_count, half, r * next_count) * 16 * k,
                                           next_count * 16 * k * (int64_t)sizeof(uint16_t),
                                           row_blocks * (k / 2 / PREFETCH_PAIRS));
        for (int64_t rb = 0, r0 = 0; rb < row_blocks; ++rb) {
            const int64_t rows = (m - r0) / (row_blocks - rb);
            dot_rows_blocks((int)rows, g.blocks)(x + r0 * k, &g, bias, y + r0 * y_stride, y_stride, n, k, ahead);
            r0 += rows;
        }
    }
}

#endif
#endif
