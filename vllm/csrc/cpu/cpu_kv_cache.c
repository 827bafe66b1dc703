/*
 * A step's keys and values into their slots of the paged cache: one row (num_kv_heads x
 * head_dim elements) per token, copied as it lies (any dtype), rows split over the threads.
 *
 * torch's index_copy_ does the same from the strided key and value views inside the step's
 * qkv rows in two calls a layer, each walking its view element-stride by element-stride. Here
 * each token's key and value rows go out as two contiguous copies of row_bytes, so the write
 * is bound by the cache lines' trip to and from memory rather than by the indexing.
 *
 * Layouts: key/value rows key_stride/value_stride bytes apart; caches (num_slots, row) contiguous.
 */
#include <stdint.h>
#include <string.h>

/* Returns 1, writing nothing, if a slot lies outside [0, num_slots). */
int write_kv_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                  const int64_t *slots, int64_t num_tokens, int64_t row_bytes, char *key_cache,
                  char *value_cache, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    #pragma omp parallel for schedule(static) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
