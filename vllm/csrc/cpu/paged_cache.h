/* Addressing the paged KV cache, for the C kernels beside it. A sequence's key t lives in block
 * table[t / block_size], row t % block_size. */
#ifndef VLLM_PAGED_CACHE_H
#define VLLM_PAGED_CACHE_H

#include <stdint.h>

/* The cache slot (block * block_size + row) of a sequence's key `key`. */
static inline int64_t slot_of(const int64_t *table, int64_t key, int64_t block_size) {
    return table[key / block_size] * block_size + key % block_size;
}

#endif
