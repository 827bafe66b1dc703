/*
 * Does AMX tile work overlap AVX512 vector work on this CPU? Built by
 * benchmark_tile_load_overlap.py (through vllm/platforms/c_build.py, on its include path).
 *
 * One iteration is a block of tile work (8 products, with or without their operand loads) and
 * a block of vector work (loads and FMAs in 8 independent chains), run alone, one after the
 * other, or cut into 8 interleaved pieces. If the two overlapped, "both" would take about the
 * longer of the two alone; if they add up, it takes their sum.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "amx.h"

#ifdef VLLM_HAVE_AMX

static uint16_t a_tile[16][32] __attribute__((aligned(64))), b_tile[16][32] __attribute__((aligned(64)));
static float rows[64][16] __attribute__((aligned(64)));

/* Piece i of the tile work: kind 0 loads both operands and multiplies, 1 only multiplies
 * (operands already in tiles 6 and 7), 2 only loads. Accumulators rotate over tiles 0-3. */
#define TILE_PIECE(kind, acc)                                   \
    do {                                                        \
        if ((kind) != 1) {                                      \
            _tile_loadd(6, a_tile, 64);                         \
            _tile_loadd(7, b_tile, 64);                         \
        }                                                       \
        if ((kind) != 2) _tile_dpbf16ps(acc, 6, 7);             \
    } while (0)

static inline void tile_piece(int kind, int i) {
    switch (i % 4) {
    case 0: TILE_PIECE(kind, 0); break;
    case 1: TILE_PIECE(kind, 1); break;
    case 2: TILE_PIECE(kind, 2); break;
    default: TILE_PIECE(kind, 3); break;
    }
}

/* count rows of vector work: a load and two FMAs each, eight independent chains. */
static inline void vector_piece(__m512 acc[8], int count) {
    for (int j = 0; j < count; ++j) {
        const __m512 x = _mm512_load_ps(rows[j % 64]);
        acc[j % 4] = _mm512_fmadd_ps(acc[j % 4], x, x);
        acc[4 + j % 4] = _mm512_fmadd_ps(acc[4 + j % 4], x, x);
    }
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Nanoseconds per iteration, best of 5; mode 0: tile work alone, 1: vector work alone, 2: the
 * tile work then the vector work, 3: the two cut into 8 pieces and interleaved. -1 without the
 * tile state. */
double overlap_ns(int kind, int mode, int vector_rows, int64_t iterations) {
    if (!amx_request_tiles()) return -1.0;
    amx_configure_full_tiles();
    memset(a_tile, 0, sizeof a_tile);
    memset(b_tile, 0, sizeof b_tile);
    for (int i = 0; i < 64; ++i)
        for (int j = 0; j < 16; ++j) rows[i][j] = 0.5f;
    _tile_loadd(6, a_tile, 64);
    _tile_loadd(7, b_tile, 64);
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_ps(0.1f);
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
        const double start = seconds();
        for (int64_t it = 0; it < iterations; ++it) {
            if (mode == 3) {
                for (int i = 0; i < 8; ++i) {
                    tile_piece(kind, i);
                    vector_piece(acc, vector_rows / 8);
                }
                continue;
            }
            if (mode != 1)
                for (int i = 0; i < 8; ++i) tile_piece(kind, i);
            if (mode != 0) vector_piece(acc, vector_rows);
        }
        const double ns = (seconds() - start) / (double)iterations * 1e9;
        if (ns < best) best = ns;
    }
    float sink[16];
    _mm512_storeu_ps(sink, _mm512_add_ps(acc[0], acc[7]));
    _tile_release();
    return sink[0] == 12345.0f ? -2.0 : best;  /* keeps the vector work alive */
}

#else

double overlap_ns(int kind, int mode, int vector_rows, int64_t iterations) {
    (void)kind; (void)mode; (void)vector_rows; (void)iterations;
    return -1.0;
}

#endif
