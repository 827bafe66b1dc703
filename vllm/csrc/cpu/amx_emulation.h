/* The AMX tile instructions the kernels use, in C over per-thread arrays: a test double that
 * runs the kernels' AMX copies on a CPU without AMX (included by amx.h under VLLM_EMULATE_AMX).
 *
 * Each instruction follows the Intel SDM's definition for palette 1: eight tiles of up to 16 rows
 * of 64 bytes, shaped by the last ldtilecfg. A load fills the configured rows and columns and
 * zeroes the rest of the tile; TDPBF16PS accumulates bf16 pair products in float32 with denormal
 * inputs and outputs flushed to zero. Where the hardware raises #UD (a tile used before any
 * configuration, a bad configuration, operand shapes that do not agree), the emulation prints
 * what was wrong and aborts the process.
 */
#ifndef VLLM_AMX_EMULATION_H
#define VLLM_AMX_EMULATION_H

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { AMX_TILES = 8, AMX_ROWS = 16, AMX_COLSB = 64 };

struct amx_state {
    struct tile_config cfg;  /* palette 0: not configured */
    uint8_t tile[AMX_TILES][AMX_ROWS][AMX_COLSB];
};

static _Thread_local struct amx_state amx_thread;

static void amx_fault(const char *instruction, int t, const char *why) {
    fprintf(stderr, "emulated AMX: %s on tile %d: %s (#UD on the hardware)\n", instruction, t, why);
    abort();
}

/* The tile an instruction names, checked as the hardware checks it. */
static uint8_t (*amx_tile(const char *instruction, int t))[AMX_COLSB] {
    if (amx_thread.cfg.palette == 0) amx_fault(instruction, t, "the tiles are not configured");
    if (t < 0 || t >= AMX_TILES) amx_fault(instruction, t, "no such tile in palette 1");
    if (amx_thread.cfg.rows[t] == 0 || amx_thread.cfg.colsb[t] == 0)
        amx_fault(instruction, t, "the tile is configured empty");
    return amx_thread.tile[t];
}

static inline void amx_load_config(const struct tile_config *cfg) {
    if (cfg->palette != 1) amx_fault("ldtilecfg", -1, "only palette 1 exists");
    for (int t = 0; t < 16; ++t) {
        const int unused = t >= AMX_TILES;
        if (cfg->rows[t] > AMX_ROWS || cfg->colsb[t] > AMX_COLSB || (unused && (cfg->rows[t] || cfg->colsb[t])) ||
            (cfg->rows[t] == 0) != (cfg->colsb[t] == 0))
            amx_fault("ldtilecfg", t, "rows or bytes per row out of range");
    }
    amx_thread.cfg = *cfg;
    memset(amx_thread.tile, 0, sizeof amx_thread.tile);
}

static inline int amx_request_tiles(void) { return 1; }

static inline void amx_emulated_load(int t, const void *base, int64_t stride) {
    uint8_t (*tile)[AMX_COLSB] = amx_tile("tileloadd", t);
    const int rows = amx_thread.cfg.rows[t], colsb = amx_thread.cfg.colsb[t];
    memset(tile, 0, AMX_ROWS * AMX_COLSB);
    for (int r = 0; r < rows; ++r) memcpy(tile[r], (const uint8_t *)base + r * stride, (size_t)colsb);
}

static inline void amx_emulated_store(int t, void *base, int64_t stride) {
    uint8_t (*tile)[AMX_COLSB] = amx_tile("tilestored", t);
    const int rows = amx_thread.cfg.rows[t], colsb = amx_thread.cfg.colsb[t];
    for (int r = 0; r < rows; ++r) memcpy((uint8_t *)base + r * stride, tile[r], (size_t)colsb);
}

static inline void amx_emulated_zero(int t) { memset(amx_tile("tilezero", t), 0, AMX_ROWS * AMX_COLSB); }

static inline float amx_flush_denormal(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float amx_bf16_in(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return amx_flush_denormal(v);
}

/* dst (M x N float32) += a (M x K bf16 pairs) . b (K x N bf16 pairs). */
static inline void amx_emulated_dpbf16ps(int d, int a, int b) {
    float(*dst)[AMX_COLSB / 4] = (float(*)[AMX_COLSB / 4])amx_tile("tdpbf16ps", d);
    const uint8_t(*x)[AMX_COLSB] = amx_tile("tdpbf16ps", a);
    const uint8_t(*w)[AMX_COLSB] = amx_tile("tdpbf16ps", b);
    const struct tile_config *cfg = &amx_thread.cfg;
    const int m_rows = cfg->rows[d], n = cfg->colsb[d] / 4, k = cfg->colsb[a] / 4;
    if (cfg->rows[a] != m_rows)
        amx_fault("tdpbf16ps", a, "the first source's rows differ from the destination's");
    if (cfg->colsb[b] != cfg->colsb[d])
        amx_fault("tdpbf16ps", b, "the second source's row bytes differ from the destination's");
    if (cfg->rows[b] != k)
        amx_fault("tdpbf16ps", b, "the second source's rows differ from the first's pairs per row");
    if (cfg->colsb[d] % 4 || cfg->colsb[a] % 4) amx_fault("tdpbf16ps", d, "row bytes not a multiple of 4");
    for (int m = 0; m < m_rows; ++m)
        for (int p = 0; p < k; ++p)
            for (int j = 0; j < n; ++j) {
                float acc = dst[m][j];
                acc += amx_bf16_in(x[m] + 4 * p) * amx_bf16_in(w[p] + 4 * j);
                acc += amx_bf16_in(x[m] + 4 * p + 2) * amx_bf16_in(w[p] + 4 * j + 2);
                dst[m][j] = amx_flush_denormal(acc);
            }
}

static inline void amx_emulated_release(void) { memset(&amx_thread.cfg, 0, sizeof amx_thread.cfg); }

#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_loadd(t, base, stride) amx_emulated_load((t), (base), (int64_t)(stride))
#define _tile_stream_loadd(t, base, stride) amx_emulated_load((t), (base), (int64_t)(stride))
#define _tile_stored(t, base, stride) amx_emulated_store((t), (base), (int64_t)(stride))
#define _tile_zero(t) amx_emulated_zero(t)
#define _tile_dpbf16ps(d, a, b) amx_emulated_dpbf16ps((d), (a), (b))
#define _tile_release() amx_emulated_release()

#endif
