/*
 * y = x @ W^T for W stored in GGUF blocks, dequantized inside the product (never to memory).
 *
 * Batch-1 decode reads every weight once per step, so its speed is the weight bytes memory
 * delivers per second: a Q4_1 row is 5 bits a weight where bf16 is 16. Each thread streams a
 * contiguous range of W's rows (OpenMP over output rows) and multiplies up to TILE rows of x
 * into each one while its blocks are in L1.
 *
 * Block layouts (d, m and dmin fp16, little-endian), as the `gguf` package reads them:
 *
 *   Q8_0  [d][q0 .. q31]            int8 q         w_i = q_i * d
 *   Q4_0  [d][16 bytes]             nibbles 0..15  w_i = (q_i - 8) * d
 *   Q4_1  [d][m][16 bytes]          nibbles 0..15  w_i = q_i * d + m
 *
 *   nibble bytes: byte j holds q_j in its low half and q_{j+16} in its high half
 *
 *   Q4_K  [d][dmin][12 bytes: sc, m][128 bytes]    a super-block of 256 weights, 8 sub-blocks s
 *         of 32, each with a 6-bit scale sc_s and minimum m_s:  w_i = (d * sc_s) * q_i - dmin * m_s
 *
 *   scale bytes 0-3  [hi2(sc_4..7) | sc_0..3]      code bytes 32 p .. 32 p + 31 (p = 0..3): byte j
 *         bytes 4-7  [hi2(m_4..7)  | m_0..3]       holds q_j of sub-block 2 p in its low half and
 *         bytes 8-11 [lo4(m_4..7)  | lo4(sc_4..7)] q_j of sub-block 2 p + 1 in its high half
 *
 * Dequantizing sees every type as blocks of 32 weights (a Q4_K sub-block is one, its scale and
 * minimum unpacked from its super-block's); the weight-stationary products on Q4_K walk a row
 * a super-block at a time, unpacking its scales once for its 8 sub-blocks.
 *
 * Two weight-stationary products, both with float32 sums (a bias, in x's dtype, added to them):
 *   gguf_matmul_float  x in float32 (bf16 x widened): each block dequantized to float32 exactly
 *                      as the gguf package does, then multiplied; AVX-512, else portable C.
 *   gguf_matmul_int8   x quantized per 32-block to int8 like llama.cpp's Q8 activation blocks
 *                      (dx = max|x| / 127, qx = round-to-nearest-even(x / dx)), integer dot
 *                      products of weight and activation codes (vpdpbusd, exact in int32), then
 *                      dw * dx * dot summed in float32. Each x differs from dx * qx by at most
 *                      dx / 2, that is max|x of its block| / 254. Only where the ISA has int8
 *                      dot products (AVX512-VNNI or AVX-VNNI); gguf_int8_supported() says.
 * and, for bf16 x of any number of rows, two products made for many rows (below): the int8
 * GEMM (the int8 product's arithmetic on 16-row panels of W unpacked once per call, AVX512-VNNI)
 * and a tiled product (W dequantized to bf16 panel by panel for the tile GEMM of
 * cpu_tile_gemm.c). gguf_product_bf16 chooses among them by the shape (gguf_product_path); the
 * C decoder layers (llama_cpu_layers.c) call it through one entry point per type and layout.
 *
 * Layouts (contiguous): x (m, k) float32 or bf16; W n rows of whole blocks; y (m, n) in x's
 * dtype. k must be a multiple of the type's block (32 weights, 256 for Q4_K), as GGUF rows are.
 *
 * Panels: where the int8 GEMM runs, a model's weights of the types it decodes are regrouped
 * once, after loading, into 16-row panels (gguf_to_panels), and passed as `type | GGUF_PANELS`.
 * The same bytes, so that the GEMM reads a block of 16 rows as whole vectors in one stream
 * instead of gathering 16 rows' blocks:
 *
 *   panel p (rows 16 p .. 16 p + 15), block kb at byte (p * nb + kb) * 16 * block bytes:
 *     [codes: C x 64 bytes][d: 16 fp16][m: 16 fp16, Q4_1 only]     C = 8 for Q8_0, 4 for Q4
 *     64-byte group g, dword c: the block's code bytes 4 g .. 4 g + 3 of row 16 p + c
 *
 * Only the GEMM and gguf_dequantize read panels; the other products return 1 for them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12 };  /* GGMLQuantizationType values */

#define GGUF_PANELS 0x100  /* a layout flag on a type: its rows regrouped into 16-row panels */

#define QK 32    /* weights per block (per sub-block of Q4_K) */
#define QK_K 256 /* weights per Q4_K super-block */
#define TILE 4   /* rows of x multiplied into a weight row per pass over it */

static int64_t block_bytes(int type) {
    switch (type) {
    case TYPE_Q4_0: return 18;
    case TYPE_Q4_1: return 20;
    case TYPE_Q8_0: return 34;
    case TYPE_Q4_K: return 144;
    default: return 0;
    }
}

/* Bytes of a row of k weights of `type`; 0 for an unknown type or k not whole blocks. */
static int64_t row_bytes(int type, int64_t k) {
    const int64_t weights = type == TYPE_Q4_K ? QK_K : QK;
    return k % weights ? 0 : k / weights * block_bytes(type);
}

/* The types the int8 GEMM decodes, and so the types panels hold (Q4_K's 32-weight blocks lie
 * in its super-blocks: not yet). */
static inline int panel_type(int type) { return type == TYPE_Q8_0 || type == TYPE_Q4_0 || type == TYPE_Q4_1; }

/* Panels: code vectors of 64 bytes per block of 16 rows, where a panel's block holds its 16
 * d and its 16 m, and where in a row's block the codes start. */
static inline int panel_code_vectors(int type) { return type == TYPE_Q8_0 ? 8 : 4; }
static inline int panel_d_at(int type) { return 64 * panel_code_vectors(type); }
static inline int panel_m_at(int type) { return panel_d_at(type) + 32; }
static inline int codes_at(int type) { return type == TYPE_Q4_1 ? 4 : 2; }

/* A field of a block: where it is in the row's block and in its lane of the panel's block. */
struct panel_field {
    int row, panel, bytes;
};

/* Copies a block of row 16 p + c from its row layout (`from`) into lane c of panel p's same
 * block (`to`) where to_panel, or back (`from` the panel's block, `to` the row's). */
static void move_panel_block(const uint8_t *from, uint8_t *to, int type, int c, int to_panel) {
    const int vectors = panel_code_vectors(type);
    struct panel_field fields[10];
    int count = 0;
    fields[count++] = (struct panel_field){0, panel_d_at(type) + 2 * c, 2};                        /* d */
    if (type == TYPE_Q4_1) fields[count++] = (struct panel_field){2, panel_m_at(type) + 2 * c, 2};  /* m */
    for (int g = 0; g < vectors; ++g) fields[count++] = (struct panel_field){codes_at(type) + 4 * g, 64 * g + 4 * c, 4};
    for (int f = 0; f < count; ++f) {
        const struct panel_field fd = fields[f];
        memcpy(to + (to_panel ? fd.panel : fd.row), from + (to_panel ? fd.row : fd.panel), (size_t)fd.bytes);
    }
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {  /* zero or subnormal: mant * 2^-24, exact in float32 */
        const float f = ldexpf((float)mant, -24);
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* One block -> 32 float32, with the gguf package's roundings (one multiply, then one add). */
static inline void dequantize_block(const uint8_t *b, int type, float *out) {
    const float d = half_to_float(b);
    if (type == TYPE_Q8_0) {
        for (int i = 0; i < QK; ++i) out[i] = (float)(int8_t)b[2 + i] * d;
    } else if (type == TYPE_Q4_0) {
        for (int i = 0; i < QK / 2; ++i) {
            out[i] = (float)((b[2 + i] & 15) - 8) * d;
            out[i + QK / 2] = (float)((b[2 + i] >> 4) - 8) * d;
        }
    } else {
        const float m = half_to_float(b + 2);
        for (int i = 0; i < QK / 2; ++i) {
            out[i] = (float)(b[4 + i] & 15) * d + m;
            out[i + QK / 2] = (float)(b[4 + i] >> 4) * d + m;
        }
    }
}

/* A Q4_K super-block's scale bytes unpacked: byte s of `sc` and `m` is its sub-block s's 6-bit
 * scale sc_s and minimum m_s (see the layout above: 4 sub-blocks a 32-bit word). */
struct q4_k_scales {
    uint64_t sc, m;
    float d, dmin;
};

static inline struct q4_k_scales q4_k_scales(const uint8_t *sb) {
    uint32_t u[3];
    memcpy(u, sb + 4, sizeof u);
    struct q4_k_scales s;
    s.sc = (uint64_t)(u[0] & 0x3f3f3f3fu) | (uint64_t)((u[2] & 0x0f0f0f0fu) | (u[0] >> 2 & 0x30303030u)) << 32;
    s.m = (uint64_t)(u[1] & 0x3f3f3f3fu) | (uint64_t)((u[2] >> 4 & 0x0f0f0f0fu) | (u[1] >> 2 & 0x30303030u)) << 32;
    s.d = half_to_float(sb);
    s.dmin = half_to_float(sb + 2);
    return s;
}

/* Sub-block s's scale d * sc_s and minimum dmin * m_s: exact in float32 (11-bit by 6-bit
 * products), as the gguf package forms them. */
static inline float q4_k_scale(const struct q4_k_scales *u, int s) { return u->d * (float)(u->sc >> 8 * s & 63); }
static inline float q4_k_min(const struct q4_k_scales *u, int s) { return u->dmin * (float)(u->m >> 8 * s & 63); }

/* Sub-block s of the Q4_K super-block sb: its codes (in the low halves of q's 32 bytes where
 * *shift is 0, the high halves where 4), its scale and its minimum. */
static inline const uint8_t *q4_k_sub_block(const uint8_t *sb, int s, int *shift, float *scale, float *min) {
    const struct q4_k_scales u = q4_k_scales(sb);
    *scale = q4_k_scale(&u, s);
    *min = q4_k_min(&u, s);
    *shift = 4 * (s % 2);
    return sb + 16 + 32 * (s / 2);
}

/* Block b (weights 32 b .. 32 b + 31) of a row of `type` -> 32 float32, as dequantize_block;
 * for Q4_K, sub-block b % 8 of super-block b / 8, with the gguf package's roundings. */
static inline void dequantize_row_block(const uint8_t *row, int64_t b, int type, float *out) {
    if (type != TYPE_Q4_K) {
        dequantize_block(row + b * block_bytes(type), type, out);
        return;
    }
    int shift;
    float scale, min;
    const uint8_t *q = q4_k_sub_block(row + b / 8 * block_bytes(type), (int)(b % 8), &shift, &scale, &min);
    for (int i = 0; i < QK; ++i) out[i] = (float)((q[i] >> shift) & 15) * scale - min;
}

static inline void store(void *y, int bf16, int64_t index, float value) {
    if (bf16) ((uint16_t *)y)[index] = float_to_bf16(value);
    else ((float *)y)[index] = value;
}

/* bias[j] in float32 (bias in x's dtype, or NULL: none). */
static inline float bias_at(const void *bias, int bf16, int64_t j) {
    if (bias == NULL) return 0.0f;
    return bf16 ? bf16_to_float(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
}

/* x as float32: itself, or a widened copy of bf16 x that the caller frees. */
static const float *float_rows(const void *x, int bf16, int64_t count, float **owned) {
    *owned = NULL;
    if (!bf16) return (const float *)x;
    float *copy = malloc((size_t)count * sizeof *copy);
    if (copy == NULL) return NULL;
    for (int64_t i = 0; i < count; ++i) copy[i] = bf16_to_float(((const uint16_t *)x)[i]);
    return *owned = copy;
}

/* Rows `rows` (the first num_rows if NULL) of W's n rows, dequantized into out (num_rows, k),
 * float32 or bf16. Returns 3, writing nothing, if a row is not in [0, n). */
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
            if (panels) {  /* the row's block b put back together from its panel's lane */
                uint8_t bytes[34];
                move_panel_block(w + (j / 16 * nb + b) * 16 * block_bytes(type), bytes, type, (int)(j % 16), 0);
                dequantize_block(bytes, type, block);
            } else {
                dequantize_row_block(row, b, type, block);
            }
            for (int i = 0; i < QK; ++i) store(out, out_bf16, r * k + b * QK + i, block[i]);
        }
    }
    return 0;
}

#ifdef __AVX512F__
/* A block as 2 x 16 float32, with dequantize_block's roundings (a multiply, then an add). */
static inline void dequantize_block16(const uint8_t *b, int type, __m512 *lo, __m512 *hi) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    if (type == TYPE_Q8_0) {
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
        return;
    }
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == TYPE_Q4_1 ? 4 : 2))));
    __m512i qlo = _mm512_and_si512(q, _mm512_set1_epi32(15)), qhi = _mm512_srli_epi32(q, 4);
    if (type == TYPE_Q4_0) {
        qlo = _mm512_sub_epi32(qlo, _mm512_set1_epi32(8));
        qhi = _mm512_sub_epi32(qhi, _mm512_set1_epi32(8));
    }
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(qlo), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qhi), d);
    if (type == TYPE_Q4_1) {
        const __m512 m = _mm512_set1_ps(half_to_float(b + 2));
        *lo = _mm512_add_ps(*lo, m);
        *hi = _mm512_add_ps(*hi, m);
    }
}

/* Sub-block s of the Q4_K super-block sb (its scales unpacked in u) as 2 x 16 float32, with
 * dequantize_row_block's roundings (a multiply, then a subtraction). */
static inline __attribute__((always_inline)) void q4_k_sub_block16(const uint8_t *sb, const struct q4_k_scales *u,
                                                                   int s, __m512 *lo, __m512 *hi) {
    const uint8_t *q = sb + 16 + 32 * (s / 2);
    const __m512i count = _mm512_set1_epi32(4 * (s % 2)), low = _mm512_set1_epi32(15);
    const __m512i qlo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)), count), low);
    const __m512i qhi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))), count), low);
    const __m512 d = _mm512_set1_ps(q4_k_scale(u, s)), m = _mm512_set1_ps(q4_k_min(u, s));
    *lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qlo), d), m);
    *hi = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qhi), d), m);
}

/* Block b of a row of `type` as 2 x 16 float32, as dequantize_row_block. */
static inline __attribute__((always_inline)) void dequantize_row_block16(const uint8_t *row, int64_t b, int type,
                                                                         __m512 *lo, __m512 *hi) {
    if (type != TYPE_Q4_K) {
        dequantize_block16(row + b * block_bytes(type), type, lo, hi);
        return;
    }
    const uint8_t *sb = row + b / 8 * block_bytes(type);
    const struct q4_k_scales u = q4_k_scales(sb);
    q4_k_sub_block16(sb, &u, (int)(b % 8), lo, hi);
}

static inline __attribute__((always_inline)) void row_float(
        const uint8_t *row, int type, const float *xf, float b0, void *y, int bf16, int64_t j,
        int64_t t0, int tm, int64_t n, int64_t k) {
    const int64_t bb = block_bytes(type), nb = k / QK;
    __m512 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 lo, hi;
        dequantize_block16(row + b * bb, type, &lo, &hi);
        for (int t = 0; t < tm; ++t) {
            const float *xt = xf + (t0 + t) * k + b * QK;
            acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), acc[t]);
            acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), acc[t]);
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, _mm512_reduce_add_ps(acc[t]) + b0);
}

/* row_float for Q4_K, a super-block at a time (its scales unpacked once for its 8 sub-blocks),
 * with tm a constant in each caller (the sums then stay in registers). */
static inline __attribute__((always_inline)) void rows_float_q4_k(
        const uint8_t *row, const float *xf, float b0, void *y, int bf16, int64_t j, int64_t t0, const int tm,
        int64_t n, int64_t k) {
    __m512 acc[TILE];
    for (int t = 0; t < tm; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += QK_K) {
        const uint8_t *sb = row + i / QK_K * block_bytes(TYPE_Q4_K);
        const struct q4_k_scales u = q4_k_scales(sb);
        for (int s = 0; s < 8; ++s) {
            __m512 lo, hi;
            q4_k_sub_block16(sb, &u, s, &lo, &hi);
            for (int t = 0; t < tm; ++t) {
                const float *xt = xf + (t0 + t) * k + i + s * QK;
                acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), acc[t]);
                acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), acc[t]);
            }
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, _mm512_reduce_add_ps(acc[t]) + b0);
}

static void row_float_q4_k(const uint8_t *row, const float *xf, float b0, void *y, int bf16, int64_t j,
                           int64_t t0, int tm, int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}
#endif

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
#ifdef __AVX512F__
            switch (type) {
            case TYPE_Q8_0: row_float(row, TYPE_Q8_0, xf, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_0: row_float(row, TYPE_Q4_0, xf, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_K: row_float_q4_k(row, xf, b0, y, bf16, j, t0, tm, n, k); break;
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

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#include <immintrin.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD _mm256_dpbusd_epi32      /* sum of 4 u8 * s8 products into each int32 lane */
#else
#define DPBUSD _mm256_dpbusd_avx_epi32
#endif

int gguf_int8_supported(void) { return 1; }

/* Codes of one block of x: qx = round(x / dx), dx = max|x| / 127; *sum = sum of the codes. */
static void quantize_block(const float *x, int8_t *qx, float *dx, int32_t *sum) {
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < QK; ++i) {
        qx[i] = (int8_t)nearbyintf(x[i] * id);
        s += qx[i];
    }
    *dx = d;
    *sum = s;
}

/* The 32 codes of a weight block as bytes: unsigned nibbles (Q4_1) or signed (Q4_0, Q8_0). */
static inline __m256i weight_codes(const uint8_t *b, int type) {
    if (type == TYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + (type == TYPE_Q4_1 ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
    return type == TYPE_Q4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
}

static inline float reduce(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row times up to TILE rows of quantized x; `type` is a constant in each caller. */
static inline __attribute__((always_inline)) void row_int8(
        const uint8_t *row, int type, const int8_t *qx, const float *dx, const int32_t *sx,
        float b0, void *y, int bf16, int64_t j, int64_t t0, int tm, int64_t n, int64_t k) {
    const int64_t bb = block_bytes(type), nb = k / QK;
    __m256 acc[TILE];
    float shift[TILE] = {0};  /* Q4_1: sum over blocks of m * dx * sum(qx) */
    for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + b * bb;
        const float dw = half_to_float(blk), mw = type == TYPE_Q4_1 ? half_to_float(blk + 2) : 0.0f;
        const __m256i q = weight_codes(blk, type);
        /* vpdpbusd multiplies unsigned by signed bytes: signed weight codes give their sign to x. */
        const __m256i wu = type == TYPE_Q4_1 ? q : _mm256_sign_epi8(q, q);
        for (int t = 0; t < tm; ++t) {
            const int64_t xb = (t0 + t) * nb + b;
            __m256i xs = _mm256_loadu_si256((const __m256i *)(qx + xb * QK));
            if (type != TYPE_Q4_1) xs = _mm256_sign_epi8(xs, q);
            const __m256i dot = DPBUSD(_mm256_setzero_si256(), wu, xs);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[xb]), acc[t]);
            if (type == TYPE_Q4_1) shift[t] += mw * dx[xb] * (float)sx[xb];
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, reduce(acc[t]) + shift[t] + b0);
}

/* row_int8 for Q4_K, a super-block at a time (its scales unpacked once for its 8 sub-blocks,
 * each a Q4_1 block of scale d * sc_s and offset -dmin * m_s), with tm a constant in each caller
 * (the sums then stay in registers). */
static inline __attribute__((always_inline)) void rows_int8_q4_k(
        const uint8_t *row, const int8_t *qx, const float *dx, const int32_t *sx, float b0, void *y, int bf16,
        int64_t j, int64_t t0, const int tm, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m256 acc[TILE];
    float shift[TILE];  /* sum over sub-blocks of -dmin * m_s * dx * sum(qx) */
    for (int t = 0; t < tm; ++t) {
        acc[t] = _mm256_setzero_ps();
        shift[t] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b += 8) {
        const uint8_t *sb = row + b / 8 * block_bytes(TYPE_Q4_K);
        const struct q4_k_scales u = q4_k_scales(sb);
        for (int s = 0; s < 8; ++s) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * (s / 2)));
            const __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(15));
            const float dw = q4_k_scale(&u, s), mw = q4_k_min(&u, s);
            for (int t = 0; t < tm; ++t) {
                const int64_t xb = (t0 + t) * nb + b + s;
                const __m256i dot = DPBUSD(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i *)(qx + xb * QK)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[xb]), acc[t]);
                shift[t] -= mw * dx[xb] * (float)sx[xb];
            }
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, reduce(acc[t]) + shift[t] + b0);
}

static void row_int8_q4_k(const uint8_t *row, const int8_t *qx, const float *dx, const int32_t *sx, float b0,
                          void *y, int bf16, int64_t j, int64_t t0, int tm, int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_int8_q4_k(row, qx, dx, sx, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_int8_q4_k(row, qx, dx, sx, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_int8_q4_k(row, qx, dx, sx, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_int8_q4_k(row, qx, dx, sx, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}

int gguf_matmul_int8(const void *x, int bf16, const uint8_t *w, int type, const void *bias, void *y,
                     int64_t m, int64_t n, int64_t k) {
    const int64_t rb = row_bytes(type, k), nb = k / QK;
    if (rb == 0) return 1;
    float *owned;
    const float *xf = float_rows(x, bf16, m * k, &owned);
    int8_t *qx = malloc((size_t)(m * k));
    float *dx = malloc((size_t)(m * nb) * sizeof *dx);
    int32_t *sx = malloc((size_t)(m * nb) * sizeof *sx);
    if (xf == NULL || qx == NULL || dx == NULL || sx == NULL) {
        free(owned); free(qx); free(dx); free(sx);
        return 2;
    }
    /* A few rows of x (the caller's GEMV rows): quantized by one thread, no second fork. */
    for (int64_t i = 0; i < m * nb; ++i) quantize_block(xf + i * QK, qx + i * QK, dx + i, sx + i);
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t *row = w + j * rb;
        const float b0 = bias_at(bias, bf16, j);
        for (int64_t t0 = 0; t0 < m; t0 += TILE) {
            const int tm = m - t0 < TILE ? (int)(m - t0) : TILE;
            switch (type) {
            case TYPE_Q8_0: row_int8(row, TYPE_Q8_0, qx, dx, sx, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_0: row_int8(row, TYPE_Q4_0, qx, dx, sx, b0, y, bf16, j, t0, tm, n, k); break;
            case TYPE_Q4_K: row_int8_q4_k(row, qx, dx, sx, b0, y, bf16, j, t0, tm, n, k); break;
            default: row_int8(row, TYPE_Q4_1, qx, dx, sx, b0, y, bf16, j, t0, tm, n, k); break;
            }
        }
    }
    free(owned); free(qx); free(dx); free(sx);
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

/*
 * Past a few rows the weight-stationary products above run out of arithmetic: each weight block
 * is unpacked and rescaled once per row of x. The bf16 tile GEMM (cpu_tile_gemm.c) does far
 * more multiply-adds per instruction, so for more rows W is dequantized, a panel of rows at a
 * time, into a bf16 scratch in the tile GEMM's layout:
 *
 *   tiles[b][kb] = 16 x 16 pairs: row r, column c = W[16 b + c][32 kb + 2 r], W[16 b + c][32 kb + 2 r + 1]
 *
 * (block kb of output row 16 b + c is column c of tile (b, kb)), and the tile GEMM multiplies x
 * into the panel. A panel is at most PANEL_BYTES of bf16 so that it stays in the cache between
 * its dequantization and its product. Which product serves which rows: gguf_product_path.
 */
#define PANEL_BYTES (512 * 1024)

typedef int (*tile_gemm_fn)(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k);
static tile_gemm_fn tile_gemm;  /* cpu_tile_gemm.c's tile_gemm_bf16, given once by gguf_use_tile_gemm */

/* Hands over the tile GEMM (NULL: none, every row count takes the products above). */
int gguf_use_tile_gemm(void *gemm) {
    tile_gemm = (tile_gemm_fn)gemm;
    return 0;
}

static int tiled_fits(int64_t n, int64_t k) { return tile_gemm != NULL && n % 16 == 0 && k % QK == 0; }

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
int gguf_gemm_decodes(int type) { return panel_type(type & ~GGUF_PANELS); }

/* W's n rows of `type` (n a multiple of 16) -> `out`, the same bytes regrouped into panels
 * (see the top of this file); 1 where the type has no panels or n is not whole panels. */
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

/*
 * The int8 GEMM, for bf16 x: the int8 product's arithmetic with the weights unpacked once per
 * call instead of once per row of x. Every type is, per block of 32,
 *
 *   w_i = D * (u_i - offset) + M      u_i its unsigned byte codes
 *   Q8_0: u = q + 128, offset 128, M = 0     Q4_0: u = q, offset 8, M = 0     Q4_1: D = d, M = m
 *
 * and with x's block quantized as for gguf_matmul_int8 (dx, codes qx, sx = sum of qx):
 *
 *   sum_i w_i x_i ~= D * dx * (dot(u, qx) - offset * sx) + M * dx * sx
 *
 * the integer part exact in int32 (vpdpbusd: u8 times s8, from -offset * sx). A panel of 16
 * output rows is unpacked per thread into vpdpbusd's layout, one zmm lane per output row:
 *
 *   codes[kb][g]  lane c: u_4g .. u_4g+3 of block kb of row j0 + c        (g = 0 .. 7)
 *   D[kb], M[kb]  lane c: D and M of block kb of row j0 + c
 *
 * so that x's dword g (its codes 4g .. 4g + 3) broadcast against codes[kb][g] gives 16 rows'
 * partial dot products at once (a Q4 block's nibble bytes need no reordering: dword g of its
 * 16 bytes holds codes 4g .. 4g + 3 in its low halves and 16 + 4g ... in its high ones, the
 * codes of x's dwords g and 4 + g). Every tile of up to 16 rows of x then multiplies into the
 * panel: per block and row of x, 8 vpdpbusd, a conversion to float, a multiply and one or two
 * multiply-adds for 16 outputs. Threads take panels; x is quantized once per call. Which
 * product serves which rows: gguf_product_path.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEMM_TILE 16  /* rows of x per pass over a panel: their 16 accumulators stay in registers */
#define PREFETCH_PANELS 4  /* how far ahead a panel's unpacking prefetches W, into L2 */

int gguf_gemm_supported(void) { return 1; }

/* The panel's 16 rows (lanes past its last row repeat that row): row c starts at base + offset[c]. */
typedef struct {
    const uint8_t *base;
    int64_t offset[16];
} panel_rows_at;

/* a, b, c, d -> the 128-bit lanes 0 .. 3 of a zmm (written out: the lane is an immediate, which
 * an unoptimized build does not get from a loop). */
static inline __m512i lanes_of(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(a), b, 1), c, 2), d, 3);
}

/* 16 bytes at `at` of each row's block -> v[g] (g = 0 .. 3), lane c: dword g of row c. Rows c,
 * c + 4, c + 8, c + 12 go to the 128-bit lanes of r[c], then a 4 x 4 transpose in each lane. */
static inline void load_dwords(const panel_rows_at *p, int64_t at, __m512i v[4]) {
    __m512i r[4], t[4];
#define ROW16(c) _mm_loadu_si128((const __m128i *)(p->base + p->offset[c] + at))
    for (int c = 0; c < 4; ++c) r[c] = lanes_of(ROW16(c), ROW16(c + 4), ROW16(c + 8), ROW16(c + 12));
#undef ROW16
    t[0] = _mm512_unpacklo_epi32(r[0], r[1]);
    t[1] = _mm512_unpackhi_epi32(r[0], r[1]);
    t[2] = _mm512_unpacklo_epi32(r[2], r[3]);
    t[3] = _mm512_unpackhi_epi32(r[2], r[3]);
    v[0] = _mm512_unpacklo_epi64(t[0], t[2]);
    v[1] = _mm512_unpackhi_epi64(t[0], t[2]);
    v[2] = _mm512_unpacklo_epi64(t[1], t[3]);
    v[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

/* The dword at `at` of each row's block, lane c for row c (as load_dwords, one dword a row). */
static inline __m512i load_words(const panel_rows_at *p, int64_t at) {
    __m512i r[4];
#define ROW4(c) _mm_loadu_si32(p->base + p->offset[c] + at)
    for (int c = 0; c < 4; ++c) r[c] = lanes_of(ROW4(c), ROW4(c + 4), ROW4(c + 8), ROW4(c + 12));
#undef ROW4
    return _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(r[0], r[1]), _mm512_unpacklo_epi32(r[2], r[3]));
}

/* float16 in the low (high = 0) or high half of each lane -> float32. */
static inline __m512 halves_to_float(__m512i words, int high) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(words, 16) : words));
}

/* Nibble bytes: the low halves of dword g are codes 4g .. 4g + 3, the high halves 16 + 4g ... */
static inline void split_nibbles(__m512i codes[8]) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int g = 0; g < 4; ++g) {
        codes[4 + g] = _mm512_and_si512(_mm512_srli_epi16(codes[g], 4), low);
        codes[g] = _mm512_and_si512(codes[g], low);
    }
}

/* The per-type part of the GEMM: code_offset, has_minimum and decode_blocks (a new type adds
 * its case to each). */
static inline int code_offset(int type) { return type == TYPE_Q8_0 ? 128 : type == TYPE_Q4_0 ? 8 : 0; }
static inline int has_minimum(int type) { return type == TYPE_Q4_1; }

/* Block kb (weights 32 kb .. 32 kb + 31) of the rows of p -> codes[g] (lane c: u_4g .. u_4g+3
 * of row c), *D, *M. */
static inline void decode_blocks(const panel_rows_at *p, int type, int64_t kb, __m512i codes[8], __m512 *D,
                                 __m512 *M) {
    const int64_t at = kb * block_bytes(type);
    const __m512i first = load_words(p, at);  /* d, and m or codes */
    *D = halves_to_float(first, 0);
    *M = _mm512_setzero_ps();
    switch (type) {
    case TYPE_Q8_0:
        load_dwords(p, at + 2, codes);
        load_dwords(p, at + 18, codes + 4);
        for (int g = 0; g < 8; ++g) codes[g] = _mm512_xor_si512(codes[g], _mm512_set1_epi8(-128));
        break;
    case TYPE_Q4_0:
        load_dwords(p, at + 2, codes);
        split_nibbles(codes);
        break;
    default:
        *M = halves_to_float(first, 1);
        load_dwords(p, at + 4, codes);
        split_nibbles(codes);
        break;
    }
}

/* Block kb of a panel (`panel`, the panel's first block) -> codes, *D, *M, as decode_blocks.
 * Each branch loads a constant number of vectors, which stay in registers (a loop bounded by
 * the type compiles to a call of memcpy into memory). */
static inline __attribute__((always_inline)) void decode_panel_block(const uint8_t *panel, int type, int64_t kb,
                                                                     __m512i codes[8], __m512 *D, __m512 *M) {
    const uint8_t *at = panel + kb * 16 * block_bytes(type);
    *M = _mm512_setzero_ps();
    if (type == TYPE_Q8_0) {
        for (int g = 0; g < 8; ++g) codes[g] = _mm512_xor_si512(_mm512_loadu_si512(at + 64 * g), _mm512_set1_epi8(-128));
        *D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + panel_d_at(TYPE_Q8_0))));
        return;
    }
    for (int g = 0; g < 4; ++g) codes[g] = _mm512_loadu_si512(at + 64 * g);
    split_nibbles(codes);
    *D = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + panel_d_at(type))));
    if (has_minimum(type)) *M = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + panel_m_at(type))));
}

/* Block kb of the panel at p, from rows or from panels. */
static inline __attribute__((always_inline)) void decode_any(const panel_rows_at *p, int panels, int type, int64_t kb,
                                                             __m512i codes[8], __m512 *D, __m512 *M) {
    if (panels) decode_panel_block(p->base, type, kb, codes, D, M);
    else decode_blocks(p, type, kb, codes, D, M);
}

/* x's blocks as the GEMM reads them (each array (m, k / 32) but qx (m, k)). */
typedef struct {
    int8_t *qx;
    float *dx, *dxsx;  /* dx * sx, for the minimums */
    int32_t *start;    /* -offset * sx: where each block's integer dot product starts */
} quantized_x;

/* bf16 x (m, k) -> its blocks' codes, with gguf_matmul_int8's arithmetic (quantize_block). */
static void quantize_x(const uint16_t *x, int type, int64_t m, int64_t k, quantized_x q) {
    const int64_t blocks = m * (k / QK);
    const int offset = code_offset(type);
    #pragma omp parallel for schedule(static) if (blocks >= 256)
    for (int64_t i = 0; i < blocks; ++i) {
        const __m512 lo = bf16x16_to_float(x + i * QK), hi = bf16x16_to_float(x + i * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        /* conversions round to nearest even, as nearbyintf does */
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q.qx + i * QK), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q.qx + i * QK + 16), _mm512_cvtepi32_epi8(qhi));
        const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        q.dx[i] = d;
        q.dxsx[i] = d * (float)s;
        q.start[i] = -offset * s;
    }
}

/* 16 float32 -> bf16 with float_to_bf16's rounding (nearest even, NaN kept quiet). */
static inline __m256i bf16_of(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i half = _mm512_srli_epi32(bits, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                  _mm512_and_si512(half, _mm512_set1_epi32(1)))), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), half, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* acc + x block xb's share of the panel's block (codes u, D, M) in its 16 output rows. */
static inline __attribute__((always_inline)) __m512 block_product(
        const __m512i u[8], __m512 D, __m512 M, quantized_x q, int64_t xb, const int with_minimum, __m512 acc) {
    const int32_t *xs = (const int32_t *)(q.qx + xb * QK);
    __m512i dot = _mm512_set1_epi32(q.start[xb]);
    for (int g = 0; g < 8; ++g) dot = _mm512_dpbusd_epi32(dot, u[g], _mm512_set1_epi32(xs[g]));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(q.dx[xb])), D, acc);
    return with_minimum ? _mm512_fmadd_ps(M, _mm512_set1_ps(q.dxsx[xb]), acc) : acc;
}

/* Row t0 + t of y, output rows [j0, j0 + rows): acc[t] plus the bias, to bf16. */
static inline void store_rows(const __m512 *acc, int64_t t0, int tm, const uint16_t *bias, uint16_t *y,
                              int64_t j0, int rows, int64_t n) {
    const __mmask16 lanes = (__mmask16)((1u << rows) - 1);
    const __m512 b = bias == NULL ? _mm512_setzero_ps() : _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + j0)), 16));
    for (int t = 0; t < tm; ++t)
        _mm256_mask_storeu_epi16(y + (t0 + t) * n + j0, lanes, bf16_of(_mm512_add_ps(acc[t], b)));
}

/* Rows [j0, j0 + rows) of W (rows <= 16; lanes past them repeat the last row) -> the panel,
 * prefetching the `ahead` bytes of W from `next` (a later panel, contiguous): in rows, the
 * panel's 16 rows are read a block of each at a time, 16 short streams the hardware
 * prefetchers do not follow from memory; in panels (`panels`: W regrouped, rows == 16), one.
 * With `one_row` (x of one row), each block is multiplied into *acc as it is decoded instead,
 * the panel never stored. */
static void unpack_panel(const uint8_t *w, int type, int panels, int64_t j0, int rows, int64_t nb, __m512i *codes,
                         __m512 *D, __m512 *M, const uint8_t *next, int64_t ahead, const quantized_x *one_row,
                         __m512 *acc) {
    const int64_t stride = nb * block_bytes(type), lines = (ahead + 63) / 64;
    panel_rows_at p = {.base = w + j0 * stride};
    for (int c = 0; c < 16; ++c) p.offset[c] = (c < rows ? c : rows - 1) * stride;
    for (int64_t kb = 0, line = 0; kb < nb; ++kb) {
        for (; line < lines * (kb + 1) / nb; ++line) _mm_prefetch((const char *)(next + 64 * line), _MM_HINT_T1);
        if (one_row == NULL) {
            decode_any(&p, panels, type, kb, codes + kb * 8, D + kb, M + kb);
            continue;
        }
        __m512i u[8];
        __m512 d, mw;
        decode_any(&p, panels, type, kb, u, &d, &mw);
        *acc = has_minimum(type) ? block_product(u, d, mw, *one_row, kb, 1, *acc)
                                 : block_product(u, d, mw, *one_row, kb, 0, *acc);
    }
}

/* Rows [t0, t0 + TM) of x times the panel (output rows [j0, j0 + rows)) into y; TM and
 * with_minimum are constants in each caller, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_tile(
        const __m512i *codes, const __m512 *D, const __m512 *M, quantized_x q, int64_t t0, const int TM,
        const int with_minimum, const uint16_t *bias, uint16_t *y, int64_t j0, int rows, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m512 acc[GEMM_TILE];
    for (int t = 0; t < TM; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        __m512i u[8];
        for (int g = 0; g < 8; ++g) u[g] = _mm512_load_si512(codes + kb * 8 + g);
        for (int t = 0; t < TM; ++t) acc[t] = block_product(u, D[kb], M[kb], q, (t0 + t) * nb + kb, with_minimum, acc[t]);
    }
    store_rows(acc, t0, TM, bias, y, j0, rows, n);
}

/* All m rows of x times the panel: tiles of 16, the rest in tiles of 8, 4, 2, 1. */
static void panel_rows(const __m512i *codes, const __m512 *D, const __m512 *M, quantized_x q, int with_minimum,
                       const uint16_t *bias, uint16_t *y, int64_t j0, int rows, int64_t m, int64_t n, int64_t k) {
    int64_t t0 = 0;
#define PANEL_TILES(TM)                                                                                   \
    for (; m - t0 >= (TM); t0 += (TM)) {                                                                 \
        if (with_minimum) panel_tile(codes, D, M, q, t0, (TM), 1, bias, y, j0, rows, n, k);             \
        else panel_tile(codes, D, M, q, t0, (TM), 0, bias, y, j0, rows, n, k);                           \
    }
    PANEL_TILES(16) PANEL_TILES(8) PANEL_TILES(4) PANEL_TILES(2) PANEL_TILES(1)
#undef PANEL_TILES
}

/* y (m, n) bf16 = x @ W^T + bias on the int8 GEMM: x (m, k) bf16, bias (n) bf16 or NULL. */
int gguf_gemm_int8_bf16(const uint16_t *x, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k) {
    const int in_panels = (type & GGUF_PANELS) != 0;
    type &= ~GGUF_PANELS;
    if (!gguf_gemm_decodes(type) || k % QK || (in_panels && n % 16)) return 1;
    if (m == 0 || n == 0) return 0;
    const int64_t nb = k / QK, panels = (n + 15) / 16, stride = nb * block_bytes(type);
    quantized_x q = {malloc((size_t)(m * k)), malloc((size_t)(m * nb) * sizeof(float)),
                     malloc((size_t)(m * nb) * sizeof(float)), malloc((size_t)(m * nb) * sizeof(int32_t))};
    int status = 0;
    if (q.qx == NULL || q.dx == NULL || q.dxsx == NULL || q.start == NULL) {
        free(q.qx); free(q.dx); free(q.dxsx); free(q.start);
        return 2;
    }
    quantize_x(x, type, m, k, q);
    #pragma omp parallel
    {
        /* this thread's panel, for x of several rows: nb x (8 zmm of codes, 16 D, 16 M) */
        __m512i *codes = m > 1 ? aligned_alloc(64, (size_t)nb * (8 * sizeof(__m512i) + 2 * sizeof(__m512))) : NULL;
        __m512 *D = codes == NULL ? NULL : (__m512 *)(codes + nb * 8), *M = D == NULL ? NULL : D + nb;
        if (m > 1 && codes == NULL) {
            #pragma omp atomic write
            status = 2;
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            if (m > 1 && codes == NULL) continue;
            const int rows = n - 16 * p < 16 ? (int)(n - 16 * p) : 16;
            /* the panel PREFETCH_PANELS on, if W has it */
            const int64_t ahead_row = 16 * (p + PREFETCH_PANELS);
            const int64_t ahead = ahead_row >= n ? 0 : (n - ahead_row < 16 ? n - ahead_row : 16) * stride;
            const uint8_t *next = ahead ? w + ahead_row * stride : w;
            if (m == 1) {
                __m512 acc = _mm512_setzero_ps();
                unpack_panel(w, type, in_panels, 16 * p, rows, nb, NULL, NULL, NULL, next, ahead, &q, &acc);
                store_rows(&acc, 0, 1, bias, y, 16 * p, rows, n);
                continue;
            }
            unpack_panel(w, type, in_panels, 16 * p, rows, nb, codes, D, M, next, ahead, NULL, NULL);
            panel_rows(codes, D, M, q, has_minimum(type), bias, y, 16 * p, rows, m, n, k);
        }
        free(codes);
    }
    free(q.qx); free(q.dx); free(q.dxsx); free(q.start);
    return status;
}

#else  /* no AVX512-VNNI: the products above serve */

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
 * is built, at every row count: on the default model's shapes it is ahead of the tiled product
 * at every row count the benchmark times, and of the weight-stationary int8 product from one
 * row (for Q8_0's single row, by a few percent on most shapes). Without the GEMM, the tiled
 * product from tiled_min_rows(type) rows, where it overtakes the weight-stationary one (the
 * same benchmark), and that one below. Panels are made only where the GEMM is built: only it
 * multiplies them.
 */
enum { PATH_FLOAT, PATH_INT8, PATH_GEMM, PATH_TILED };  /* cpu_gguf_gemv.PATHS */

static int64_t tiled_min_rows(int type) {
    switch (type) {
    case TYPE_Q4_1: return 4;
    case TYPE_Q4_0: return 5;
    case TYPE_Q4_K: return 5;  /* K rounded up to whole super-blocks: gguf_products_q4_k.json */
    default: return 6;
    }
}

int gguf_product_path(int type, int64_t m, int64_t n, int64_t k) {
    if (gguf_gemm_supported() && gguf_gemm_decodes(type)) return PATH_GEMM;
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

int gguf_layer_product_q8_0(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q8_0, bias, y, m, n, k);
}

int gguf_layer_product_q4_0(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q4_0, bias, y, m, n, k);
}

int gguf_layer_product_q4_1(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q4_1, bias, y, m, n, k);
}

int gguf_layer_product_q8_0_panels(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                                   int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q8_0 | GGUF_PANELS, bias, y, m, n, k);
}

int gguf_layer_product_q4_0_panels(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                                   int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q4_0 | GGUF_PANELS, bias, y, m, n, k);
}

int gguf_layer_product_q4_1_panels(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                                   int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q4_1 | GGUF_PANELS, bias, y, m, n, k);
}

int gguf_layer_product_q4_k(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                            int64_t m, int64_t n, int64_t k) {
    return gguf_product_bf16(x, w, TYPE_Q4_K, bias, y, m, n, k);
}
