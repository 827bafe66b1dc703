/*
 * y = x @ W^T for W stored in GGUF blocks, dequantized inside the product (never to memory).
 *
 * Batch-1 decode reads every weight once per step, so its speed is the weight bytes memory
 * delivers per second: a Q4_1 row is 5 bits a weight where bf16 is 16. Each thread streams a
 * contiguous range of W's rows (OpenMP over output rows) and multiplies up to TILE rows of x
 * into each one while its blocks are in L1.
 *
 * Two weight-stationary products, both with float32 sums (a bias, in x's dtype, added to them):
 *   gguf_matmul_float  x in float32 (bf16 x widened): each block dequantized to float32 exactly
 *                      as the gguf package does, then multiplied; AVX-512, AVX2 with FMA, else
 *                      portable C.
 *   gguf_matmul_int8   x quantized per 32-block to int8 like llama.cpp's Q8 activation blocks
 *                      (dx = max|x| / 127, qx = round-to-nearest-even(x / dx)), integer dot
 *                      products of weight and activation codes (vpdpbusd, or AVX2's vpmaddubsw
 *                      and vpmaddwd: exact in int32), then dw * dx * dot summed in float32. Each
 *                      x differs from dx * qx by at most dx / 2, that is max|x of its block| / 254.
 *                      Where AVX2 is built (AVX512-VNNI or AVX-VNNI give the single-instruction
 *                      dot products); gguf_int8_supported() says.
 * and, for bf16 x of any number of rows, two products made for many rows (below): the int8
 * GEMM (the int8 product's arithmetic on 16-row panels of W unpacked once per call: AVX512-VNNI,
 * or where AVX2 is the widest, its pair products on 8-row halves of the panels) and a tiled
 * product (W dequantized to bf16 panel by panel for the tile GEMM of cpu_tile_gemm.c). gguf_product_bf16 chooses among them by the shape (gguf_product_path); the
 * C decoder layers (llama_cpu_layers.c) call it through one entry point per type and layout.
 *
 * Layouts (contiguous): x (m, k) float32 or bf16; W n rows of whole blocks; y (m, n) in x's
 * dtype. k must be a multiple of the type's block (32 weights, 256 for Q4_K and Q6_K), as GGUF
 * rows are.
 *
 * Panels (cpu_gguf_gemv_blocks.h): only the GEMM and gguf_dequantize read them; the other products
 * return 1 for them.
 *
 * The parts: cpu_gguf_gemv_blocks.h (block and panel layouts, dequantization),
 * cpu_gguf_gemv_rows.h (the weight-stationary products' loops), cpu_gguf_gemv_tiles.h (the
 * tiled product's dequantization), cpu_gguf_gemv_panels.h (the AVX512-VNNI int8 GEMM's) and
 * cpu_gguf_gemv_panels_avx2.h (the AVX2 one's).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_gguf_gemv_blocks.h"
#include "cpu_gguf_gemv_rows.h"
#include "cpu_gguf_gemv_tiles.h"
#include "cpu_gguf_gemv_panels.h"
#include "cpu_gguf_gemv_panels_avx2.h"

/* Rows `rows` (the first num_rows if NULL) of W's n rows, dequantized into out (num_rows, k),
 * float32 or bf16, a block at a time in the widest vectors built. Returns 3, writing nothing, if
 * a row is not in [0, n). */
int gguf_dequantize(const uint8_t *w, int type, const int64_t *rows, int64_t num_rows, int64_t n,
                    int64_t k, void *out, int out_bf16) {
    const int panels = (type & GGUF_PANELS) != 0;
    type &= ~GGUF_PANELS;
    const int64_t rb = row_bytes(type, k), nb = k / QK;
    if (rb == 0 || (panels && (!panel_type(type) || n % 16))) return 1;
    for (int64_t r = 0; r < num_rows; ++r)
        if ((rows ? rows[r] : r) < 0 || (rows ? rows[r] : r) >= n) return 3;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t j = rows ? rows[r] : r;
        const uint8_t *row = w + j * rb;
        float block[QK];
        for (int64_t b = 0; b < nb; ++b) {
            if (!panels && !out_bf16) {  /* straight into the float32 rows */
                dequantize_row_block_vectors(row, b, type, (float *)out + r * k + b * QK);
                continue;
            }
            if (panels) {  /* the row's block b put back together from its panel's lane */
                uint8_t bytes[34];
                move_panel_block(w + (j / 16 * nb + b) * 16 * block_bytes(type), bytes, type, (int)(j % 16), 0);
                dequantize_block(bytes, type, block);
            } else {
                dequantize_row_block_vectors(row, b, type, block);
            }
            for (int i = 0; i < QK; ++i) store(out, out_bf16, r * k + b * QK + i, block[i]);
        }
    }
    return 0;
}

int gguf_matmul_float(const void *x, int bf16, const uint8_t *w, int type, const void *bias, void *y,
                      int64_t m, int64_t n, int64_t k) {
    const int64_t rb = row_bytes(type, k), nb = k / QK;
    if (rb == 0) return 1;
    float *owned;
    const float *xf = float_rows(x, bf16, m * k, &owned);
    if (xf == NULL) return 2;
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t *row = w + j * rb;
        const float b0 = bias_at(bias, bf16, j);
        for (int64_t t0 = 0; t0 < m; t0 += TILE) {
            const int tm = m - t0 < TILE ? (int)(m - t0) : TILE;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
            switch (type) {
            case TYPE_Q8_0: row_float(row, TYPE_Q8_0, xf, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_0: row_float(row, TYPE_Q4_0, xf, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_K: row_float_q4_k(row, xf, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q6_K: row_float(row, TYPE_Q6_K, xf, b0, y, bf16, j, t0, tm, n, k); break;
            default: row_float(row, TYPE_Q4_1, xf, b0, y, bf16, j, t0, tm, n, k); break;
            }
            continue;
#endif
            float acc[TILE][QK] = {{0}};
            float block[QK];
            for (int64_t b = 0; b < nb; ++b) {
                dequantize_row_block(row, b, type, block);
                for (int t = 0; t < tm; ++t) {
                    const float *xt = xf + (t0 + t) * k + b * QK;
                    for (int i = 0; i < QK; ++i) acc[t][i] += block[i] * xt[i];
                }
            }
            for (int t = 0; t < tm; ++t) {
                float sum = 0.0f;
                for (int i = 0; i < QK; ++i) sum += acc[t][i];
                store(y, bf16, (t0 + t) * n + j, sum + b0);
            }
        }
    }
    free(owned);
    return 0;
}

#ifdef HAVE_GGUF_INT8_ROWS
int gguf_int8_supported(void) { return 1; }

int gguf_matmul_int8(const void *x, int bf16, const uint8_t *w, int type, const void *bias, void *y,
                     int64_t m, int64_t n, int64_t k) {
    const int64_t rb = row_bytes(type, k), nb = k / QK;
    if (rb == 0) return 1;
    float *owned;
    const float *xf = float_rows(x, bf16, m * k, &owned);
    int8_t *qx = malloc((size_t)(m * k));
    float *dx = malloc((size_t)(m * nb) * sizeof *dx);
    float *dxsx = malloc((size_t)(m * nb) * sizeof *dxsx);
    if (xf == NULL || qx == NULL || dx == NULL || dxsx == NULL) {
        free(owned); free(qx); free(dx); free(dxsx);
        return 2;
    }
    /* A few rows of x (the caller's GEMV rows): quantized by one thread, no second fork. */
    for (int64_t i = 0; i < m * nb; ++i) quantize_block(xf + i * QK, qx + i * QK, dx + i, dxsx + i);
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t *row = w + j * rb;
        const float b0 = bias_at(bias, bf16, j);
        for (int64_t t0 = 0; t0 < m; t0 += TILE) {
            const int tm = m - t0 < TILE ? (int)(m - t0) : TILE;
            switch (type) {
            case TYPE_Q8_0: row_int8(row, TYPE_Q8_0, qx, dx, dxsx, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_0: row_int8(row, TYPE_Q4_0, qx, dx, dxsx, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_K: row_int8_q4_k(row, qx, dx, dxsx, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q6_K: row_int8_q6_k(row, qx, dx, b0, y, bf16, j, t0, tm, n, k); break;
            default: row_int8(row, TYPE_Q4_1, qx, dx, dxsx, b0, y, bf16, j, t0, tm, n, k); break;
            }
        }
    }
    free(owned); free(qx); free(dx); free(dxsx);
    return 0;
}

#else  /* no int8 dot products on this CPU: gguf_matmul_float serves */

int gguf_int8_supported(void) { return 0; }

int gguf_matmul_int8(const void *x, int bf16, const uint8_t *w, int type, const void *bias, void *y,
                     int64_t m, int64_t n, int64_t k) {
    (void)x; (void)bf16; (void)w; (void)type; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return 1;
}

#endif

/* The tiled product (cpu_gguf_gemv_tiles.h): W dequantized panel by panel for cpu_tile_gemm.c. */
typedef int (*tile_gemm_fn)(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k);
static tile_gemm_fn tile_gemm;  /* cpu_tile_gemm.c's tile_gemm_bf16, given once by gguf_use_tile_gemm */

/* Hands over the tile GEMM (NULL: none, every row count takes the products above). */
int gguf_use_tile_gemm(void *gemm) {
    tile_gemm = (tile_gemm_fn)gemm;
    return 0;
}

static int tiled_fits(int64_t n, int64_t k) { return tile_gemm != NULL && n % 16 == 0 && k % QK == 0; }

/* y (m, n) = x @ W^T + bias on the tile GEMM, W dequantized panel by panel; 1 where the tile
 * GEMM is not given or the shape does not fit it. */
int gguf_tiled_product_bf16(const uint16_t *x, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k) {
    if (row_bytes(type, k) == 0 || !tiled_fits(n, k)) return 1;
    int64_t panel = PANEL_BYTES / (2 * k) / 16 * 16;
    panel = panel < 16 ? 16 : panel > n ? n : panel;
    uint16_t *tiles = malloc((size_t)(panel * k) * sizeof *tiles);
    uint16_t *part = panel < n ? malloc((size_t)(m * panel) * sizeof *part) : NULL;  /* (m, panel) */
    if (tiles == NULL || (panel < n && part == NULL)) {
        free(tiles); free(part);
        return 2;
    }
    int status = 0;
    for (int64_t j0 = 0; j0 < n && status == 0; j0 += panel) {
        const int64_t rows = n - j0 < panel ? n - j0 : panel;
        dequantize_tiles(w, type, j0, rows, k, tiles);
        if (part == NULL) {
            status = tile_gemm(x, tiles, bias, y, m, rows, k);
            continue;
        }
        status = tile_gemm(x, tiles, bias == NULL ? NULL : bias + j0, part, m, rows, k);
        for (int64_t t = 0; t < m; ++t) memcpy(y + t * n + j0, part + t * rows, (size_t)rows * sizeof *y);
    }
    free(tiles); free(part);
    return status;
}

/* Whether the int8 GEMM decodes `type` (in rows or in panels), where it is built
 * (gguf_gemm_supported). */
int gguf_gemm_decodes(int type) {
#ifdef HAVE_GGUF_GEMM_AVX2
    return gemm8_type(type & ~GGUF_PANELS);
#else
    return gemm_type(type & ~GGUF_PANELS);
#endif
}

/* Whether weights of `type` are regrouped into panels for the GEMM (else it reads their rows). */
int gguf_has_panels(int type) { return panel_type(type); }

/* W's n rows of `type` (n a multiple of 16) -> `out`, the same bytes regrouped into panels
 * (cpu_gguf_gemv_blocks.h); 1 where the type has no panels or n is not whole panels. */
int gguf_to_panels(const uint8_t *w, int type, int64_t n, int64_t k, uint8_t *out) {
    const int64_t rb = row_bytes(type, k), nb = k / QK, bb = block_bytes(type);
    if (rb == 0 || !panel_type(type) || n % 16) return 1;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < n / 16; ++p)
        for (int64_t kb = 0; kb < nb; ++kb)
            for (int c = 0; c < 16; ++c)
                move_panel_block(w + (16 * p + c) * rb + kb * bb, out + (p * nb + kb) * 16 * bb, type, c, 1);
    return 0;
}

#ifdef HAVE_GGUF_GEMM
int gguf_gemm_supported(void) { return 1; }

/* y (m, n) bf16 = x @ W^T + bias on the int8 GEMM: x (m, k) bf16, bias (n) bf16 or NULL. */
int gguf_gemm_int8_bf16(const uint16_t *x, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k) {
    const int in_panels = (type & GGUF_PANELS) != 0;
    type &= ~GGUF_PANELS;
    if (!gguf_gemm_decodes(type) || row_bytes(type, k) == 0 || (in_panels && (!panel_type(type) || n % 16))) return 1;
    if (m == 0 || n == 0) return 0;
    const int64_t nb = k / QK, panels = (n + 15) / 16, stride = row_bytes(type, k);
    quantized_x q = {malloc((size_t)(m * k)), malloc((size_t)(m * nb) * sizeof(float)),
                     malloc((size_t)(m * nb) * sizeof(float)), malloc((size_t)(m * nb) * sizeof(int32_t))};
    int status = 0;
    if (q.qx == NULL || q.dx == NULL || q.dxsx == NULL || q.start == NULL) {
        free(q.qx); free(q.dx); free(q.dxsx); free(q.start);
        return 2;
    }
    quantize_x(x, type, m, k, q);
    /* x of more rows than a tile: a thread unpacks two panels at a time (an odd last one alone) */
    const int few_rows = m <= GEMM_TILE, group = few_rows ? 1 : 2;
    #pragma omp parallel
    {
        /* per panel: nb x (8 zmm of codes, 16 D, 16 M) */
        const size_t unpacked = (size_t)nb * (8 * sizeof(__m512i) + 2 * sizeof(__m512));
        char *buffer = few_rows ? NULL : aligned_alloc(64, 2 * unpacked);
        if (!few_rows && buffer == NULL) {
            #pragma omp atomic write
            status = 2;
        }
        int started = 0;
        /* nowait: the panels' outputs are disjoint, and the region's end is the one barrier */
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < (panels + group - 1) / group; ++i) {
            if (!few_rows && buffer == NULL) continue;
            const int64_t p = group * i;
            /* Each panel's multiplication prefetches the one PREFETCH_PANELS on; a share's first
             * ones, all at once. */
            if (!started) {
                prefetch_panels(w, n, stride, p, PREFETCH_PANELS);
                started = 1;
            }
            /* the panels PREFETCH_PANELS on, prefetched while these multiply (where W has them) */
            const int64_t ahead = 16 * (p + PREFETCH_PANELS);
            const uint8_t *next = prefetched(w, n, ahead, stride);
            if (few_rows) {
                multiply_panel_rows(w, type, in_panels, 16 * p, panel_height(n, 16 * p), nb, next,
                                    panel_height(n, ahead) * stride, q, m, bias, y, n);
                continue;
            }
            unpacked_panel u[2];
            const int count = p + 1 < panels ? 2 : 1;
            for (int j = 0; j < count; ++j) {
                const int64_t row = 16 * (p + j);
                u[j] = unpack_panel(w, type, in_panels, row, panel_height(n, row), nb, buffer + j * unpacked);
            }
            const int64_t ahead_rows = panel_height(n, ahead) + (count == 2 ? panel_height(n, ahead + 16) : 0);
            if (count == 2)
                panel_pair_rows(u, q, has_minimum(type), bias, y, 16 * p, m, n, k, next, ahead_rows * stride);
            else
                panel_rows(u[0], q, has_minimum(type), bias, y, 16 * p, m, n, k, next, ahead_rows * stride);
        }
        free(buffer);
    }
    free(q.qx); free(q.dx); free(q.dxsx); free(q.start);
    return status;
}

#elif defined(HAVE_GGUF_GEMM_AVX2)
int gguf_gemm_supported(void) { return 1; }

int gguf_gemm_int8_bf16(const uint16_t *x, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k) {
    return gemm8_int8_bf16(x, w, type & ~GGUF_PANELS, (type & GGUF_PANELS) != 0, bias, y, m, n, k);
}

#else  /* no int8 GEMM: the products above serve */

int gguf_gemm_supported(void) { return 0; }

int gguf_gemm_int8_bf16(const uint16_t *x, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k) {
    (void)x; (void)w; (void)type; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return 1;
}

#endif

/*
 * Which product serves m rows of bf16 x (benchmarks/benchmark_gguf_products.py --copies 30
 * times them per shape, each weight read from memory as in a step): the int8 GEMM wherever it
 * is built and decodes the type, from gemm_min_rows(type) rows: on the default model's shapes
 * it is ahead of the tiled product at every row count the benchmark times, and of the
 * weight-stationary int8 product from one row on panels (for Q8_0's single row, by a few
 * percent on most shapes) and from two on Q4_K's rows. AVX2's is ahead of it or level from one
 * row on panels and on the lm_head's rows (gguf_products_epyc_zen3_avx2.json). Without it, the
 * tiled product from tiled_min_rows(type) rows, where it overtakes the weight-stationary one
 * (the same benchmark), and that one below. Panels are made only where the GEMM is built: only
 * it multiplies them.
 */
enum { PATH_FLOAT, PATH_INT8, PATH_GEMM, PATH_TILED };  /* cpu_gguf_gemv.PATHS */

static int64_t gemm_min_rows(int type) {
    return type == TYPE_Q4_K ? 2 : 1;  /* gguf_products_q4_k.json */
}

static int64_t tiled_min_rows(int type) {
    switch (type) {
    case TYPE_Q4_1: return 4;
    case TYPE_Q4_0: return 5;
    case TYPE_Q4_K: return 5;  /* gguf_products_q4_k.json (K rounded up to whole super-blocks) */
    case TYPE_Q6_K: return 12;  /* gguf_products_q6_k.json */
    default: return 6;
    }
}

int gguf_product_path(int type, int64_t m, int64_t n, int64_t k) {
    if (gguf_gemm_supported() && gguf_gemm_decodes(type) && m >= gemm_min_rows(type & ~GGUF_PANELS))
        return PATH_GEMM;
    if (m >= tiled_min_rows(type) && tiled_fits(n, k)) return PATH_TILED;
    return gguf_int8_supported() ? PATH_INT8 : PATH_FLOAT;
}

/*
 * The products of llama_cpu_layers.c's decoder layer (its gemv_fn), one entry point per type
 * and layout, for any number of rows: x (m, k) bf16, W the blocks (passed where the layer passes a
 * bf16 weight: the layer only hands it on), bias (n) bf16 or NULL, y (m, n) bf16, on the
 * product gguf_product_path names. gguf_product_bf16 is the same for the op-by-op layers
 * (gguf_linear.py).
 */
int gguf_product_bf16(const uint16_t *x, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k) {
    if (row_bytes(type & ~GGUF_PANELS, k) == 0) return 1;
    switch (gguf_product_path(type, m, n, k)) {
    case PATH_GEMM: return gguf_gemm_int8_bf16(x, w, type, bias, y, m, n, k);
    case PATH_TILED: return gguf_tiled_product_bf16(x, w, type, bias, y, m, n, k);
    case PATH_INT8: return gguf_matmul_int8(x, 1, w, type, bias, y, m, n, k);
    default: return gguf_matmul_float(x, 1, w, type, bias, y, m, n, k);
    }
}

#define LAYER_PRODUCT(NAME, TYPE)                                                                      \
    int gguf_layer_product_##NAME(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y, \
                                  int64_t m, int64_t n, int64_t k) {                                   \
        return gguf_product_bf16(x, w, TYPE, bias, y, m, n, k);                                        \
    }
LAYER_PRODUCT(q8_0, TYPE_Q8_0)
LAYER_PRODUCT(q4_0, TYPE_Q4_0)
LAYER_PRODUCT(q4_1, TYPE_Q4_1)
LAYER_PRODUCT(q8_0_panels, TYPE_Q8_0 | GGUF_PANELS)
LAYER_PRODUCT(q4_0_panels, TYPE_Q4_0 | GGUF_PANELS)
LAYER_PRODUCT(q4_1_panels, TYPE_Q4_1 | GGUF_PANELS)
LAYER_PRODUCT(q4_k, TYPE_Q4_K)
LAYER_PRODUCT(q6_k, TYPE_Q6_K)
#undef LAYER_PRODUCT
