/*
 * y = x @ W^T + bias for a few rows of x (decodes), bf16 in and out, float32 sums.
 *
 * A decode step's linear layers are bound by reading the weights: every bf16 weight is used
 * once per row of x. Each thread streams a contiguous range of W's rows, prefetching a few rows
 * ahead, and multiplies every row of x into it with AVX512-BF16 dot products (vdpbf16ps), one
 * float32 accumulator per x row kept in registers (the row count is a compile-time constant in
 * each copy), so W goes through the cores once, at the rate memory delivers it, whatever the
 * row count. Past a few rows the product stops being bound by the weights alone and the
 * accumulators outgrow the registers; oneDNN's blocked kernels (on AMX tiles where there are)
 * then do better, so the caller stops at MAX_ROWS.
 *
 * Layouts (contiguous): x (m, k), W (n, k) as nn.Linear stores it, bias (n) or NULL, y (m, n).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_ROWS 4
#define ROWS_AHEAD 8  /* W rows prefetched ahead of the one being read */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define DEFINE_GEMV(M)                                                                             \
static void gemv_##M(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,     \
                     int64_t n, int64_t k) {                                                      \
    const int64_t full = k / 32 * 32;                                                             \
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);                                 \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t j = 0; j < n; ++j) {                                                             \
        const uint16_t *wj = w + j * k;                                                           \
        __m512 acc[M];                                                                            \
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < full; i += 32) {                                                  \
            if (j + ROWS_AHEAD < n) _mm_prefetch((const char *)(wj + ROWS_AHEAD * k + i), _MM_HINT_T0); \
            const __m512bh b = (__m512bh)_mm512_loadu_si512((const void *)(wj + i));              \
            for (int m = 0; m < M; ++m)                                                           \
                acc[m] = _mm512_dpbf16_ps(                                                        \
                    acc[m], (__m512bh)_mm512_loadu_si512((const void *)(x + m * k + i)), b);      \
        }                                                                                         \
        if (tail) {                                                                               \
            const __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(tail, wj + full);               \
            for (int m = 0; m < M; ++m)                                                           \
                acc[m] = _mm512_dpbf16_ps(                                                        \
                    acc[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * k + full), b);       \
        }                                                                                         \
        const float b0 = bias ? bf16_to_float(bias[j]) : 0.0f;                                    \
        for (int m = 0; m < M; ++m) y[m * n + j] = float_to_bf16(_mm512_reduce_add_ps(acc[m]) + b0); \
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
