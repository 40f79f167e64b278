/* The paged KV cache's layout, shared by the attention kernels: a layer's K (or V) cache is
 * [blocks, bs, hkv, head_dim], and a sequence's token t lives in block table[t / bs] at offset t % bs. */
#ifndef PPSERVE_PAGED_CACHE_H
#define PPSERVE_PAGED_CACHE_H
#include <stdint.h>

/* Token t's row of KV head h, through the sequence's block table. */
static inline const uint16_t *cache_row(const uint16_t *cache, const int64_t *table, int64_t t, int64_t bs,
                                        int64_t hkv, int64_t h, int64_t head_dim) {
    return cache + ((table[t / bs] * bs + t % bs) * hkv + h) * head_dim;
}
#endif
