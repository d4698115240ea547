// Block manager: see block_manager.h for the contract.
#include "engine/block_manager.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/check.h"

void block_table_init(struct block_table *bt) { memset(bt, 0, sizeof *bt); }

void block_table_free(struct block_table *bt) {
    CHECK(bt->n == 0);
    free(bt->ids);
    memset(bt, 0, sizeof *bt);
}

static void block_table_push(struct block_table *bt, int32_t id) {
    if (bt->n == bt->cap) {
        bt->cap = bt->cap ? bt->cap * 2 : 8;
        bt->ids = xrealloc(bt->ids, (size_t)bt->cap * sizeof *bt->ids);
    }
    bt->ids[bt->n++] = id;
}

uint64_t block_hash_xxh64(const int32_t *tokens, int n, uint64_t parent_hash) {
    return XXH64(tokens, (size_t)n * sizeof *tokens, parent_hash);
}

atomc_status block_manager_create(int num_blocks, int block_size, bool enable_prefix_caching,
                                  struct block_manager **out, struct error *err) {
    *out = NULL;
    if (num_blocks <= 0) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "KV cache has no blocks (%d)", num_blocks);
    if (block_size <= 0 || block_size > 4096)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "block_size must be in [1, 4096], got %d", block_size);
    struct block_manager *bm = calloc(1, sizeof *bm);
    if (!bm) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory allocating the block manager");
    bm->num_blocks = num_blocks;
    bm->block_size = block_size;
    bm->enable_prefix_caching = enable_prefix_caching;
    bm->hash_fn = block_hash_xxh64;
    size_t n_buckets = 16;
    while (n_buckets < (size_t)num_blocks * 2) n_buckets <<= 1;
    bm->bucket_mask = n_buckets - 1;
    bm->blocks = calloc((size_t)num_blocks, sizeof *bm->blocks);
    bm->tokens = malloc((size_t)num_blocks * block_size * sizeof *bm->tokens);
    bm->free_stack = malloc((size_t)num_blocks * sizeof *bm->free_stack);
    bm->buckets = malloc(n_buckets * sizeof *bm->buckets);
    if (!bm->blocks || !bm->tokens || !bm->free_stack || !bm->buckets) {
        block_manager_free(bm);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory allocating %d KV block descriptors", num_blocks);
    }
    for (size_t i = 0; i < n_buckets; i++) bm->buckets[i] = -1;
    // Stack with block 0 on top, so allocation order is 0, 1, 2, ... (easy to read in tests).
    for (int i = 0; i < num_blocks; i++) {
        bm->free_stack[i] = num_blocks - 1 - i;
        struct kv_block *b = &bm->blocks[i];
        b->hash_next = b->lru_prev = b->lru_next = -1;
    }
    bm->n_free_stack = num_blocks;
    bm->lru_head = bm->lru_tail = -1;
    *out = bm;
    return ATOMC_OK;
}

void block_manager_free(struct block_manager *bm) {
    if (!bm) return;
    free(bm->blocks);
    free(bm->tokens);
    free(bm->free_stack);
    free(bm->buckets);
    free(bm);
}

int block_manager_num_free(const struct block_manager *bm) { return bm->n_free_stack + bm->n_lru; }

int block_manager_blocks_for(const struct block_manager *bm, int n_tokens) {
    return (n_tokens + bm->block_size - 1) / bm->block_size;
}

// --- LRU of cached free blocks -------------------------------------------------------------

static void lru_remove(struct block_manager *bm, int32_t id) {
    struct kv_block *b = &bm->blocks[id];
    if (b->lru_prev >= 0) bm->blocks[b->lru_prev].lru_next = b->lru_next;
    else bm->lru_head = b->lru_next;
    if (b->lru_next >= 0) bm->blocks[b->lru_next].lru_prev = b->lru_prev;
    else bm->lru_tail = b->lru_prev;
    b->lru_prev = b->lru_next = -1;
    bm->n_lru--;
}

static void lru_append(struct block_manager *bm, int32_t id) {
    struct kv_block *b = &bm->blocks[id];
    b->lru_prev = bm->lru_tail;
    b->lru_next = -1;
    if (bm->lru_tail >= 0) bm->blocks[bm->lru_tail].lru_next = id;
    else bm->lru_head = id;
    bm->lru_tail = id;
    bm->n_lru++;
}

// --- hash table ------------------------------------------------------------------------------

static int32_t *bucket_of(const struct block_manager *bm, uint64_t h) { return &bm->buckets[h & bm->bucket_mask]; }

static int32_t table_find(const struct block_manager *bm, uint64_t h, uint64_t parent, const int32_t *tokens) {
    size_t bytes = (size_t)bm->block_size * sizeof *tokens;
    for (int32_t id = *bucket_of(bm, h); id >= 0; id = bm->blocks[id].hash_next) {
        const struct kv_block *b = &bm->blocks[id];
        if (b->hash == h && b->parent_hash == parent && !memcmp(bm->tokens + (size_t)id * bm->block_size, tokens, bytes))
            return id;
    }
    return -1;
}

static void table_insert(struct block_manager *bm, int32_t id, uint64_t h, uint64_t parent, const int32_t *tokens) {
    struct kv_block *b = &bm->blocks[id];
    CHECK(!b->cached);
    b->cached = true;
    b->hash = h;
    b->parent_hash = parent;
    memcpy(bm->tokens + (size_t)id * bm->block_size, tokens, (size_t)bm->block_size * sizeof *tokens);
    int32_t *head = bucket_of(bm, h);
    b->hash_next = *head;
    *head = id;
}

static void table_remove(struct block_manager *bm, int32_t id) {
    struct kv_block *b = &bm->blocks[id];
    CHECK(b->cached);
    int32_t *link = bucket_of(bm, b->hash);
    while (*link != id) {
        CHECK(*link >= 0);
        link = &bm->blocks[*link].hash_next;
    }
    *link = b->hash_next;
    b->hash_next = -1;
    b->cached = false;
}

// --- allocation ------------------------------------------------------------------------------

int block_manager_lookup(const struct block_manager *bm, const int32_t *tokens, int n_tokens, int32_t *out,
                         int *n_revived) {
    *n_revived = 0;
    if (!bm->enable_prefix_caching || n_tokens <= 1) return 0;
    int bs = bm->block_size, max_blocks = (n_tokens - 1) / bs, n = 0;
    uint64_t parent = 0;
    for (int i = 0; i < max_blocks; i++) {
        const int32_t *t = tokens + (size_t)i * bs;
        uint64_t h = bm->hash_fn(t, bs, parent);
        int32_t id = table_find(bm, h, parent, t);
        if (id < 0) break;
        out[n++] = id;
        if (bm->blocks[id].ref_count == 0) (*n_revived)++;
        parent = h;
    }
    return n;
}

void block_manager_acquire_prefix(struct block_manager *bm, struct block_table *bt, const int32_t *match, int n,
                                  int n_tokens) {
    CHECK(bt->n == 0);
    for (int i = 0; i < n; i++) {
        struct kv_block *b = &bm->blocks[match[i]];
        CHECK(b->cached);
        if (b->ref_count == 0) lru_remove(bm, match[i]);
        b->ref_count++;
        block_table_push(bt, match[i]);
    }
    bt->n_hashed = n;
    bt->last_hash = n ? bm->blocks[match[n - 1]].hash : 0;
    if (bm->enable_prefix_caching) {
        bm->queries += (uint64_t)n_tokens;
        bm->hits += (uint64_t)n * bm->block_size;
    }
}

int block_manager_lookup_window(const struct block_manager *bm, const int32_t *tokens, int n_blocks, int window,
                                int32_t *out, int *lo_out, int *n_revived, uint64_t *last_hash) {
    *lo_out = 0;
    *n_revived = 0;
    *last_hash = 0;
    if (!bm->enable_prefix_caching || n_blocks <= 0) return 0;
    const int bs = bm->block_size;
    uint64_t parent = 0;
    for (int i = 0; i < n_blocks; i++) { // every block's id here, or -1 (the chain hash needs no block)
        const int32_t *t = tokens + (size_t)i * bs;
        uint64_t h = bm->hash_fn(t, bs, parent);
        out[i] = table_find(bm, h, parent, t);
        parent = h;
    }
    for (int k = n_blocks; k > 0; k--) {
        int first = k * bs - window + 1, lo = first > 0 ? first / bs : 0;
        bool all = true;
        for (int i = lo; i < k && all; i++) all = out[i] >= 0;
        if (!all) continue;
        *lo_out = lo;
        for (int i = lo; i < k; i++) *n_revived += bm->blocks[out[i]].ref_count == 0;
        uint64_t hp = 0;
        for (int i = 0; i < k; i++) hp = bm->hash_fn(tokens + (size_t)i * bs, bs, hp);
        *last_hash = hp;
        return k;
    }
    return 0;
}

void block_manager_acquire_window(struct block_manager *bm, struct block_table *bt, const int32_t *ids, int lo, int k,
                                  uint64_t last_hash) {
    CHECK(bt->n == 0 && lo >= 0 && lo <= k);
    for (int i = 0; i < lo; i++) block_table_push(bt, 0);
    for (int i = lo; i < k; i++) {
        struct kv_block *b = &bm->blocks[ids[i]];
        CHECK(b->cached);
        if (b->ref_count == 0) lru_remove(bm, ids[i]);
        b->ref_count++;
        block_table_push(bt, ids[i]);
    }
    bt->n_dropped = lo;
    bt->n_hashed = k;
    bt->last_hash = k ? last_hash : 0;
}

static int32_t block_take_free(struct block_manager *bm) {
    int32_t id;
    if (bm->n_free_stack > 0) {
        id = bm->free_stack[--bm->n_free_stack];
    } else {
        id = bm->lru_head;
        CHECK(id >= 0);
        lru_remove(bm, id);
        table_remove(bm, id);
        bm->evictions++;
    }
    CHECK(bm->blocks[id].ref_count == 0);
    bm->blocks[id].ref_count = 1;
    return id;
}

bool block_manager_allocate(struct block_manager *bm, struct block_table *bt, int n_tokens) {
    int need = block_manager_blocks_for(bm, n_tokens) - bt->n;
    if (need <= 0) return true;
    if (need > block_manager_num_free(bm)) return false;
    for (int i = 0; i < need; i++) block_table_push(bt, block_take_free(bm));
    return true;
}

void block_manager_commit(struct block_manager *bm, struct block_table *bt, const int32_t *tokens, int n_computed) {
    if (!bm->enable_prefix_caching) return;
    int bs = bm->block_size, n_full = n_computed / bs;
    if (n_full > bt->n) n_full = bt->n;
    for (int i = bt->n_hashed; i < n_full; i++) {
        const int32_t *t = tokens + (size_t)i * bs;
        uint64_t parent = bt->last_hash, h = bm->hash_fn(t, bs, parent);
        int32_t id = bt->ids[i];
        CHECK(!bm->blocks[id].cached && bm->blocks[id].ref_count == 1);
        if (table_find(bm, h, parent, t) < 0) table_insert(bm, id, h, parent, t);
        bt->last_hash = h;
        bt->n_hashed = i + 1;
    }
}

static void block_unref(struct block_manager *bm, int32_t id) {
    struct kv_block *b = &bm->blocks[id];
    CHECK_MSG(b->ref_count > 0, "block %d released with refcount %d", id, b->ref_count);
    if (--b->ref_count == 0) {
        if (b->cached) lru_append(bm, id);
        else bm->free_stack[bm->n_free_stack++] = id;
    }
}

int block_manager_drop_before(struct block_manager *bm, struct block_table *bt, int first_needed) {
    int upto = first_needed > 0 ? first_needed / bm->block_size : 0;
    if (upto > bt->n) upto = bt->n;
    if (bm->enable_prefix_caching && upto > bt->n_hashed) upto = bt->n_hashed;
    int n = 0;
    for (; bt->n_dropped < upto; bt->n_dropped++, n++) block_unref(bm, bt->ids[bt->n_dropped]);
    return n;
}

int block_manager_truncate(struct block_manager *bm, struct block_table *bt, int n_tokens) {
    int keep = block_manager_blocks_for(bm, n_tokens > 0 ? n_tokens : 0);
    if (keep >= bt->n) return 0;
    CHECK_MSG(keep >= bt->n_hashed && keep >= bt->n_dropped,
              "truncating to %d blocks would drop registered or released blocks (%d hashed, %d dropped)", keep,
              bt->n_hashed, bt->n_dropped);
    int n = 0;
    for (; bt->n > keep; n++)
        block_unref(bm, bt->ids[--bt->n]);
    return n;
}

void block_manager_release(struct block_manager *bm, struct block_table *bt) {
    for (int i = bt->n - 1; i >= bt->n_dropped; i--) block_unref(bm, bt->ids[i]);
    bt->n = 0;
    bt->n_hashed = 0;
    bt->last_hash = 0;
    bt->n_dropped = 0;
}

void block_manager_reset_prefix_cache(struct block_manager *bm) {
    while (bm->lru_head >= 0) {
        int32_t id = bm->lru_head;
        lru_remove(bm, id);
        table_remove(bm, id);
        bm->free_stack[bm->n_free_stack++] = id;
    }
}

bool block_manager_check(const struct block_manager *bm, struct error *err) {
    int n_zero = 0, n_cached_free = 0, n_cached = 0;
    for (int i = 0; i < bm->num_blocks; i++) {
        const struct kv_block *b = &bm->blocks[i];
        if (b->ref_count < 0) return error_set(err, ATOMC_ERR_INTERNAL, "block %d refcount %d", i, b->ref_count), false;
        if (b->ref_count == 0) n_zero++;
        if (b->cached) n_cached++;
        if (b->ref_count == 0 && b->cached) n_cached_free++;
        if (b->cached && table_find(bm, b->hash, b->parent_hash, bm->tokens + (size_t)i * bm->block_size) < 0)
            return error_set(err, ATOMC_ERR_INTERNAL, "cached block %d not findable", i), false;
    }
    if (n_zero != bm->n_free_stack + bm->n_lru)
        return error_set(err, ATOMC_ERR_INTERNAL, "%d blocks with refcount 0 but %d on the stack + %d in the LRU", n_zero,
                         bm->n_free_stack, bm->n_lru),
               false;
    if (n_cached_free != bm->n_lru)
        return error_set(err, ATOMC_ERR_INTERNAL, "%d cached free blocks, LRU holds %d", n_cached_free, bm->n_lru), false;
    int walked = 0;
    for (int32_t id = bm->lru_head, prev = -1; id >= 0; prev = id, id = bm->blocks[id].lru_next) {
        const struct kv_block *b = &bm->blocks[id];
        if (b->ref_count != 0 || !b->cached || b->lru_prev != prev)
            return error_set(err, ATOMC_ERR_INTERNAL, "LRU entry %d inconsistent", id), false;
        if (++walked > bm->n_lru) return error_set(err, ATOMC_ERR_INTERNAL, "LRU list longer than its count"), false;
    }
    if (walked != bm->n_lru) return error_set(err, ATOMC_ERR_INTERNAL, "LRU list shorter than its count"), false;
    for (int i = 0; i < bm->n_free_stack; i++) {
        const struct kv_block *b = &bm->blocks[bm->free_stack[i]];
        if (b->ref_count != 0 || b->cached)
            return error_set(err, ATOMC_ERR_INTERNAL, "free-stack block %d in use or cached", bm->free_stack[i]), false;
    }
    int in_table = 0;
    for (uint64_t k = 0; k <= bm->bucket_mask; k++)
        for (int32_t id = bm->buckets[k]; id >= 0; id = bm->blocks[id].hash_next) in_table++;
    if (in_table != n_cached)
        return error_set(err, ATOMC_ERR_INTERNAL, "hash table holds %d blocks, %d marked cached", in_table, n_cached),
               false;
    return true;
}
