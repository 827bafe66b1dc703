/*
 * How many multiply-adds a second this machine's cores issue with the instructions the kernels'
 * inner loops are built on. Built by roofline.py (measure_dot_product_peaks).
 *
 * Every OpenMP thread runs 16 independent chains of one instruction on registers, nothing else,
 * so the rate is the instruction's throughput on all cores at once, not its latency:
 *
 *   kind 0  vfmadd231ps  zmm   16 float32 multiply-adds      (AVX-512F)
 *   kind 1  vdpbf16ps    zmm   32 bf16 pair products         (AVX512-BF16)
 *   kind 2  vpdpbusd     zmm   64 u8 x s8 products           (AVX512-VNNI)
 *
 * A kind the build's CPU lacks returns 0.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */

#include <stdint.h>
#include <time.h>

#include <immintrin.h>
#include <omp.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The 16 chains as named variables: an array of them is kept in memory by some compilers. */
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

/* Sums the chains into one lane and writes it where the compiler cannot drop the loop. */
static volatile float sink_float;
static volatile int32_t sink_int;

#ifdef __AVX512F__
static void run_fma(int64_t iterations) {
    const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
#define INIT(i) __m512 c##i = _mm512_set1_ps((float)(i));
    CHAINS(INIT)
#undef INIT
    for (int64_t it = 0; it < iterations; ++it) {
#define STEP(i) c##i = _mm512_fmadd_ps(c##i, a, b);
        CHAINS(STEP)
#undef STEP
    }
    __m512 sum = _mm512_setzero_ps();
#define ADD(i) sum = _mm512_add_ps(sum, c##i);
    CHAINS(ADD)
#undef ADD
    sink_float = _mm512_reduce_add_ps(sum);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static void run_bf16(int64_t iterations) {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80); /* 1.0 */
#define INIT(i) __m512 c##i = _mm512_set1_ps((float)(i));
    CHAINS(INIT)
#undef INIT
    for (int64_t it = 0; it < iterations; ++it) {
#define STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, a);
        CHAINS(STEP)
#undef STEP
    }
    __m512 sum = _mm512_setzero_ps();
#define ADD(i) sum = _mm512_add_ps(sum, c##i);
    CHAINS(ADD)
#undef ADD
    sink_float = _mm512_reduce_add_ps(sum);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static void run_int8(int64_t iterations) {
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
#define INIT(i) __m512i c##i = _mm512_set1_epi32(i);
    CHAINS(INIT)
#undef INIT
    for (int64_t it = 0; it < iterations; ++it) {
#define STEP(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
        CHAINS(STEP)
#undef STEP
    }
    __m512i sum = _mm512_setzero_si512();
#define ADD(i) sum = _mm512_add_epi32(sum, c##i);
    CHAINS(ADD)
#undef ADD
    sink_int = _mm512_reduce_add_epi32(sum);
}
#endif

/* Multiply-adds per second of `kind` on all OpenMP threads, each issuing 16 x `iterations`
 * instructions; 0 where the build's CPU lacks the instruction or the kind is unknown. */
double peak_macs_per_s(int kind, int64_t iterations) {
    void (*run)(int64_t) = 0;
    int64_t macs = 0;
    switch (kind) {
#ifdef __AVX512F__
    case 0: run = run_fma, macs = 16; break;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    case 1: run = run_bf16, macs = 32; break;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case 2: run = run_int8, macs = 64; break;
#endif
    default: break;
    }
    if (run == 0) return 0.0;
    int threads = 1;
    const double start = seconds();
#pragma omp parallel
    {
#pragma omp single
        threads = omp_get_num_threads();
        run(iterations);
    }
    return (double)threads * 16.0 * (double)iterations * (double)macs / (seconds() - start);
}
