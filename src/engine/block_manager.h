// Paged KV-cache block manager with prefix caching.
//
// The KV pool is `num_blocks` fixed-size blocks of `block_size` token slots. A sequence owns
// a block table (its blocks in order); slot of position p = table[p / bs] * bs + p % bs.
//
// Prefix caching (on by default): once a FULL block's KV is computed (or scheduled to be
// computed in the current step), it is registered under a chained hash h_i = XXH64(tokens of block i, seed = h_{i-1}) (h_{-1} = 0), so a hash
// identifies the whole prefix up to and including block i. A lookup walks a new sequence's
// full blocks through the table; a candidate block matches only if its hash, its parent hash
// and its token ids are all equal (the token comparison guards against hash collisions).
// Matched blocks are shared (refcount + 1) and never written again: the last, partial block
// of a sequence is never shared, and a lookup never covers a prompt's last token, so a
// fully cached prompt still recomputes at least one token (its logits are needed).
//
// Same-step sharing: the scheduler registers the blocks a step will fill when it schedules
// them, so a sequence admitted later in the same step can share them. This is safe because every
// backend writes the K/V of the whole batch before attention, layer by layer; the sharer's rows
// only read those blocks. If the forward pass fails, the engine drops the cached free blocks.
//
// Free blocks come in two kinds: never-registered blocks (a stack, reused first) and
// cached-but-free blocks (refcount 0 but still findable by hash), kept in an LRU list and
// evicted least-recently-freed first when the stack is empty. A sequence's blocks are freed
// tail first, so its deepest (least shareable) blocks are evicted before its prefix.
//
// Single-threaded: the engine loop owns it.
#ifndef ATOMC_ENGINE_BLOCK_MANAGER_H
#define ATOMC_ENGINE_BLOCK_MANAGER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/error.h"

// A sequence's blocks. Owned by the sequence; filled by the block manager.
struct block_table {
    int32_t *ids;       // (n) block ids, position order
    int n, cap;
    int n_hashed;       // leading blocks registered in (or matched from) the prefix cache
    uint64_t last_hash; // chain hash of block n_hashed-1 (0 when n_hashed == 0)
    int n_dropped;      // leading blocks released while the sequence runs (sliding window): their
                        // ids stay (attention never reads them unmasked) but hold no reference
};

void block_table_init(struct block_table *bt);
void block_table_free(struct block_table *bt); // the blocks must have been released

// Hash of one full block chained on the previous block's hash. Replaceable (tests force
// collisions with a degenerate one).
typedef uint64_t (*block_hash_fn)(const int32_t *tokens, int n, uint64_t parent_hash);
uint64_t block_hash_xxh64(const int32_t *tokens, int n, uint64_t parent_hash);

struct kv_block {
    int32_t ref_count;
    bool cached;          // registered in the hash table
    uint64_t hash;        // chained hash (valid if cached)
    uint64_t parent_hash; // hash of the previous block of the prefix (valid if cached)
    int32_t hash_next;    // next block in the same hash bucket, -1 ends
    int32_t lru_prev, lru_next; // LRU links while cached and ref_count == 0, else -1
};

struct block_manager {
    int num_blocks;
    int block_size;
    bool enable_prefix_caching;
    block_hash_fn hash_fn;

    struct kv_block *blocks; // (num_blocks)
    int32_t *tokens;         // (num_blocks, block_size) token ids of cached blocks
    int32_t *free_stack;     // (num_blocks) never-cached free blocks; top at n_free_stack-1
    int n_free_stack;
    int32_t lru_head, lru_tail; // cached free blocks: head = evicted next
    int n_lru;
    int32_t *buckets;        // (n_buckets) hash table heads, -1 = empty
    uint64_t bucket_mask;

    // Statistics, in tokens (as vLLM's prefix_cache_queries / _hits counters).
    uint64_t queries, hits;
    uint64_t evictions;
};

atomc_status block_manager_create(int num_blocks, int block_size, bool enable_prefix_caching,
                                  struct block_manager **out, struct error *err);
void block_manager_free(struct block_manager *bm);

// Blocks with refcount 0 (never-cached plus cached-but-free): what can be allocated now.
int block_manager_num_free(const struct block_manager *bm);
int block_manager_blocks_for(const struct block_manager *bm, int n_tokens); // ceil(n / bs)

// Looks up the longest cached prefix of tokens[0..n_tokens) made of full blocks, never
// covering the last token. Writes the matched block ids to out (room for n_tokens / bs) and
// returns how many matched; *n_revived receives how many of them are currently free (their
// reuse takes them out of the free pool). No state changes, no statistics.
int block_manager_lookup(const struct block_manager *bm, const int32_t *tokens, int n_tokens, int32_t *out,
                         int *n_revived);

// Takes a reference on n matched blocks (from block_manager_lookup, same tokens, nothing
// changed since) and appends them to the empty table bt. Counts n_tokens queries and
// n * block_size hits in the statistics.
void block_manager_acquire_prefix(struct block_manager *bm, struct block_table *bt, const int32_t *match, int n,
                                  int n_tokens);

// Grows bt to hold n_tokens slots with fresh blocks. All or nothing: returns false (and
// changes nothing) if the free pool is too small.
bool block_manager_allocate(struct block_manager *bm, struct block_table *bt, int n_tokens);

// Registers bt's blocks that are full once the first n_computed tokens of `tokens` are in the
// cache (computed, or being computed in the current step) in the prefix cache. If an identical block is already cached,
// this one stays private (it is simply not registered).
void block_manager_commit(struct block_manager *bm, struct block_table *bt, const int32_t *tokens, int n_computed);

// Sliding-window models: releases bt's leading blocks whose slots all lie before token
// `first_needed` (nothing at or after it reads them again), keeping their ids in the table.
// With prefix caching only registered blocks are dropped (they stay findable while free).
// Returns how many were dropped now.
int block_manager_drop_before(struct block_manager *bm, struct block_table *bt, int first_needed);

// Hybrid models (per-layer-group block tables): the sliding-window group's own block manager
// holds the blocks of its layers; its tables drop out-of-window blocks (drop_before) while the
// full group keeps every block. A prefix hit of k full blocks (the full group's lookup) needs, in
// the sliding group, only the blocks a sequence resuming at token k * bs still reads:
// [lo(k), k) with lo(k) = max(0, k * bs - window + 1) / bs. lookup_window returns the largest
// k <= n_blocks whose window blocks are all cached here, their ids in out[lo .. k) (out: room
// for n_blocks), *lo_out = lo(k), *n_revived = how many of them are free now, and *last_hash =
// the chain hash of block k - 1 (computed from the tokens; 0 when k == 0). No state changes.
int block_manager_lookup_window(const struct block_manager *bm, const int32_t *tokens, int n_blocks, int window,
                                int32_t *out, int *lo_out, int *n_revived, uint64_t *last_hash);

// Takes references on the window blocks ids[lo .. k) of a lookup_window match and makes the empty
// table bt hold k blocks: lo leading placeholders (block 0, counted as dropped: attention never
// reads them unmasked) then the matched ones, registered up to k (chain hash last_hash). No
// statistics (the full group counts the hit).
void block_manager_acquire_window(struct block_manager *bm, struct block_table *bt, const int32_t *ids, int lo, int k,
                                  uint64_t last_hash);

// Speculative decoding's rollback: shrinks bt to the blocks that hold n_tokens slots, releasing
// the tail blocks that only held rejected draft slots (tail first). Those blocks are never
// registered (only verified tokens enter the prefix cache), so they return to the free stack.
// Returns how many were released.
int block_manager_truncate(struct block_manager *bm, struct block_table *bt, int n_tokens);

// Drops bt's references (tail first) and empties it.
void block_manager_release(struct block_manager *bm, struct block_table *bt);

// Drops every cached-but-free block from the prefix cache (they become plain free blocks).
void block_manager_reset_prefix_cache(struct block_manager *bm);

// Consistency check for tests: free-list/LRU/hash-table structure and refcounts agree.
// Returns true if consistent, else writes the first problem to err.
bool block_manager_check(const struct block_manager *bm, struct error *err);

#endif
