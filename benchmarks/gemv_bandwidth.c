/*
 * The GEMV's weight streaming against a plain read of the same bytes. Built by
 * benchmark_gemv.py (through vllm/platforms/c_build.py).
 *
 * Both walk the same list of weight matrices in order, as a decode step walks a model's layers:
 * the GEMV through its function pointer, the read with as many OpenMP threads, each summing the
 * 64-byte lines of its own contiguous share of each matrix's rows in eight independent chains,
 * which is as fast as a core pulls memory without doing anything with it; optionally with the
 * lines PREFETCH_BYTES ahead prefetched into L2, as the GEMV does (a core keeps more lines in
 * flight that way).
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */

#include <stdint.h>
#include <time.h>

#include <immintrin.h>
#include <omp.h>

#define PREFETCH_BYTES (8 * 1024)

/* A GEMV of the engine's calling convention (vllm/model_executor/layers/cpu_product.py), its
 * pointers in the kernel's element type: bf16 or float32. */
typedef int (*gemv_fn)(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k);

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Sums bytes [begin, end) of `p` as 64-bit integers (end - begin a multiple of 512), in vectors
 * of 512 bits where AVX-512 is built, else of 256 (AVX2). */
#ifdef __AVX512F__
#define VEC __m512i
#define VEC_BYTES 64
#define VEC_ZERO _mm512_setzero_si512
#define VEC_LOAD _mm512_loadu_si512
#define VEC_ADD _mm512_add_epi64
static int64_t vec_sum(VEC v) { return _mm512_reduce_add_epi64(v); }
#else
#define VEC __m256i
#define VEC_BYTES 32
#define VEC_ZERO _mm256_setzero_si256
#define VEC_LOAD(at) _mm256_loadu_si256((const __m256i *)(at))
#define VEC_ADD _mm256_add_epi64
static int64_t vec_sum(VEC v) {
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, v);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

static int64_t read_range(const char *p, int64_t begin, int64_t end, int prefetch) {
    VEC acc[8];
    for (int a = 0; a < 8; ++a) acc[a] = VEC_ZERO();
    for (int64_t i = begin; i < end; i += 512)
        for (int a = 0; a < 8; ++a) {
            if (prefetch && i + PREFETCH_BYTES < end) _mm_prefetch(p + i + PREFETCH_BYTES + 64 * a, _MM_HINT_T1);
            for (int v = 0; v < 64 / VEC_BYTES; ++v)
                acc[a] = VEC_ADD(acc[a], VEC_LOAD((const void *)(p + i + 64 * a + VEC_BYTES * v)));
        }
    for (int a = 1; a < 8; ++a) acc[0] = VEC_ADD(acc[0], acc[a]);
    return vec_sum(acc[0]);
}

/* Seconds to read `count` matrices (weights[i]: rows[i] rows of cols[i] bf16) once. */
double read_seconds(const uint16_t *const *weights, const int64_t *rows, const int64_t *cols,
                    int64_t count, int prefetch, int64_t *checksum) {
    int64_t sum = 0;
    const double start = seconds();
    for (int64_t i = 0; i < count; ++i) {
        const char *p = (const char *)weights[i];
        const int64_t lines = rows[i] * cols[i] * 2 / 512;
        #pragma omp parallel reduction(+ : sum)
        {
            const int threads = omp_get_num_threads(), t = omp_get_thread_num();
            sum += read_range(p, lines * t / threads * 512, lines * (t + 1) / threads * 512, prefetch);
        }
    }
    const double elapsed = seconds() - start;
    *checksum = sum;
    return elapsed;
}

/* Seconds for y = x @ W^T on each of the `count` matrices in turn (x: m rows). */
double gemv_seconds(gemv_fn gemv, const void *x, void *y, const void *const *weights,
                    const int64_t *rows, const int64_t *cols, int64_t count, int64_t m) {
    const double start = seconds();
    for (int64_t i = 0; i < count; ++i)
        if (gemv(x, weights[i], NULL, y, m, rows[i], cols[i]) != 0) return -1.0;
    return seconds() - start;
}
