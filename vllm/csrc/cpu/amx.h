/* AMX tile set-up shared by the C kernels beside it.
 *
 * Built with -DVLLM_EMULATE_AMX (VLLM_C_EMULATE=amx, vllm/platforms/c_build.py), the tile
 * instructions the kernels use are C functions over per-thread arrays (amx_emulation.h), so the
 * AMX copies of the kernels run, slowly, on any x86 CPU with AVX512-BF16: a test double for CPUs
 * without AMX. */
#ifndef VLLM_AMX_H
#define VLLM_AMX_H

#include <stdint.h>

/* The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each tile. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#if defined(VLLM_EMULATE_AMX) && defined(__AVX512BF16__) && defined(__AVX512BW__)  /* as AMX CPUs have */
#define VLLM_HAVE_AMX 1
#include "amx_emulation.h"

#elif defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define VLLM_HAVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>

/* unistd.h declares syscall only under _DEFAULT_SOURCE, which -std=c11 leaves off. */
extern long syscall(long number, ...);

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Loads a tile configuration. GCC 12's _tile_loadconfig tells the compiler that it reads 8 of
 * the 64 bytes, so the stores of the rows and columns before it may be dropped as dead: with
 * amx_configure_full_tiles inlined at -O3, ldtilecfg then gets palette 1 and zeros, and the
 * first tile load faults. This asm names the whole struct as its operand. */
static inline void amx_load_config(const struct tile_config *cfg) {
    __asm__ volatile("ldtilecfg %0" ::"m"(*cfg));
}

/* Asks Linux for this process's tile state (oneDNN may have done so already); 1 if granted. */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

#ifdef VLLM_HAVE_AMX
/* All eight tiles 16 rows of 64 bytes (16 float32, 32 bf16 or 16 bf16 pairs), for this thread. */
static inline void amx_configure_full_tiles(void) {
    struct tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    amx_load_config(&cfg);
}

/* GCC's _tile_loadd is an asm statement without a "memory" clobber: stores to a buffer the
 * kernel then loads into a tile may be sunk past the load, or dropped as dead. Call this between
 * writing such a buffer and loading it. */
static inline void amx_publish_stores(void) { __asm__ volatile("" ::: "memory"); }
#endif

#endif
