/*
 * Software prefetches spread over a loop's work, for the GEMMs that read their next weights
 * while they multiply the current ones.
 *
 * A stream covers one contiguous range; the loop calls prefetch_step once in each of its `steps`
 * steps, and the range's lines go out evenly over them (then prefetch_rest, for a loop that took
 * fewer steps). Issued together instead, the prefetches would take all of the core's misses in
 * flight and stall the loads beside them until they arrive, while the memory idled through the
 * rest of the loop.
 */
#ifndef VLLM_CPU_PREFETCH_H
#define VLLM_CPU_PREFETCH_H

#include <stdint.h>
#include <xmmintrin.h>

typedef struct {
    const uint8_t *next;
    int64_t lines, line;          /* line: the first not yet issued */
    int64_t steps, per_step, rest, error;  /* lines = per_step * steps + rest, the rest spread */
} prefetch_stream;

/* `bytes` from `next` over `steps` steps (none: bytes 0). */
static inline prefetch_stream prefetch_spread(const void *next, int64_t bytes, int64_t steps) {
    const int64_t lines = (bytes + 63) / 64;
    steps = steps > 0 ? steps : 1;
    return (prefetch_stream){(const uint8_t *)next, lines, 0, steps, lines / steps, lines % steps, 0};
}

static inline void prefetch_line(prefetch_stream *s) {
    _mm_prefetch((const char *)(s->next + 64 * s->line), _MM_HINT_T1);  /* into L2 */
    ++s->line;
}

/* One step's share of the lines: per_step, and one more in `rest` of the steps. */
static inline void prefetch_step(prefetch_stream *s) {
    int64_t count = s->per_step;
    s->error += s->rest;
    if (s->error >= s->steps) {
        s->error -= s->steps;
        ++count;
    }
    for (; count > 0 && s->line < s->lines; --count) prefetch_line(s);
}

/* The lines not yet issued. */
static inline void prefetch_rest(prefetch_stream *s) {
    while (s->line < s->lines) prefetch_line(s);
}

#endif  /* VLLM_CPU_PREFETCH_H */
