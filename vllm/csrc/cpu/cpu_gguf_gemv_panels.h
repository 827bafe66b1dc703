/*
 * Part of cpu_gguf_gemv.c, the int8 GEMM's decoding and inner loops (HAVE_GGUF_GEMM where
 * AVX512-VNNI is built).
 *
 * The int8 GEMM, for bf16 x: the int8 product's arithmetic with the weights unpacked once per
 * call instead of once per row of x. Every type is, per block of 32,
 *
 *   w_i = D * (u_i - offset) + M      u_i its unsigned byte codes
 *   Q8_0: u = q + 128, offset 128, M = 0     Q4_0: u = q, offset 8, M = 0     Q4_1: D = d, M = m
 *   Q4_K sub-block s: D = d * sc_s, M = -dmin * m_s (its rows' scales unpacked per block)
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
 * codes of x's dwords g and 4 + g). Per block and row of x, a panel then takes 8 vpdpbusd, a
 * conversion to float, a multiply and one or two multiply-adds for its 16 outputs. Threads
 * unpack two panels at a time and multiply tiles of up to 6 rows of x into both, each dword of
 * x broadcast once for the two (panel_pair_tile), and prefetch their next two meanwhile; an odd
 * last panel takes tiles of up to 8 rows alone. x of up to 8 rows needs no unpacked copy: each
 * block is multiplied into all its rows as it is decoded (multiply_panel), and threads take
 * single panels. x is quantized once per call. Which product serves which rows:
 * gguf_product_path.
 */
#ifndef VLLM_CPU_GGUF_GEMV_PANELS_H
#define VLLM_CPU_GGUF_GEMV_PANELS_H

#include <stdlib.h>

#include "cpu_gguf_gemv_blocks.h"
#include "prefetch.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_GGUF_GEMM 1
#define GEMM_TILE 8  /* rows of x per pass over a panel: their dot products and sums stay in registers */
#define PAIR_TILE 6  /* rows of x per pass over two panels (panel_pair_tile) */
#define PREFETCH_PANELS 2  /* how far ahead of the panels being multiplied W is prefetched, into L2 */

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
static inline int has_minimum(int type) { return type == TYPE_Q4_1 || type == TYPE_Q4_K; }  /* offset 0 */

/* Sub-block s of the Q4_K super-blocks at `at` of the rows of p -> codes, *D, *M: each row's
 * 6-bit scale and minimum unpacked in its lane, as q4_k_scales does from the 12 scale bytes. */
static inline void decode_q4_k_blocks(const panel_rows_at *p, int64_t at, int s, __m512i codes[8], __m512 *D,
                                      __m512 *M) {
    const __m512i first = load_words(p, at);  /* d, dmin */
    const __m512i w0 = load_words(p, at + 4), w1 = load_words(p, at + 8), w2 = load_words(p, at + 12);
    const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f),
                  top = _mm512_set1_epi32(0x30303030);
    __m512i sc, m;  /* byte s % 4 of each lane: sc_s, m_s */
    if (s < 4) {
        sc = _mm512_and_si512(w0, six);
        m = _mm512_and_si512(w1, six);
    } else {
        sc = _mm512_or_si512(_mm512_and_si512(w2, four), _mm512_and_si512(_mm512_srli_epi32(w0, 2), top));
        m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), four),
                            _mm512_and_si512(_mm512_srli_epi32(w1, 2), top));
    }
    const __m512i shift = _mm512_set1_epi32(8 * (s % 4)), byte = _mm512_set1_epi32(0xff);
    sc = _mm512_and_si512(_mm512_srlv_epi32(sc, shift), byte);
    m = _mm512_and_si512(_mm512_srlv_epi32(m, shift), byte);
    /* exact in float32 (11-bit by 6-bit products), as q4_k_scale and q4_k_min */
    *D = _mm512_mul_ps(halves_to_float(first, 0), _mm512_cvtepi32_ps(sc));
    *M = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(halves_to_float(first, 1), _mm512_cvtepi32_ps(m)));
    load_dwords(p, at + 16 + 32 * (s / 2), codes);
    load_dwords(p, at + 32 + 32 * (s / 2), codes + 4);
    const __m512i low = _mm512_set1_epi8(15);
    for (int g = 0; g < 8; ++g)
        codes[g] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(codes[g], 4) : codes[g], low);
}

/* Block kb (weights 32 kb .. 32 kb + 31) of the rows of p -> codes[g] (lane c: u_4g .. u_4g+3
 * of row c), *D, *M. */
static inline void decode_blocks(const panel_rows_at *p, int type, int64_t kb, __m512i codes[8], __m512 *D,
                                 __m512 *M) {
    if (type == TYPE_Q4_K) {
        decode_q4_k_blocks(p, kb / 8 * block_bytes(type), (int)(kb % 8), codes, D, M);
        return;
    }
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

/* Block i of bf16 x -> its codes, with gguf_matmul_int8's arithmetic (quantize_block). */
static inline void quantize_x_block(const uint16_t *x, int offset, int64_t i, quantized_x q) {
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

/* bf16 x (m, k) -> its blocks' codes. Few blocks (a decode's rows) stay on the calling thread,
 * outside any OpenMP region, which would cost more than they do. */
static void quantize_x(const uint16_t *x, int type, int64_t m, int64_t k, quantized_x q) {
    const int64_t blocks = m * (k / QK);
    const int offset = code_offset(type);
    if (blocks < 256) {
        for (int64_t i = 0; i < blocks; ++i) quantize_x_block(x, offset, i, q);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < blocks; ++i) quantize_x_block(x, offset, i, q);
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

/* Dword g (codes 4 g .. 4 g + 3) of x block xb, in every lane. */
static inline __m512i x_codes(quantized_x q, int64_t xb, int g) {
    return _mm512_set1_epi32(((const int32_t *)(q.qx + xb * QK))[g]);
}

/* acc + x block xb's share of the panel's block (its integer dot product `dot` with the codes,
 * D, M) in its 16 output rows. */
static inline __attribute__((always_inline)) __m512 block_epilogue(
        __m512i dot, __m512 D, __m512 M, quantized_x q, int64_t xb, const int with_minimum, __m512 acc) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(q.dx[xb])), D, acc);
    return with_minimum ? _mm512_fmadd_ps(M, _mm512_set1_ps(q.dxsx[xb]), acc) : acc;
}

/* acc[t] (t < TM) + x block xb + t * nb's share of the panel's block (codes u, D, M) in its 16
 * output rows: each code vector multiplies into the TM rows' dot products in turn, so
 * consecutive vpdpbusd are independent, where a row's 8 in a row would each wait for the one
 * before. TM and with_minimum are constants in each caller: the dot products stay in registers. */
static inline __attribute__((always_inline)) void tile_block(const __m512i *u, __m512 D, __m512 M, quantized_x q,
                                                             int64_t xb, int64_t nb, const int TM,
                                                             const int with_minimum, __m512 *acc) {
    __m512i dot[GEMM_TILE];
    for (int t = 0; t < TM; ++t) dot[t] = _mm512_set1_epi32(q.start[xb + t * nb]);
    for (int g = 0; g < 8; ++g) {
        const __m512i ug = u[g];
        for (int t = 0; t < TM; ++t) dot[t] = _mm512_dpbusd_epi32(dot[t], ug, x_codes(q, xb + t * nb, g));
    }
    for (int t = 0; t < TM; ++t) acc[t] = block_epilogue(dot[t], D, M, q, xb + t * nb, with_minimum, acc[t]);
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

/* Where the rows [j0, j0 + rows) of W (rows <= 16; lanes past them repeat the last row) start. */
static inline panel_rows_at panel_at(const uint8_t *w, int type, int64_t j0, int rows, int64_t nb) {
    const int64_t stride = row_bytes(type, nb * QK);
    panel_rows_at p = {.base = w + j0 * stride};
    for (int c = 0; c < 16; ++c) p.offset[c] = (c < rows ? c : rows - 1) * stride;
    return p;
}

/* Rows in W's panel from output row j0: 16, fewer in the last, 0 past it. */
static inline int panel_height(int64_t n, int64_t j0) { return j0 >= n ? 0 : n - j0 < 16 ? (int)(n - j0) : 16; }

/* Where the panel from output row j0 starts, to prefetch (W itself past the last: nothing is). */
static inline const uint8_t *prefetched(const uint8_t *w, int64_t n, int64_t j0, int64_t stride) {
    return j0 < n ? w + j0 * stride : w;
}

/* Prefetches `count` panels of W from panel p on (none past the last) into L1, together: a
 * thread's first panels, which are otherwise read at the rate of its demand misses (a product of
 * few rows is a short read, and its start a large share of it). */
static inline void prefetch_panels(const uint8_t *w, int64_t n, int64_t stride, int64_t p, int64_t count) {
    const int64_t end = 16 * (p + count) < n ? 16 * (p + count) : n;
    for (const uint8_t *at = w + 16 * p * stride; at < w + end * stride; at += 64)
        _mm_prefetch((const char *)at, _MM_HINT_T0);
}

/* A panel unpacked into vpdpbusd's layout (the layout above): its nb blocks' codes, D and M, and
 * how many of its 16 lanes are W's rows. */
typedef struct {
    const __m512i *codes;
    const __m512 *D, *M;
    int rows;
} unpacked_panel;

/* Rows [j0, j0 + rows) of W -> the panel, unpacked into `buffer` (nb x (8 zmm of codes, 16 D,
 * 16 M), 64-byte aligned): in rows, the panel's 16 rows are read a block of each at a time, 16
 * short streams the hardware prefetchers do not follow from memory; in panels (`panels`: W
 * regrouped, rows == 16), one. Its reads are prefetched while the panels before it multiply
 * (panel_pair_rows, panel_rows). Not inlined: inlined into the GEMM's loop beside
 * multiply_panel's copies, it compiled to slower code. */
__attribute__((noinline)) static unpacked_panel unpack_panel(const uint8_t *w, int type, int panels, int64_t j0,
                                                             int rows, int64_t nb, void *buffer) {
    __m512i *codes = buffer;
    __m512 *D = (__m512 *)(codes + nb * 8), *M = D + nb;
    const panel_rows_at p = panel_at(w, type, j0, rows, nb);
    for (int64_t kb = 0; kb < nb; ++kb) decode_any(&p, panels, type, kb, codes + kb * 8, D + kb, M + kb);
    return (unpacked_panel){codes, D, M, rows};
}

/* All TM rows of x (TM <= GEMM_TILE) times the panel of W's rows [j0, j0 + rows) into y, each
 * block multiplied as it is decoded, the panel never stored, prefetching the `ahead` bytes of W
 * from `next` (a later panel, contiguous) over its blocks. */
static inline __attribute__((always_inline)) void multiply_panel(
        const uint8_t *w, int type, int panels, int64_t j0, int rows, int64_t nb, const uint8_t *next,
        int64_t ahead, quantized_x q, const int TM, const int with_minimum, const uint16_t *bias, uint16_t *y,
        int64_t n) {
    const panel_rows_at p = panel_at(w, type, j0, rows, nb);
    prefetch_stream stream = prefetch_spread(next, ahead, nb);
    __m512 acc[GEMM_TILE];
    for (int t = 0; t < TM; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        prefetch_step(&stream);
        __m512i u[8];
        __m512 D, M;
        decode_any(&p, panels, type, kb, u, &D, &M);
        tile_block(u, D, M, q, kb, nb, TM, with_minimum, acc);
    }
    store_rows(acc, 0, TM, bias, y, j0, rows, n);
}

/* multiply_panel for x of m <= GEMM_TILE rows. */
static void multiply_panel_rows(const uint8_t *w, int type, int panels, int64_t j0, int rows, int64_t nb,
                                const uint8_t *next, int64_t ahead, quantized_x q, int64_t m, const uint16_t *bias,
                                uint16_t *y, int64_t n) {
    switch (m) {
#define FEW_ROWS(TM)                                                                                      \
    case TM:                                                                                              \
        if (has_minimum(type)) multiply_panel(w, type, panels, j0, rows, nb, next, ahead, q, TM, 1, bias, y, n); \
        else multiply_panel(w, type, panels, j0, rows, nb, next, ahead, q, TM, 0, bias, y, n);           \
        break;
    FEW_ROWS(1) FEW_ROWS(2) FEW_ROWS(3) FEW_ROWS(4) FEW_ROWS(5) FEW_ROWS(6) FEW_ROWS(7) FEW_ROWS(8)
#undef FEW_ROWS
    }
}

/* Rows [t0, t0 + TM) of x times the panel from output row j0 into y; TM and with_minimum are
 * constants in each caller, so the sums stay in registers. */
static inline __attribute__((always_inline)) void panel_tile(unpacked_panel u, quantized_x q, int64_t t0, const int TM,
                                                             const int with_minimum, const uint16_t *bias, uint16_t *y,
                                                             int64_t j0, int64_t n, int64_t k, prefetch_stream *ahead) {
    const int64_t nb = k / QK;
    __m512 acc[GEMM_TILE];
    for (int t = 0; t < TM; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        prefetch_step(ahead);
        tile_block(u.codes + kb * 8, u.D[kb], u.M[kb], q, t0 * nb + kb, nb, TM, with_minimum, acc);
    }
    store_rows(acc, t0, TM, bias, y, j0, u.rows, n);
}

/* All m rows of x times the panel: tiles of 8, the rest in tiles of 4, 2, 1; meanwhile the
 * `ahead` bytes of W from `next` (the panel unpacked PREFETCH_PANELS on), prefetched over the
 * tiles' blocks. */
static void panel_rows(unpacked_panel u, quantized_x q, int with_minimum, const uint16_t *bias, uint16_t *y,
                       int64_t j0, int64_t m, int64_t n, int64_t k, const uint8_t *next, int64_t ahead) {
    const int64_t nb = k / QK;
    prefetch_stream stream = prefetch_spread(next, ahead, (m + GEMM_TILE - 1) / GEMM_TILE * nb);
    int64_t t0 = 0;
#define PANEL_TILES(TM)                                                                                   \
    for (; m - t0 >= (TM); t0 += (TM)) {                                                                 \
        if (with_minimum) panel_tile(u, q, t0, (TM), 1, bias, y, j0, n, k, &stream);                     \
        else panel_tile(u, q, t0, (TM), 0, bias, y, j0, n, k, &stream);                                  \
    }
    PANEL_TILES(8) PANEL_TILES(4) PANEL_TILES(2) PANEL_TILES(1)
#undef PANEL_TILES
    prefetch_rest(&stream);  /* where the tails took more tiles than estimated */
}

/* Rows [t0, t0 + TM) of x times two panels side by side (32 output rows from j0, the first
 * panel whole) into y: each dword of x, broadcast once, multiplies into both panels. Per code
 * dword that is 8 loads for 12 vpdpbusd, where panel_tile's 8 rows of one panel take 9 for 8,
 * with the same epilogue per block, row and panel. TM and with_minimum are constants in each
 * caller: the 2 TM sums and 2 TM dot products stay in registers, which PAIR_TILE rows, with the
 * two code vectors and x's, fill. */
static inline __attribute__((always_inline)) void panel_pair_tile(const unpacked_panel u[2], quantized_x q, int64_t t0,
                                                                  const int TM, const int with_minimum,
                                                                  const uint16_t *bias, uint16_t *y, int64_t j0,
                                                                  int64_t n, int64_t k, prefetch_stream *ahead) {
    const int64_t nb = k / QK;
    __m512 acc[2][PAIR_TILE];
    for (int t = 0; t < TM; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        prefetch_step(ahead);
        const __m512i *a = u[0].codes + kb * 8, *b = u[1].codes + kb * 8;
        __m512i dot[2][PAIR_TILE];
        for (int t = 0; t < TM; ++t)  /* types with minimums have no code offset: they start at 0 */
            dot[0][t] = dot[1][t] = with_minimum ? _mm512_setzero_si512()
                                                 : _mm512_set1_epi32(q.start[(t0 + t) * nb + kb]);
        for (int g = 0; g < 8; ++g) {
            const __m512i ag = a[g], bg = b[g];
            for (int t = 0; t < TM; ++t) {
                const __m512i xg = x_codes(q, (t0 + t) * nb + kb, g);
                dot[0][t] = _mm512_dpbusd_epi32(dot[0][t], ag, xg);
                dot[1][t] = _mm512_dpbusd_epi32(dot[1][t], bg, xg);
            }
        }
        for (int t = 0; t < TM; ++t)
            for (int j = 0; j < 2; ++j)
                acc[j][t] = block_epilogue(dot[j][t], u[j].D[kb], u[j].M[kb], q, (t0 + t) * nb + kb, with_minimum,
                                           acc[j][t]);
    }
    for (int j = 0; j < 2; ++j) store_rows(acc[j], t0, TM, bias, y, j0 + 16 * j, u[j].rows, n);
}

/* All m rows of x times two panels side by side: tiles of PAIR_TILE, the rest in tiles of 4, 2,
 * 1; meanwhile the `ahead` bytes of W from `next` (the two panels unpacked PREFETCH_PANELS on),
 * prefetched over the tiles' blocks. */
static void panel_pair_rows(const unpacked_panel u[2], quantized_x q, int with_minimum, const uint16_t *bias,
                            uint16_t *y, int64_t j0, int64_t m, int64_t n, int64_t k, const uint8_t *next,
                            int64_t ahead) {
    const int64_t nb = k / QK;
    prefetch_stream stream = prefetch_spread(next, ahead, (m + PAIR_TILE - 1) / PAIR_TILE * nb);
    int64_t t0 = 0;
#define PAIR_TILES(TM)                                                                                    \
    for (; m - t0 >= (TM); t0 += (TM)) {                                                                 \
        if (with_minimum) panel_pair_tile(u, q, t0, (TM), 1, bias, y, j0, n, k, &stream);                \
        else panel_pair_tile(u, q, t0, (TM), 0, bias, y, j0, n, k, &stream);                             \
    }
    PAIR_TILES(PAIR_TILE) PAIR_TILES(4) PAIR_TILES(2) PAIR_TILES(1)
#undef PAIR_TILES
    prefetch_rest(&stream);  /* where the tails took more tiles than estimated */
}

#endif

#endif  /* VLLM_CPU_GGUF_GEMV_PANELS_H */
