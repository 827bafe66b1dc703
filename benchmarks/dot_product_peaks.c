/*
 * How many multiply-adds a second this machine's cores issue with the instructions the kernels'
 * inner loops are built on. Built by roofline.py (measure_dot_product_peaks).
 *
 * Every OpenMP thread runs 24 independent chains of one instruction on registers (14 in ymm
 * registers, of which AVX2 has 16), nothing else,
 * so the rate is the instruction's throughput on all cores at once, not its latency:
 *
 *   kind 0  vfmadd231ps  zmm   16 float32 multiply-adds      (AVX-512F)
 *                        ymm    8                            (AVX2 with FMA, without AVX-512F)
 *   kind 1  vdpbf16ps    zmm   32 bf16 pair products         (AVX512-BF16)
 *   kind 2  vpdpbusd     zmm   64 u8 x s8 products           (AVX512-VNNI)
 *           vpmaddubsw   ymm   32 u8 x s8 products           (AVX2 without AVX512-VNNI: its
 *                              int8 kernels' products, summed into int16 pairs)
 *
 * A kind the build's CPU lacks returns 0.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */

#include <stdint.h>
#include <time.h>

#include <omp.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 24 chains, zmm0-zmm23, each `OP zmm31, zmm30, zmmN` (zmmN += zmm30 . zmm31), in a loop of
 * `iterations` passes. Written in assembly: compiled from intrinsics, chains that read and write
 * the same register have come out with register moves and stack spills in the loop, which then
 * bound the rate instead of the instruction. The operands are zero, so no float input is
 * denormal. */
#define CHAIN(OP, N) OP " %%zmm31, %%zmm30, %%zmm" #N "\n\t"
#define CHAINS(OP)                                                                                 \
    CHAIN(OP, 0) CHAIN(OP, 1) CHAIN(OP, 2) CHAIN(OP, 3) CHAIN(OP, 4) CHAIN(OP, 5) CHAIN(OP, 6)     \
    CHAIN(OP, 7) CHAIN(OP, 8) CHAIN(OP, 9) CHAIN(OP, 10) CHAIN(OP, 11) CHAIN(OP, 12) CHAIN(OP, 13) \
    CHAIN(OP, 14) CHAIN(OP, 15) CHAIN(OP, 16) CHAIN(OP, 17) CHAIN(OP, 18) CHAIN(OP, 19)           \
    CHAIN(OP, 20) CHAIN(OP, 21) CHAIN(OP, 22) CHAIN(OP, 23)
#define ZERO(N) "vpxord %%zmm" #N ", %%zmm" #N ", %%zmm" #N "\n\t"
#define RUN_CHAINS(OP, iterations)                                                                 \
    __asm__ volatile(                                                                              \
        ZERO(30) ZERO(31) ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7) ZERO(8)  \
        ZERO(9) ZERO(10) ZERO(11) ZERO(12) ZERO(13) ZERO(14) ZERO(15) ZERO(16) ZERO(17) ZERO(18)   \
        ZERO(19) ZERO(20) ZERO(21) ZERO(22) ZERO(23)                                               \
        "1:\n\t" CHAINS(OP) "dec %0\n\t"                                                           \
        "jnz 1b\n\t"                                                                               \
        : "+r"(iterations)                                                                         \
        :                                                                                          \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19",         \
          "xmm20", "xmm21", "xmm22", "xmm23", "xmm30", "xmm31", "cc")
#define CHAIN_COUNT 24

/* The same with ymm registers for AVX2 (16 of them): 14 chains, ymm0-ymm13, on ymm15 and ymm14. */
#define CHAIN_Y(OP, N) OP " %%ymm15, %%ymm14, %%ymm" #N "\n\t"
#define CHAINS_Y(OP)                                                                                 \
    CHAIN_Y(OP, 0) CHAIN_Y(OP, 1) CHAIN_Y(OP, 2) CHAIN_Y(OP, 3) CHAIN_Y(OP, 4) CHAIN_Y(OP, 5)         \
    CHAIN_Y(OP, 6) CHAIN_Y(OP, 7) CHAIN_Y(OP, 8) CHAIN_Y(OP, 9) CHAIN_Y(OP, 10) CHAIN_Y(OP, 11)       \
    CHAIN_Y(OP, 12) CHAIN_Y(OP, 13)
#define ZERO_Y(N) "vpxor %%ymm" #N ", %%ymm" #N ", %%ymm" #N "\n\t"
#define RUN_CHAINS_Y(OP, iterations)                                                               \
    __asm__ volatile(                                                                              \
        ZERO_Y(14) ZERO_Y(15) ZERO_Y(0) ZERO_Y(1) ZERO_Y(2) ZERO_Y(3) ZERO_Y(4) ZERO_Y(5) ZERO_Y(6) \
        ZERO_Y(7) ZERO_Y(8) ZERO_Y(9) ZERO_Y(10) ZERO_Y(11) ZERO_Y(12) ZERO_Y(13)                   \
        "1:\n\t" CHAINS_Y(OP) "dec %0\n\t"                                                        \
        "jnz 1b\n\t"                                                                               \
        : "+r"(iterations)                                                                         \
        :                                                                                          \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc")
#define CHAIN_COUNT_Y 14

#ifdef __AVX512F__
static void run_fma(int64_t iterations) { RUN_CHAINS("vfmadd231ps", iterations); }
#elif defined(__AVX2__) && defined(__FMA__)
static void run_fma_y(int64_t iterations) { RUN_CHAINS_Y("vfmadd231ps", iterations); }
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static void run_bf16(int64_t iterations) { RUN_CHAINS("vdpbf16ps", iterations); }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static void run_int8(int64_t iterations) { RUN_CHAINS("vpdpbusd", iterations); }
#elif defined(__AVX2__)
static void run_int8_y(int64_t iterations) { RUN_CHAINS_Y("vpmaddubsw", iterations); }
#endif

/* Multiply-adds per second of `kind` on all OpenMP threads, each issuing 24 (ymm: 14) x
 * `iterations` instructions; 0 where the build's CPU lacks the instruction or the kind is unknown. */
double peak_macs_per_s(int kind, int64_t iterations) {
    void (*run)(int64_t) = 0;
    int64_t macs = 0, chains = CHAIN_COUNT;
    switch (kind) {
#ifdef __AVX512F__
    case 0: run = run_fma, macs = 16; break;
#elif defined(__AVX2__) && defined(__FMA__)
    case 0: run = run_fma_y, macs = 8, chains = CHAIN_COUNT_Y; break;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    case 1: run = run_bf16, macs = 32; break;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case 2: run = run_int8, macs = 64; break;
#elif defined(__AVX2__)
    case 2: run = run_int8_y, macs = 32, chains = CHAIN_COUNT_Y; break;
#endif
    default: break;
    }
    if (run == 0) return 0.0;
    int threads = 1;
#pragma omp parallel
    run(1);  /* the OpenMP threads started and the code paged in before the clock starts */
    const double start = seconds();
#pragma omp parallel
    {
#pragma omp single
        threads = omp_get_num_threads();
        run(iterations);
    }
    return (double)threads * (double)chains * (double)iterations * (double)macs / (seconds() - start);
}
