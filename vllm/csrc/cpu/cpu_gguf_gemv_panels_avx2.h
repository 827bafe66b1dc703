/*
 * Part of cpu_gguf_gemv.c: the int8 GEMM where AVX2 is the widest ISA built (HAVE_GGUF_GEMM_AVX2;
 * cpu_gguf_gemv_panels.h has the AVX512-VNNI one), for Q8_0, Q4_0 and Q4_1 in rows or panels.
 *
 * The same arithmetic per output as that GEMM (see its header): per block of 32,
 *
 *   sum_i w_i x_i ~= D * dx * dot + M * dx * sx      dot = sum_i (u_i - offset) * qx_i, in int32
 *
 * in float32 in the blocks' order, so an output does not depend on how many rows of x come with
 * it. Each 16-row panel is taken as two halves of 8 rows, one ymm lane per output row:
 *
 *   codes[g]  lane c: the 4 byte codes of dword g (codes 4g .. 4g + 3) of row c's block
 *
 * and x's dword g, broadcast, multiplies into all 8 rows (vpmaddubsw: unsigned by signed byte
 * pairs summed into int16, then vpmaddwd into int32). A pair of 4-bit codes (at most 15) and x's
 * codes (at most 127 in magnitude) sums to at most 3810, so a block's 8 code dwords add up in
 * int16 before one vpmaddwd. Q8_0's codes are signed: their magnitudes (at most 128) multiply x
 * with their signs, and each pair (at most 32512) widens to int32 at once.
 *
 * A thread takes 16 output rows at a time, its two halves. Up to GEMM8_TILE rows of x multiply
 * each block as it is decoded; more rows take the halves unpacked once (their blocks' codes, D
 * and M) into a per-thread buffer, then tiles of x. 4-bit codes take both halves at once, each
 * dword of x broadcast for the two (from panels where few rows decode as they go): fewer
 * broadcasts, and two independent sums per row of x. Meanwhile the bytes of the next 16 rows,
 * which a thread's static share reaches next, are prefetched: in rows, a half is 8 streams at
 * once, more than the hardware prefetchers may follow from memory.
 */
#ifndef VLLM_CPU_GGUF_GEMV_PANELS_AVX2_H
#define VLLM_CPU_GGUF_GEMV_PANELS_AVX2_H

#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_gguf_gemv_blocks.h"
#include "cpu_gguf_gemv_rows.h"
#include "prefetch.h"

#if !defined(HAVE_GGUF_GEMM) && defined(HAVE_GGUF_INT8_ROWS) && defined(__FMA__) && defined(__F16C__)
#define HAVE_GGUF_GEMM_AVX2 1
#define GEMM8_TILE 4  /* rows of x per pass over a half panel: their sums stay in registers */
#define PAIR_TILE 3   /* the same over two unpacked halves side by side */

/* An empty asm that may have changed v, as the compiler must assume: the additions into a sum
 * stay in their written order. Reassociated into a tree, as GCC does, they would keep all of a
 * row's products live at once, more than AVX2's 16 vector registers hold, and spill. */
#define KEEP_IN_ORDER(v) __asm__("" : "+x"(v))

/* The types this GEMM decodes (in rows, or in panels). */
static inline int gemm8_type(int type) { return panel_type(type); }

/* The 8 rows of a half panel, in rows (row c at base + offset[c]; lanes past W's last row repeat
 * it) or in panels (base: the panel's first block, half: which 8 of its 16 lanes). */
typedef struct {
    const uint8_t *base;
    int64_t offset[8];
    int panels, half;
} half_panel_at;

/* 16 bytes at `at` of each row's block -> v[g] (g = 0 .. 3), lane c: dword g of row c. Rows c
 * and c + 4 go to the 128-bit lanes of r[c], then a 4 x 4 transpose in each lane. */
static inline void load_dwords8(const half_panel_at *p, int64_t at, __m256i v[4]) {
    __m256i r[4];
    for (int c = 0; c < 4; ++c)
        r[c] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p->base + p->offset[c + 4] + at)),
                                _mm_loadu_si128((const __m128i *)(p->base + p->offset[c] + at)));
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The float16 at `at` of each row's block, lane c for row c, as float32. */
static inline __m256 load_halves8(const half_panel_at *p, int64_t at) {
    uint16_t h[8];
    for (int c = 0; c < 8; ++c) memcpy(&h[c], p->base + p->offset[c] + at, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

static inline void split_nibbles8(__m256i codes[8]) {  /* as split_nibbles in the panels' header */
    const __m256i low = _mm256_set1_epi8(15);
    for (int g = 0; g < 4; ++g) {
        codes[4 + g] = _mm256_and_si256(_mm256_srli_epi16(codes[g], 4), low);
        codes[g] = _mm256_and_si256(codes[g], low);
    }
}

/* Block kb of the half panel -> codes[g] (signed for Q8_0, 4-bit unsigned otherwise), *D, *M.
 * `type` is a constant in each caller. */
static inline __attribute__((always_inline)) void decode8(const half_panel_at *p, const int type, int64_t kb,
                                                          __m256i codes[8], __m256 *D, __m256 *M) {
    const int vectors = type == TYPE_Q8_0 ? 8 : 4;
    *M = _mm256_setzero_ps();
    if (p->panels) {
        const uint8_t *at = p->base + kb * 16 * block_bytes(type);
        for (int g = 0; g < vectors; ++g) codes[g] = _mm256_loadu_si256((const __m256i *)(at + 64 * g + 32 * p->half));
        *D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + panel_d_at(type) + 16 * p->half)));
        if (type == TYPE_Q4_1)
            *M = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + panel_m_at(type) + 16 * p->half)));
    } else {
        const int64_t at = kb * block_bytes(type);
        *D = load_halves8(p, at);
        if (type == TYPE_Q4_1) *M = load_halves8(p, at + 2);
        load_dwords8(p, at + codes_at(type), codes);
        if (type == TYPE_Q8_0) load_dwords8(p, at + codes_at(type) + 16, codes + 4);
    }
    if (type != TYPE_Q8_0) split_nibbles8(codes);
}

/* x's blocks as this GEMM reads them (each array (m, k / 32) but qx (m, k)). */
typedef struct {
    int8_t *qx;
    float *dx, *dxsx;
    int32_t *start;  /* -offset * sx: where each block's integer dot product starts */
} x_blocks;

/* bf16 x (m, k) -> its blocks' codes, as gguf_matmul_int8 quantizes them. */
static void quantize_x8(const uint16_t *x, int type, int64_t m, int64_t k, x_blocks q) {
    const int64_t blocks = m * (k / QK);
    const int offset = type == TYPE_Q4_0 ? 8 : 0;  /* Q8_0's signed codes need none */
    #pragma omp parallel for schedule(static) if (blocks >= 256)
    for (int64_t i = 0; i < blocks; ++i) {
        float xf[QK];
        for (int v = 0; v < QK / 8; ++v) _mm256_storeu_ps(xf + 8 * v, bf16x8_to_float(x + i * QK + 8 * v));
        q.start[i] = -offset * quantize_block(xf, q.qx + i * QK, q.dx + i, q.dxsx + i);
    }
}

/* A 4-bit block's int16 pair sums in 8 output rows -> its integer dot products (Q4_0's start
 * added: x block xi's -offset * sx). */
static inline __attribute__((always_inline)) __m256i dot4(__m256i pairs, x_blocks q, int64_t xi, const int type) {
    const __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    return type == TYPE_Q4_0 ? _mm256_add_epi32(dot, _mm256_set1_epi32(q.start[xi])) : dot;
}

/* acc + one block's share in 8 output rows, in the float32 steps every path takes (the header's
 * sum): dot scaled by x block xi's dx, then by D; for Q4_1, M * dx * sx added. */
static inline __attribute__((always_inline)) __m256 add_block8(__m256 acc, __m256i dot, __m256 D, __m256 M,
                                                               x_blocks q, int64_t xi, const int type) {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(q.dx[xi])), D, acc);
    return type == TYPE_Q4_1 ? _mm256_fmadd_ps(M, _mm256_set1_ps(q.dxsx[xi]), acc) : acc;
}

/* acc[t] (t < TM) + x block xb + t * nb's share of the half panel's block (codes u, D, M) in its
 * 8 output rows. TM and type are constants in each caller: the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_block8(const __m256i *u, __m256 D, __m256 M, x_blocks q,
                                                              int64_t xb, int64_t nb, const int TM, const int type,
                                                              __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot[GEMM8_TILE];
    if (type == TYPE_Q8_0) {
        for (int t = 0; t < TM; ++t) dot[t] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
            const __m256i magnitude = _mm256_sign_epi8(u[g], u[g]);
            for (int t = 0; t < TM; ++t) {
                const __m256i xg = _mm256_set1_epi32(((const int32_t *)(q.qx + (xb + t * nb) * QK))[g]);
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xg, u[g]));
                dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(pairs, ones));
                KEEP_IN_ORDER(dot[t]);
            }
        }
    } else {
        __m256i pairs[GEMM8_TILE];
        for (int t = 0; t < TM; ++t) pairs[t] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g)
            for (int t = 0; t < TM; ++t) {
                const __m256i xg = _mm256_set1_epi32(((const int32_t *)(q.qx + (xb + t * nb) * QK))[g]);
                pairs[t] = _mm256_add_epi16(pairs[t], _mm256_maddubs_epi16(u[g], xg));
                KEEP_IN_ORDER(pairs[t]);
            }
        for (int t = 0; t < TM; ++t) dot[t] = dot4(pairs[t], q, xb + t * nb, type);
    }
    for (int t = 0; t < TM; ++t) acc[t] = add_block8(acc[t], dot[t], D, M, q, xb + t * nb, type);
}

/* Rows [t0, t0 + TM) of y, output rows [j0, j0 + rows) (rows <= 8): acc[t] plus the bias, to bf16. */
static inline void store_rows8(const __m256 *acc, int64_t t0, int TM, const uint16_t *bias, uint16_t *y,
                               int64_t j0, int rows, int64_t n) {
    float b[8] = {0};
    for (int c = 0; c < rows && bias != NULL; ++c) b[c] = bf16_to_float(bias[j0 + c]);
    const __m256 bv = _mm256_loadu_ps(b);
    for (int t = 0; t < TM; ++t) {
        const __m256 v = _mm256_add_ps(acc[t], bv);
        if (rows == 8) {
            store_bf16x8(y + (t0 + t) * n + j0, v);
            continue;
        }
        float f[8];
        _mm256_storeu_ps(f, v);
        for (int c = 0; c < rows; ++c) y[(t0 + t) * n + j0 + c] = float_to_bf16(f[c]);
    }
}

/* Rows [t0, t0 + TM) of x times the half panel, each block multiplied as it is decoded. */
static inline __attribute__((always_inline)) void multiply_half(const half_panel_at *p, const int type, x_blocks q,
                                                                int64_t t0, const int TM, int64_t nb,
                                                                const uint16_t *bias, uint16_t *y, int64_t j0,
                                                                int rows, int64_t n, prefetch_stream *ahead) {
    __m256 acc[GEMM8_TILE];
    for (int t = 0; t < TM; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        prefetch_step(ahead);
        __m256i u[8];
        __m256 D, M;
        decode8(p, type, kb, u, &D, &M);
        tile_block8(u, D, M, q, t0 * nb + kb, nb, TM, type, acc);
    }
    store_rows8(acc, t0, TM, bias, y, j0, rows, n);
}

/* multiply_half over both halves of a panel of 4-bit codes (its first block at base) at once:
 * each dword of x broadcast once for the two, and two sums per row of x to add into instead of
 * one chain. */
static inline __attribute__((always_inline)) void multiply_panel(const uint8_t *base, const int type, x_blocks q,
                                                                 const int TM, int64_t nb, const uint16_t *bias,
                                                                 uint16_t *y, int64_t j0, int64_t n,
                                                                 prefetch_stream *ahead) {
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[2][GEMM8_TILE];
    for (int i = 0; i < 2; ++i)
        for (int t = 0; t < TM; ++t) acc[i][t] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        prefetch_step(ahead);
        const uint8_t *at = base + kb * 16 * block_bytes(type);
        const int32_t *xd[GEMM8_TILE];  /* row t's codes of the block, as dwords */
        __m256i pairs[2][GEMM8_TILE];
        for (int t = 0; t < TM; ++t) {
            xd[t] = (const int32_t *)(q.qx + (t * nb + kb) * QK);
            pairs[0][t] = pairs[1][t] = _mm256_setzero_si256();
        }
        for (int g = 0; g < 4; ++g) {  /* code dword g of each row: codes 4g.. low, 16 + 4g.. high */
            __m256i xl[GEMM8_TILE], xh[GEMM8_TILE];
            for (int t = 0; t < TM; ++t) {
                xl[t] = _mm256_set1_epi32(xd[t][g]);
                xh[t] = _mm256_set1_epi32(xd[t][g + 4]);
            }
            for (int i = 0; i < 2; ++i) {
                const __m256i codes = _mm256_loadu_si256((const __m256i *)(at + 64 * g + 32 * i));
                const __m256i lo = _mm256_and_si256(codes, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low);
                for (int t = 0; t < TM; ++t) {
                    pairs[i][t] = _mm256_add_epi16(pairs[i][t], _mm256_maddubs_epi16(lo, xl[t]));
                    KEEP_IN_ORDER(pairs[i][t]);
                    pairs[i][t] = _mm256_add_epi16(pairs[i][t], _mm256_maddubs_epi16(hi, xh[t]));
                    KEEP_IN_ORDER(pairs[i][t]);
                }
            }
        }
        for (int i = 0; i < 2; ++i) {
            const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + panel_d_at(type) + 16 * i)));
            const __m256 M = type == TYPE_Q4_1  /* Q4_0's panels have none */
                ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + panel_m_at(type) + 16 * i)))
                : _mm256_setzero_ps();
            for (int t = 0; t < TM; ++t)
                acc[i][t] = add_block8(acc[i][t], dot4(pairs[i][t], q, t * nb + kb, type), D, M, q, t * nb + kb, type);
        }
    }
    for (int i = 0; i < 2; ++i) store_rows8(acc[i], 0, TM, bias, y, j0 + 8 * i, 8, n);
}

/* A half panel unpacked: per block, 8 code vectors, then D and M (buffer: nb * 10 ymm). */
static inline void unpack_half(const half_panel_at *p, const int type, int64_t nb, __m256i *buffer) {
    for (int64_t kb = 0; kb < nb; ++kb) {
        __m256 D, M;
        decode8(p, type, kb, buffer + 10 * kb, &D, &M);
        buffer[10 * kb + 8] = _mm256_castps_si256(D);
        buffer[10 * kb + 9] = _mm256_castps_si256(M);
    }
}

/* tile_block8 for 4-bit codes, over H unpacked half panels side by side (unpack_half's block b
 * of each, half_stride apart: 8 code vectors, then D and M; acc[i] half i's). Each code vector
 * is read where it multiplies, and each dword of x broadcast once for all H halves: only the
 * sums and accumulators stay in registers, H * TM of each. */
static inline __attribute__((always_inline)) void tile_block4_unpacked(const __m256i *b, int64_t half_stride,
                                                                       const int H, x_blocks q, int64_t xb,
                                                                       int64_t nb, const int TM, const int type,
                                                                       __m256 acc[][GEMM8_TILE]) {
    const int32_t *xd[GEMM8_TILE];  /* row t's codes of the block, as dwords */
    __m256i pairs[2][GEMM8_TILE];
    for (int t = 0; t < TM; ++t) {
        xd[t] = (const int32_t *)(q.qx + (xb + t * nb) * QK);
        for (int i = 0; i < H; ++i) pairs[i][t] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 8; ++g) {
        __m256i u[2];
        for (int i = 0; i < H; ++i) u[i] = _mm256_load_si256(b + i * half_stride + g);
        for (int t = 0; t < TM; ++t) {
            const __m256i xg = _mm256_set1_epi32(xd[t][g]);
            for (int i = 0; i < H; ++i) {
                pairs[i][t] = _mm256_add_epi16(pairs[i][t], _mm256_maddubs_epi16(u[i], xg));
                KEEP_IN_ORDER(pairs[i][t]);
            }
        }
    }
    for (int i = 0; i < H; ++i) {
        const __m256i *bi = b + i * half_stride;
        for (int t = 0; t < TM; ++t)
            acc[i][t] = add_block8(acc[i][t], dot4(pairs[i][t], q, xb + t * nb, type), _mm256_castsi256_ps(bi[8]),
                                   _mm256_castsi256_ps(bi[9]), q, xb + t * nb, type);
    }
}

/* Rows [t0, t0 + TM) of x times H unpacked half panels (H = 1 for Q8_0), half i's blocks from
 * buffer + i * 10 * nb and its rows[i] output rows from j0 + 8 i. */
static inline __attribute__((always_inline)) void multiply_unpacked(const __m256i *buffer, const int H, const int type,
                                                                    x_blocks q, int64_t t0, const int TM, int64_t nb,
                                                                    const uint16_t *bias, uint16_t *y, int64_t j0,
                                                                    const int rows[2], int64_t n,
                                                                    prefetch_stream *ahead) {
    __m256 acc[2][GEMM8_TILE];
    for (int i = 0; i < H; ++i)
        for (int t = 0; t < TM; ++t) acc[i][t] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nb; ++kb) {
        prefetch_step(ahead);
        const __m256i *b = buffer + 10 * kb;
        if (type == TYPE_Q8_0)
            tile_block8(b, _mm256_castsi256_ps(b[8]), _mm256_castsi256_ps(b[9]), q, t0 * nb + kb, nb, TM, type, acc[0]);
        else
            tile_block4_unpacked(b, 10 * nb, H, q, t0 * nb + kb, nb, TM, type, acc);
    }
    for (int i = 0; i < H; ++i) store_rows8(acc[i], t0, TM, bias, y, j0 + 8 * i, rows[i], n);
}

/* Rows [t0, m) of x times H unpacked half panels, in tiles of TM rows then one of the rest. */
static inline __attribute__((always_inline)) void multiply_unpacked_rows(const __m256i *buffer, const int H,
                                                                         const int type, x_blocks q, int64_t t0,
                                                                         int64_t m, const int TM, int64_t nb,
                                                                         const uint16_t *bias, uint16_t *y,
                                                                         int64_t j0, const int rows[2], int64_t n,
                                                                         prefetch_stream *ahead) {
    for (; m - t0 >= TM; t0 += TM) multiply_unpacked(buffer, H, type, q, t0, TM, nb, bias, y, j0, rows, n, ahead);
    switch (m - t0) {
    case 1: multiply_unpacked(buffer, H, type, q, t0, 1, nb, bias, y, j0, rows, n, ahead); break;
    case 2: multiply_unpacked(buffer, H, type, q, t0, 2, nb, bias, y, j0, rows, n, ahead); break;
    case 3: multiply_unpacked(buffer, H, type, q, t0, 3, nb, bias, y, j0, rows, n, ahead); break;
    default: break;
    }
}

/* W's rows [first, first + count) as bytes to prefetch: none past W's n rows. */
static inline prefetch_stream rows_ahead(const uint8_t *w, int64_t stride, int64_t first, int64_t count, int64_t n,
                                         int64_t steps) {
    const int64_t rows = first >= n ? 0 : n - first < count ? n - first : count;
    return prefetch_spread(w + (first < n ? first : n) * stride, rows * stride, steps);
}

/* All m rows of x times W's rows [j0, j0 + 16) (fewer at W's end): its halves p[i] (H of them,
 * rows[i] rows each), the bytes of W's next 16 rows (in rows or in their panel) prefetched
 * meanwhile, each half's share by the half that multiplies.
 *   m <= GEMM8_TILE  each block multiplied as it is decoded: both halves at once from a panel
 *                    of 4-bit codes, else half after half
 *   more             the halves unpacked into `buffer` (nb * 20 ymm), then tiles of PAIR_TILE
 *                    rows over both halves of 4-bit codes, or of GEMM8_TILE rows over one half
 *                    at a time (Q8_0, and a lone last half of W's rows)
 * `type` is a constant in each caller. */
static inline __attribute__((always_inline)) void rows16_product(const half_panel_at p[2], const int H,
                                                                 const int type, x_blocks q, int64_t m, int64_t nb,
                                                                 __m256i *buffer, const uint16_t *bias, uint16_t *y,
                                                                 int64_t j0, const int rows[2], int64_t n,
                                                                 const uint8_t *w, int64_t stride) {
    if (m <= GEMM8_TILE && type != TYPE_Q8_0 && H == 2 && p[0].panels) {
        prefetch_stream ahead = rows_ahead(w, stride, j0 + 16, 16, n, nb);
        switch (m) {
        case 1: multiply_panel(p[0].base, type, q, 1, nb, bias, y, j0, n, &ahead); break;
        case 2: multiply_panel(p[0].base, type, q, 2, nb, bias, y, j0, n, &ahead); break;
        case 3: multiply_panel(p[0].base, type, q, 3, nb, bias, y, j0, n, &ahead); break;
        default: multiply_panel(p[0].base, type, q, GEMM8_TILE, nb, bias, y, j0, n, &ahead); break;
        }
        return;
    }
    if (m <= GEMM8_TILE) {
        for (int i = 0; i < H; ++i) {
            prefetch_stream ahead = rows_ahead(w, stride, j0 + 16 + 8 * i, 8, n, nb);
            switch (m) {
            case 1: multiply_half(&p[i], type, q, 0, 1, nb, bias, y, j0 + 8 * i, rows[i], n, &ahead); break;
            case 2: multiply_half(&p[i], type, q, 0, 2, nb, bias, y, j0 + 8 * i, rows[i], n, &ahead); break;
            case 3: multiply_half(&p[i], type, q, 0, 3, nb, bias, y, j0 + 8 * i, rows[i], n, &ahead); break;
            default: multiply_half(&p[i], type, q, 0, GEMM8_TILE, nb, bias, y, j0 + 8 * i, rows[i], n, &ahead); break;
            }
        }
        return;
    }
    if (type != TYPE_Q8_0 && H == 2) {
        prefetch_stream ahead = rows_ahead(w, stride, j0 + 16, 16, n, (m + PAIR_TILE - 1) / PAIR_TILE * nb);
        unpack_half(&p[0], type, nb, buffer);
        unpack_half(&p[1], type, nb, buffer + 10 * nb);
        multiply_unpacked_rows(buffer, 2, type, q, 0, m, PAIR_TILE, nb, bias, y, j0, rows, n, &ahead);
        return;
    }
    for (int i = 0; i < H; ++i) {
        prefetch_stream ahead = rows_ahead(w, stride, j0 + 16 + 8 * i, 8, n, (m + GEMM8_TILE - 1) / GEMM8_TILE * nb);
        unpack_half(&p[i], type, nb, buffer);
        multiply_unpacked_rows(buffer, 1, type, q, 0, m, GEMM8_TILE, nb, bias, y, j0 + 8 * i, &rows[i], n, &ahead);
    }
}

/* y (m, n) bf16 = x @ W^T + bias: x (m, k) bf16, W of `type` in rows or (in_panels) panels,
 * bias (n) bf16 or NULL. 1 where the type or layout does not fit, 2 where memory runs out. */
static int gemm8_int8_bf16(const uint16_t *x, const uint8_t *w, int type, int in_panels, const uint16_t *bias,
                           uint16_t *y, int64_t m, int64_t n, int64_t k) {
    if (!gemm8_type(type) || row_bytes(type, k) == 0 || (in_panels && n % 16)) return 1;
    if (m == 0 || n == 0) return 0;
    const int64_t nb = k / QK, stride = row_bytes(type, k), groups = (n + 15) / 16;
    x_blocks q = {malloc((size_t)(m * k)), malloc((size_t)(m * nb) * sizeof(float)),
                  malloc((size_t)(m * nb) * sizeof(float)), malloc((size_t)(m * nb) * sizeof(int32_t))};
    int status = 0;
    if (q.qx == NULL || q.dx == NULL || q.dxsx == NULL || q.start == NULL) {
        free(q.qx); free(q.dx); free(q.dxsx); free(q.start);
        return 2;
    }
    quantize_x8(x, type, m, k, q);
    #pragma omp parallel
    {
        __m256i *buffer = m > GEMM8_TILE ? aligned_alloc(32, (size_t)nb * 20 * sizeof(__m256i)) : NULL;
        if (m > GEMM8_TILE && buffer == NULL) {
            #pragma omp atomic write
            status = 2;
        }
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            if (m > GEMM8_TILE && buffer == NULL) continue;
            const int64_t j0 = 16 * g;
            const int H = n - j0 > 8 ? 2 : 1;
            half_panel_at p[2];
            int rows[2];
            for (int i = 0; i < H; ++i) {
                const int64_t first = j0 + 8 * i;
                rows[i] = n - first < 8 ? (int)(n - first) : 8;
                p[i] = (half_panel_at){.panels = in_panels, .half = i};
                if (in_panels) {
                    p[i].base = w + j0 * stride;
                } else {
                    p[i].base = w + first * stride;
                    for (int c = 0; c < 8; ++c) p[i].offset[c] = (c < rows[i] ? c : rows[i] - 1) * stride;
                }
            }
            switch (type) {
            case TYPE_Q8_0: rows16_product(p, H, TYPE_Q8_0, q, m, nb, buffer, bias, y, j0, rows, n, w, stride); break;
            case TYPE_Q4_0: rows16_product(p, H, TYPE_Q4_0, q, m, nb, buffer, bias, y, j0, rows, n, w, stride); break;
            default: rows16_product(p, H, TYPE_Q4_1, q, m, nb, buffer, bias, y, j0, rows, n, w, stride); break;
            }
        }
        free(buffer);
    }
    free(q.qx); free(q.dx); free(q.dxsx); free(q.start);
    return status;
}

#endif

#endif  /* VLLM_CPU_GGUF_GEMV_PANELS_AVX2_H */
