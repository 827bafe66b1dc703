/*
 * Part of cpu_gguf_gemv.c: the GGUF block layouts, their dequantization (scalar, and 16 lanes
 * at a time where AVX-512 is built, 8 where AVX2 is the widest), and the panel layout the int8
 * GEMM reads.
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
 *   Q6_K  [128 bytes: ql][64 bytes: qh][16 int8 scales sc_r][d]   a super-block of 256 weights,
 *         6-bit codes q_i in 16 runs r of 16, each with a signed scale:  w_i = (d * sc_r) * (q_i - 32)
 *
 *   weight 128 h + 32 j + l (h = 0, 1; j = 0..3; l = 0..31), in run 8 h + 2 j + l / 16: its low 4
 *         bits are byte 64 h + 32 (j % 2) + l of ql (the low half for j < 2, else the high half),
 *         its high 2 bits are bits 2 j and 2 j + 1 of byte 32 h + l of qh
 *
 * Dequantizing sees every type as blocks of 32 weights (a Q4_K sub-block is one, its scale and
 * minimum unpacked from its super-block's; a Q6_K block is j of half h above, two runs); the
 * weight-stationary products on Q4_K walk a row a super-block at a time, unpacking its scales
 * once for its 8 sub-blocks.
 *
 * Panels: where the int8 GEMM runs, a model's weights of the types it decodes are regrouped
 * once, after loading, into 16-row panels (gguf_to_panels), and passed as `type | GGUF_PANELS`.
 * The same bytes, so that the GEMM reads a block of 16 rows as whole vectors in one stream
 * instead of gathering 16 rows' blocks:
 *
 *   panel p (rows 16 p .. 16 p + 15), block kb at byte (p * nb + kb) * 16 * block bytes:
 *     [codes: C x 64 bytes][d: 16 fp16][m: 16 fp16, Q4_1 only]     C = 8 for Q8_0, 4 for Q4
 *     64-byte group g, dword c: the block's code bytes 4 g .. 4 g + 3 of row 16 p + c
 */
#ifndef VLLM_CPU_GGUF_GEMV_BLOCKS_H
#define VLLM_CPU_GGUF_GEMV_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q6_K = 14 };  /* GGMLQuantizationType values */

#define GGUF_PANELS 0x100  /* a layout flag on a type: its rows regrouped into 16-row panels */

#define QK 32    /* weights per block (per sub-block of Q4_K, per block of Q6_K) */
#define QK_K 256 /* weights per super-block of Q4_K and Q6_K */

static int64_t block_bytes(int type) {
    switch (type) {
    case TYPE_Q4_0: return 18;
    case TYPE_Q4_1: return 20;
    case TYPE_Q8_0: return 34;
    case TYPE_Q4_K: return 144;
    case TYPE_Q6_K: return 210;
    default: return 0;
    }
}

/* Whether a block of `type` is a super-block of QK_K weights (else QK). */
static inline int is_super_block(int type) { return type == TYPE_Q4_K || type == TYPE_Q6_K; }

/* Bytes of a row of k weights of `type`; 0 for an unknown type or k not whole blocks. */
static int64_t row_bytes(int type, int64_t k) {
    const int64_t weights = is_super_block(type) ? QK_K : QK;
    return k % weights ? 0 : k / weights * block_bytes(type);
}

/* The types panels hold: 32-weight blocks one after another (not the super-blocks of Q4_K, which
 * the int8 GEMM reads from its rows, or Q6_K). */
static inline int panel_type(int type) { return type == TYPE_Q8_0 || type == TYPE_Q4_0 || type == TYPE_Q4_1; }

/* The types the AVX512-VNNI int8 GEMM decodes: the panels' types, and Q4_K from its rows (the
 * AVX2 one's: gemm8_type). */
static inline int gemm_type(int type) { return panel_type(type) || type == TYPE_Q4_K; }

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

/* Block s (weights 32 s .. 32 s + 31) of the Q6_K super-block sb: its code bytes, the shifts
 * that bring its bits down, and the scales d * sc_r of its two runs of 16. */
struct q6_k_block {
    const uint8_t *ql, *qh;
    int ql_shift, qh_shift;
    float scale[2];
};

static inline struct q6_k_block q6_k_block(const uint8_t *sb, int s) {
    const int h = s / 4, j = s % 4;
    const int8_t *sc = (const int8_t *)(sb + 192) + 8 * h + 2 * j;
    const float d = half_to_float(sb + 208);
    return (struct q6_k_block){sb + 64 * h + 32 * (j % 2), sb + 128 + 32 * h, 4 * (j / 2), 2 * j,
                               {d * (float)sc[0], d * (float)sc[1]}};
}

/* Block b (weights 32 b .. 32 b + 31) of a row of `type` -> 32 float32, as dequantize_block;
 * for Q4_K, sub-block b % 8 of super-block b / 8, for Q6_K block b % 8 of super-block b / 8,
 * with the gguf package's roundings (a run's scale d * sc_r, then one multiply). */
static inline void dequantize_row_block(const uint8_t *row, int64_t b, int type, float *out) {
    if (type == TYPE_Q6_K) {
        const struct q6_k_block q = q6_k_block(row + b / 8 * block_bytes(type), (int)(b % 8));
        for (int i = 0; i < QK; ++i) {
            const int code = (q.ql[i] >> q.ql_shift & 15) | (q.qh[i] >> q.qh_shift & 3) << 4;
            out[i] = (float)(code - 32) * q.scale[i / 16];
        }
        return;
    }
    if (type != TYPE_Q4_K) {
        dequantize_block(row + b * block_bytes(type), type, out);
        return;
    }
    int shift;
    float scale, min;
    const uint8_t *q = q4_k_sub_block(row + b / 8 * block_bytes(type), (int)(b % 8), &shift, &scale, &min);
    for (int i = 0; i < QK; ++i) out[i] = (float)((q[i] >> shift) & 15) * scale - min;
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

/* A Q6_K block as 2 x 16 float32 (its two runs), with dequantize_row_block's roundings. */
static inline __attribute__((always_inline)) void q6_k_block16(const struct q6_k_block *q, __m512 *lo, __m512 *hi) {
    __m512 *out[2] = {lo, hi};
    for (int r = 0; r < 2; ++r) {
        const __m512i l = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q->ql + 16 * r))),
                                            _mm512_set1_epi32(q->ql_shift));
        const __m512i h = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q->qh + 16 * r))),
                                            _mm512_set1_epi32(q->qh_shift));
        const __m512i code = _mm512_or_si512(_mm512_and_si512(l, _mm512_set1_epi32(15)),
                                             _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(3)), 4));
        *out[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(code, _mm512_set1_epi32(32))),
                                _mm512_set1_ps(q->scale[r]));
    }
}

/* Block b of a row of `type` as 2 x 16 float32, as dequantize_row_block. */
static inline __attribute__((always_inline)) void dequantize_row_block16(const uint8_t *row, int64_t b, int type,
                                                                         __m512 *lo, __m512 *hi) {
    if (type == TYPE_Q6_K) {
        const struct q6_k_block q = q6_k_block(row + b / 8 * block_bytes(type), (int)(b % 8));
        q6_k_block16(&q, lo, hi);
        return;
    }
    if (type != TYPE_Q4_K) {
        dequantize_block16(row + b * block_bytes(type), type, lo, hi);
        return;
    }
    const uint8_t *sb = row + b / 8 * block_bytes(type);
    const struct q4_k_scales u = q4_k_scales(sb);
    q4_k_sub_block16(sb, &u, (int)(b % 8), lo, hi);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same, 8 lanes at a time, where AVX2 is the widest: a block as 4 x 8 float32 (weights
 * 8 v .. 8 v + 7 in w[v]), with dequantize_row_block's roundings. */

/* Bytes at..at+7, shifted right by `shift` and masked with `mask`, as 8 int32. */
static inline __m256i codes8(const uint8_t *at, int shift, int mask) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at));
    return _mm256_and_si256(_mm256_srli_epi32(q, shift), _mm256_set1_epi32(mask));
}

static inline __attribute__((always_inline)) void dequantize_block8(const uint8_t *b, int type, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    if (type == TYPE_Q8_0) {
        for (int v = 0; v < 4; ++v)
            w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * v)))), d);
        return;
    }
    const uint8_t *q = b + (type == TYPE_Q4_1 ? 4 : 2);
    const __m256i offset = _mm256_set1_epi32(type == TYPE_Q4_0 ? 8 : 0);
    for (int v = 0; v < 4; ++v)  /* weights 0-15 in the low nibbles, 16-31 in the high */
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(codes8(q + 8 * (v % 2), 4 * (v / 2), 15), offset)), d);
    if (type == TYPE_Q4_1) {
        const __m256 m = _mm256_set1_ps(half_to_float(b + 2));
        for (int v = 0; v < 4; ++v) w[v] = _mm256_add_ps(w[v], m);
    }
}

/* Sub-block s of the Q4_K super-block sb (its scales unpacked in u) as 4 x 8 float32. */
static inline __attribute__((always_inline)) void q4_k_sub_block8(const uint8_t *sb, const struct q4_k_scales *u,
                                                                  int s, __m256 w[4]) {
    const uint8_t *q = sb + 16 + 32 * (s / 2);
    const __m256 d = _mm256_set1_ps(q4_k_scale(u, s)), m = _mm256_set1_ps(q4_k_min(u, s));
    for (int v = 0; v < 4; ++v)
        w[v] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(codes8(q + 8 * v, 4 * (s % 2), 15)), d), m);
}

/* A Q6_K block as 4 x 8 float32 (its first run in w[0..1], its second in w[2..3]). */
static inline __attribute__((always_inline)) void q6_k_block8(const struct q6_k_block *q, __m256 w[4]) {
    for (int v = 0; v < 4; ++v) {
        const __m256i code = _mm256_or_si256(codes8(q->ql + 8 * v, q->ql_shift, 15),
                                             _mm256_slli_epi32(codes8(q->qh + 8 * v, q->qh_shift, 3), 4));
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(32))),
                             _mm256_set1_ps(q->scale[v / 2]));
    }
}

/* Block b of a row of `type` as 4 x 8 float32, as dequantize_row_block. */
static inline __attribute__((always_inline)) void dequantize_row_block8(const uint8_t *row, int64_t b, int type,
                                                                        __m256 w[4]) {
    if (type == TYPE_Q6_K) {
        const struct q6_k_block q = q6_k_block(row + b / 8 * block_bytes(type), (int)(b % 8));
        q6_k_block8(&q, w);
        return;
    }
    if (type != TYPE_Q4_K) {
        dequantize_block8(row + b * block_bytes(type), type, w);
        return;
    }
    const uint8_t *sb = row + b / 8 * block_bytes(type);
    const struct q4_k_scales u = q4_k_scales(sb);
    q4_k_sub_block8(sb, &u, (int)(b % 8), w);
}
#endif

/* Block b of a row of `type` -> 32 float32 at out, as dequantize_row_block, in the widest
 * vectors built. */
static inline __attribute__((always_inline)) void dequantize_row_block_vectors(const uint8_t *row, int64_t b, int type,
                                                                               float *out) {
#ifdef __AVX512F__
    __m512 lo, hi;
    dequantize_row_block16(row, b, type, &lo, &hi);
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 w[4];
    dequantize_row_block8(row, b, type, w);
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + 8 * v, w[v]);
#else
    dequantize_row_block(row, b, type, out);
#endif
}

#endif  /* VLLM_CPU_GGUF_GEMV_BLOCKS_H */
