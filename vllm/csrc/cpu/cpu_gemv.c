/*
 * y = x @ W^T + bias for a few rows of x (decodes), bf16 in and out, float32 sums.
 *
 * A decode step's linear layers are bound by reading the weights: every bf16 weight is used
 * once per row of x, so the kernel is as fast as it can be when W goes through each core at the
 * rate a plain read of the same bytes reaches (benchmarks/benchmark_gemv.py compares the two).
 * Each thread streams its own contiguous range of W's rows, prefetching into L2 a few rows
 * ahead, and walks it in blocks of BLOCK rows: every 64-byte line of the block's rows meets
 * every row of x in AVX512-BF16 dot products (vdpbf16ps), each (x row, W row) pair in its own
 * float32 accumulator. The block gives BLOCK * m independent chains of dot products (one chain
 * alone waits on the instruction's latency) and loads each line of x once for BLOCK lines of
 * W; the row count m is a compile-time constant in each copy, so the accumulators stay in
 * registers. Past a few rows the product stops being bound by the weights alone and the
 * accumulators outgrow the registers; the tile GEMM (cpu_tile_gemm.c, or oneDNN) then does
 * better, so the caller stops at MAX_ROWS.
 *
 * Each output is the same float32 sum as a row-at-a-time loop would make (the k-order of the
 * dot products is unchanged; only the final sum of an accumulator's 16 lanes is grouped
 * differently), rounded once to bf16.
 *
 * Layouts (contiguous): x (m, k), W (n, k) as nn.Linear stores it, bias (n) or NULL, y (m, n).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_ROWS 4
#define BLOCK 4                   /* W rows walked together */
#define PREFETCH_BYTES (8 * 1024)  /* how far ahead of the rows being read W is prefetched */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <omp.h>

/* The 16-lane sums of a, b, c, d as the 4 lanes of one vector. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVE(v) _mm256_add_ps(_mm512_castps512_ps256(v), \
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#define QUARTER(v) _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
    const __m128 qa = QUARTER(HALVE(a)), qb = QUARTER(HALVE(b)), qc = QUARTER(HALVE(c)), qd = QUARTER(HALVE(d));
#undef HALVE
#undef QUARTER
    return _mm_hadd_ps(_mm_hadd_ps(qa, qb), _mm_hadd_ps(qc, qd));
}

/* y[:, j:j+R] for W rows j..j+R-1 (R = BLOCK or 1); prefetches the rows `ahead` rows on when
 * they are still this thread's (`prefetch`). M and R are constants where this is inlined. */
static inline __attribute__((always_inline)) void gemv_block(
        const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k,
        int64_t j, int64_t ahead, int prefetch, const int M, const int R) {
    const int64_t full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
    const uint16_t *wj = w + j * k;
    __m512 acc[MAX_ROWS][BLOCK];
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 32) {
        __m512bh b[BLOCK];
        for (int r = 0; r < R; ++r) {
            if (prefetch) _mm_prefetch((const char *)(wj + (ahead + r) * k + i), _MM_HINT_T1);
            b[r] = (__m512bh)_mm512_loadu_si512((const void *)(wj + r * k + i));
        }
        for (int m = 0; m < M; ++m) {
            const __m512bh a = (__m512bh)_mm512_loadu_si512((const void *)(x + m * k + i));
            for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], a, b[r]);
        }
    }
    if (tail) {
        __m512bh b[BLOCK];
        for (int r = 0; r < R; ++r) b[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wj + r * k + full);
        for (int m = 0; m < M; ++m) {
            const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * k + full);
            for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], a, b[r]);
        }
    }
    for (int m = 0; m < M; ++m) {
        float sums[BLOCK];
        if (R == BLOCK) _mm_storeu_ps(sums, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        else sums[0] = _mm512_reduce_add_ps(acc[m][0]);
        for (int r = 0; r < R; ++r)
            y[m * n + j + r] = float_to_bf16(sums[r] + (bias ? bf16_to_float(bias[j + r]) : 0.0f));
    }
}

/* One thread's rows: blocks of BLOCK (rows [begin, end) of W), then the rows left over. */
static inline __attribute__((always_inline)) void gemv_rows(
        const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k,
        int64_t begin, int64_t end, const int M) {
    const int64_t blocks_ahead = (PREFETCH_BYTES / (2 * k) + BLOCK - 1) / BLOCK;
    const int64_t ahead = (blocks_ahead > 0 ? blocks_ahead : 1) * BLOCK;  /* rows */
    int64_t j = begin;
    for (; j + BLOCK <= end; j += BLOCK)
        gemv_block(x, w, bias, y, n, k, j, ahead, j + ahead + BLOCK <= end, M, BLOCK);
    for (; j < end; ++j) gemv_block(x, w, bias, y, n, k, j, 0, 0, M, 1);
}

#define DEFINE_GEMV(M)                                                                             \
static void gemv_##M(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,     \
                     int64_t n, int64_t k) {                                                      \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        /* Each thread a contiguous range of whole blocks; the last one also the rows past them. */ \
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), blocks = n / BLOCK; \
        const int64_t begin = blocks * t / threads * BLOCK;                                       \
        const int64_t end = t == threads - 1 ? n : blocks * (t + 1) / threads * BLOCK;            \
        gemv_rows(x, w, bias, y, n, k, begin, end, M);                                            \
    }                                                                                             \
}

DEFINE_GEMV(1)
DEFINE_GEMV(2)
DEFINE_GEMV(3)
DEFINE_GEMV(4)

int gemv_supported(void) { return MAX_ROWS; }

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
              int64_t m, int64_t n, int64_t k) {
    switch (m) {
    case 1: gemv_1(x, w, bias, y, n, k); return 0;
    case 2: gemv_2(x, w, bias, y, n, k); return 0;
    case 3: gemv_3(x, w, bias, y, n, k); return 0;
    case 4: gemv_4(x, w, bias, y, n, k); return 0;
    default: return 1;
    }
}

#else  /* no AVX512-BF16 on this CPU: the caller keeps oneDNN */

int gemv_supported(void) { return 0; }

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
              int64_t m, int64_t n, int64_t k) {
    (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return 1;
}

#endif
