/*
 * y = x @ W^T + bias for the rows of a decode batch, float32 in and out, on any CPU with AVX2
 * and FMA: the float32 twin of cpu_gemv.c's bf16 GEMV, for models that run in float32 (the
 * default for unquantized weights where the CPU has no bf16 dot products).
 *
 * A product of a few rows reads every weight once per row of x, so it is bound by the weights'
 * bytes, and a few dozen rows are still far from a GEMM's blocking; BLAS libraries' float32
 * GEMV and small GEMMs may come near neither bound on every CPU they meet
 * (benchmarks/benchmark_gemv.py --dtype float32 compares this kernel with F.linear and a plain
 * read). The walk is cpu_gemv.c's: each thread streams its own contiguous range of W's rows in
 * blocks, and each 8 floats of the block's rows meet the rows of x in groups of GROUP, with a
 * float32 accumulator of 8 lanes per (x row, W row) pair; the block stays in L1 while the
 * groups pass. A group's size M and the block's R are compile-time constants in each copy, so
 * the accumulators stay in registers: 4 rows of W per block for up to 2 rows of x, else 3.
 *
 * Every output is reduced the same way (sum_lanes4 and sum_x8 add the lanes in one order), so
 * an output's bits depend on neither the number of rows of x, nor which block or thread took
 * its row of W.
 *
 * Layouts (contiguous): x (m, k), W (n, k) as nn.Linear stores it, bias (n) or NULL, y (m, n).
 */
#include <stdint.h>

#define GROUP 4      /* rows of x per pass over a block of W */
#define MAX_BLOCK 4  /* rows of W per block */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "lane_sum.h"

/* W rows per block for M rows of x: up to 12 accumulators beside the block's loads, and enough
 * rows that x's loads do not outnumber W's. */
static inline int64_t block_rows(int M) { return M <= 2 ? MAX_BLOCK : 3; }

/* The 8-lane sums of a, b, c, d, each added in sum_x8's order, as the 4 lanes of one vector. */
static inline __m128 sum_lanes4(__m256 a, __m256 b, __m256 c, __m256 d) {
#define HALVES(v) _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
    __m128 r0 = HALVES(a), r1 = HALVES(b), r2 = HALVES(c), r3 = HALVES(d);
#undef HALVES
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  /* r_i: lane i of each */
    return _mm_add_ps(_mm_add_ps(r0, r2), _mm_add_ps(r1, r3));
}

/* Lanes [0, count) set: the mask of a tail of fewer than 8 floats. */
static inline __m256i tail_mask(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* y[:, j:j+R] for W rows j..j+R-1. M and R are constants where this is inlined. While it
 * reads a line of its rows it asks for the same line of the next block's rows into L1: with a
 * block's FMAs between its loads, the core otherwise keeps too few lines in flight to stream
 * at the memory's rate from 2 rows of x on. (Past the thread's last block the prefetches fall
 * on rows it does not read, or past W: prefetches are hints and never fault.) */
static inline __attribute__((always_inline)) void gemv_block(
        const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t k, int64_t j,
        int prefetch, const int M, const int R) {
    const float *wj = w + j * k, *next = wj + R * k;
    __m256 acc[GROUP][MAX_BLOCK];
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 b[MAX_BLOCK];
        for (int r = 0; r < R; ++r) {
            if (prefetch && i % 16 == 0)  /* a line: 16 floats */
                _mm_prefetch((const char *)(next + r * k + i), _MM_HINT_T0);
            b[r] = _mm256_loadu_ps(wj + r * k + i);
        }
        for (int m = 0; m < M; ++m) {
            const __m256 a = _mm256_loadu_ps(x + m * k + i);
            for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(a, b[r], acc[m][r]);
        }
    }
    if (i < k) {  /* the last 7 at most, masked */
        const __m256i mask = tail_mask(k - i);
        for (int m = 0; m < M; ++m) {
            const __m256 a = _mm256_maskload_ps(x + m * k + i, mask);
            for (int r = 0; r < R; ++r)
                acc[m][r] = _mm256_fmadd_ps(a, _mm256_maskload_ps(wj + r * k + i, mask), acc[m][r]);
        }
    }
    for (int m = 0; m < M; ++m) {
        float sums[MAX_BLOCK];
        if (R == 4) _mm_storeu_ps(sums, sum_lanes4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        else
            for (int r = 0; r < R; ++r) sums[r] = sum_x8(acc[m][r]);
        for (int r = 0; r < R; ++r) y[m * n + j + r] = sums[r] + (bias ? bias[j + r] : 0.0f);
    }
}

/* y[:, j:j+R] for all m rows of x: the block meets them in groups of GROUP (then the rest) while
 * its rows are in L1 (only the first group prefetches the next block). R is a constant where
 * this is inlined. */
static inline __attribute__((always_inline)) void block_product(
        const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
        int64_t j, const int R) {
    int64_t t = 0;
    for (; t + GROUP <= m; t += GROUP) gemv_block(x + t * k, w, bias, y + t * n, n, k, j, t == 0, GROUP, R);
    switch (m - t) {
    case 1: gemv_block(x + t * k, w, bias, y + t * n, n, k, j, t == 0, 1, R); break;
    case 2: gemv_block(x + t * k, w, bias, y + t * n, n, k, j, t == 0, 2, R); break;
    case 3: gemv_block(x + t * k, w, bias, y + t * n, n, k, j, t == 0, 3, R); break;
    default: break;
    }
}

/* Rows [begin, end) of W times all m rows of x: blocks of R rows, then the rows left over. */
static inline __attribute__((always_inline)) void thread_rows(
        const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
        int64_t begin, int64_t end, const int R) {
    int64_t j = begin;
    for (; j + R <= end; j += R) block_product(x, w, bias, y, m, n, k, j, R);
    for (; j < end; ++j) block_product(x, w, bias, y, m, n, k, j, 1);
}

int gemv_f32_supported(void) { return 1; }

int gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k) {
    if (m < 1) return 1;
    const int64_t rows = block_rows(m < GROUP ? (int)m : GROUP);
    #pragma omp parallel
    {
        /* Each thread a contiguous range of whole blocks; the last one also the rows past them.
         * R is a literal in each call, so that it stays a constant in the outlined region. */
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num(), blocks = n / rows;
        const int64_t begin = blocks * t / threads * rows;
        const int64_t end = t == threads - 1 ? n : blocks * (t + 1) / threads * rows;
        if (rows == 4) thread_rows(x, w, bias, y, m, n, k, begin, end, 4);
        else thread_rows(x, w, bias, y, m, n, k, begin, end, 3);
    }
    return 0;
}

#else  /* no AVX2 with FMA: the caller keeps F.linear */

int gemv_f32_supported(void) { return 0; }

int gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k) {
    (void)x; (void)w; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return 1;
}

#endif
