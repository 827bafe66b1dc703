/*
 * Three element-wise steps of a Llama layer for many bf16 rows (prefill chunks), one pass each,
 * rows split over the threads: RMS norm (alone, or after the residual add), the rotary
 * embedding and SiLU-and-multiply.
 *
 * In eager torch they are 7 (8 with the add), 4 and 2 ops, each a pass over the rows with its
 * own dispatch and its own output written to memory and read back by the next. Here each step
 * reads its rows once and keeps the intermediates in registers. Rounding follows torch's eager bf16 ops
 * (layer_ops.h, shared with the C decoder layer, llama_cpu_layers.c).
 *
 * Layouts: rows of x and y contiguous; rotary's x rows `x_stride` elements apart (q and k
 * inside a qkv row), its heads contiguous, its output (rows, heads, d) contiguous.
 */
#include <stdint.h>

#include "layer_ops.h"

int rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * n, w, y + r * n, n, eps);
    return 0;
}

/* The residual stream's add and the next norm in one pass: residual += delta (in place, rounded
 * as torch's bf16 add), y = rms_norm(residual). */
int add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *w, uint16_t *y,
                      int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        add_into(residual + r * n, delta + r * n, n);
        rms_norm_row(residual + r * n, w, y + r * n, n, eps);
    }
    return 0;
}

int rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                uint16_t *y, int64_t rows, int64_t heads, int64_t d) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h)
            rotate(x + r * x_stride + h * d, cos + r * d, sin + r * d, y + (r * heads + h) * d, d);
    return 0;
}

int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * n, out + r * n, n);
    return 0;
}
