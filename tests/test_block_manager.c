// Block manager: allocation, refcounts, prefix sharing over full blocks, chained hashes,
// collision check, LRU eviction order, statistics. No model involved.
#include <stdlib.h>

#include "engine/block_manager.h"
#include "test.h"

static struct block_manager *make(int n, int bs, bool cache) {
    struct block_manager *bm = NULL;
    struct error err;
    if (block_manager_create(n, bs, cache, &bm, &err) != ATOMC_OK) return NULL;
    return bm;
}

static bool consistent(struct block_manager *bm) {
    struct error err = {0};
    bool ok = block_manager_check(bm, &err);
    if (!ok) fprintf(stderr, "  block manager inconsistent: %s\n", err.msg);
    return ok;
}

// Admits tokens the way the scheduler does: lookup + acquire + allocate + commit all.
static int admit(struct block_manager *bm, struct block_table *bt, const int32_t *t, int n) {
    int32_t match[256];
    int revived = 0;
    int k = block_manager_lookup(bm, t, n, match, &revived);
    block_manager_acquire_prefix(bm, bt, match, k, n);
    if (!block_manager_allocate(bm, bt, n)) return -1;
    block_manager_commit(bm, bt, t, n);
    return k;
}

TEST(block_manager_rejects_bad_sizes) {
    struct block_manager *bm;
    struct error err;
    ASSERT_EQ(block_manager_create(0, 16, true, &bm, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(block_manager_create(8, 0, true, &bm, &err), ATOMC_ERR_INVALID_ARGUMENT);
}

TEST(block_manager_allocates_all_or_nothing) {
    struct block_manager *bm = make(4, 16, true);
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    ASSERT_TRUE(block_manager_allocate(bm, &a, 17)); // 2 blocks
    ASSERT_EQ(a.n, 2);
    ASSERT_EQ(block_manager_num_free(bm), 2);
    ASSERT_TRUE(block_manager_allocate(bm, &a, 32)); // still 2
    ASSERT_EQ(a.n, 2);
    ASSERT_TRUE(!block_manager_allocate(bm, &b, 49)); // needs 4, 2 free: nothing taken
    ASSERT_EQ(b.n, 0);
    ASSERT_EQ(block_manager_num_free(bm), 2);
    ASSERT_TRUE(block_manager_allocate(bm, &b, 32));
    ASSERT_EQ(block_manager_num_free(bm), 0);
    ASSERT_TRUE(a.ids[0] != b.ids[0] && a.ids[1] != b.ids[1] && a.ids[0] != b.ids[1]);
    ASSERT_TRUE(consistent(bm));
    block_manager_release(bm, &a);
    block_manager_release(bm, &b);
    ASSERT_EQ(block_manager_num_free(bm), 4);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

TEST(block_manager_shares_full_prefix_blocks) {
    struct block_manager *bm = make(16, 4, true);
    int32_t p[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int32_t q[11] = {1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44};
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    ASSERT_EQ(admit(bm, &a, p, 10), 0);
    ASSERT_EQ(a.n, 3);
    ASSERT_EQ(a.n_hashed, 2); // the partial third block is never registered
    ASSERT_EQ(admit(bm, &b, q, 11), 2);
    ASSERT_EQ(b.ids[0], a.ids[0]);
    ASSERT_EQ(b.ids[1], a.ids[1]);
    ASSERT_NE(b.ids[2], a.ids[2]);
    ASSERT_EQ(bm->blocks[a.ids[0]].ref_count, 2);
    ASSERT_EQ(bm->blocks[a.ids[2]].ref_count, 1);
    ASSERT_EQ(bm->queries, 21);
    ASSERT_EQ(bm->hits, 8);
    ASSERT_TRUE(consistent(bm));
    block_manager_release(bm, &a);
    ASSERT_EQ(bm->blocks[b.ids[0]].ref_count, 1);
    block_manager_release(bm, &b);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

TEST(block_manager_never_covers_the_last_token) {
    struct block_manager *bm = make(16, 4, true);
    int32_t p[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    ASSERT_EQ(admit(bm, &a, p, 8), 0);
    ASSERT_EQ(a.n_hashed, 2);
    int32_t match[4];
    int revived;
    // Whole prompt cached: only the first block is reused, the second is recomputed.
    ASSERT_EQ(block_manager_lookup(bm, p, 8, match, &revived), 1);
    ASSERT_EQ(block_manager_lookup(bm, p, 9, match, &revived), 2);
    ASSERT_EQ(block_manager_lookup(bm, p, 1, match, &revived), 0);
    block_manager_release(bm, &a);
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

TEST(block_manager_hash_chains_over_the_prefix) {
    struct block_manager *bm = make(16, 4, true);
    // Same second block, different first block: the second must not match.
    int32_t p[9] = {1, 2, 3, 4, 5, 6, 7, 8, 0};
    int32_t q[9] = {9, 9, 9, 9, 5, 6, 7, 8, 0};
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    admit(bm, &a, p, 9);
    ASSERT_EQ(admit(bm, &b, q, 9), 0);
    ASSERT_NE(b.ids[1], a.ids[1]);
    ASSERT_EQ(block_hash_xxh64(p + 4, 4, block_hash_xxh64(p, 4, 0)), bm->blocks[a.ids[1]].hash);
    ASSERT_NE(bm->blocks[a.ids[1]].hash, bm->blocks[b.ids[1]].hash);
    block_manager_release(bm, &a);
    block_manager_release(bm, &b);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

static uint64_t constant_hash(const int32_t *t, int n, uint64_t parent) {
    (void)t;
    (void)n;
    (void)parent;
    return 7;
}

TEST(block_manager_token_check_defeats_collisions) {
    struct block_manager *bm = make(16, 4, true);
    bm->hash_fn = constant_hash; // every block collides
    int32_t p[5] = {1, 2, 3, 4, 0}, q[5] = {5, 6, 7, 8, 0}, r[5] = {5, 6, 7, 8, 1};
    struct block_table a, b, c;
    block_table_init(&a);
    block_table_init(&b);
    block_table_init(&c);
    admit(bm, &a, p, 5);
    ASSERT_EQ(admit(bm, &b, q, 5), 0); // same hash, different tokens: no match
    ASSERT_EQ(admit(bm, &c, r, 5), 1); // same hash and tokens: match (b's block)
    ASSERT_EQ(c.ids[0], b.ids[0]);
    ASSERT_TRUE(consistent(bm));
    block_manager_release(bm, &a);
    block_manager_release(bm, &b);
    block_manager_release(bm, &c);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_table_free(&c);
    block_manager_free(bm);
}

TEST(block_manager_evicts_least_recently_freed_first) {
    struct block_manager *bm = make(4, 2, true);
    int32_t p[3] = {1, 2, 0}, q[3] = {3, 4, 0};
    struct block_table a, b, c;
    block_table_init(&a);
    block_table_init(&b);
    block_table_init(&c);
    admit(bm, &a, p, 3); // blocks 0 (cached) and 1
    admit(bm, &b, q, 3); // blocks 2 (cached) and 3
    int32_t pa = a.ids[0], qb = b.ids[0];
    block_manager_release(bm, &a); // p's block freed first
    block_manager_release(bm, &b);
    ASSERT_EQ(bm->n_lru, 2);
    ASSERT_EQ(bm->lru_head, pa);
    // Uncached free blocks go first, then the LRU head (p's block) is evicted.
    ASSERT_TRUE(block_manager_allocate(bm, &c, 6));
    ASSERT_EQ(c.ids[2], pa);
    ASSERT_EQ(bm->evictions, 1);
    int32_t m[2];
    int revived;
    ASSERT_EQ(block_manager_lookup(bm, p, 3, m, &revived), 0); // evicted
    ASSERT_EQ(block_manager_lookup(bm, q, 3, m, &revived), 1); // still cached
    ASSERT_EQ(m[0], qb);
    ASSERT_EQ(revived, 1);
    block_manager_release(bm, &c);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_table_free(&c);
    block_manager_free(bm);
}

TEST(block_manager_reuses_cached_free_blocks) {
    struct block_manager *bm = make(8, 4, true);
    int32_t p[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    admit(bm, &a, p, 9);
    int32_t first = a.ids[0], second = a.ids[1];
    block_manager_release(bm, &a);
    ASSERT_EQ(block_manager_num_free(bm), 8);
    int32_t m[4];
    int revived;
    ASSERT_EQ(block_manager_lookup(bm, p, 9, m, &revived), 2);
    ASSERT_EQ(revived, 2);
    ASSERT_EQ(admit(bm, &b, p, 9), 2);
    ASSERT_EQ(b.ids[0], first);
    ASSERT_EQ(b.ids[1], second);
    ASSERT_EQ(block_manager_num_free(bm), 5);
    ASSERT_EQ(bm->n_lru, 0);
    ASSERT_TRUE(consistent(bm));
    block_manager_release(bm, &b);
    block_manager_reset_prefix_cache(bm);
    ASSERT_EQ(block_manager_lookup(bm, p, 9, m, &revived), 0);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

TEST(block_manager_prefix_caching_off) {
    struct block_manager *bm = make(8, 4, false);
    int32_t p[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    ASSERT_EQ(admit(bm, &a, p, 9), 0);
    ASSERT_EQ(admit(bm, &b, p, 9), 0);
    ASSERT_EQ(a.n_hashed, 0);
    ASSERT_EQ(bm->queries, 0);
    block_manager_release(bm, &a);
    block_manager_release(bm, &b);
    ASSERT_EQ(bm->n_lru, 0);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

TEST(block_manager_duplicate_content_stays_private) {
    struct block_manager *bm = make(8, 4, true);
    int32_t p[5] = {1, 2, 3, 4, 5};
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    // Both allocate before either commits (same step): b's copy is not registered.
    ASSERT_TRUE(block_manager_allocate(bm, &a, 5));
    ASSERT_TRUE(block_manager_allocate(bm, &b, 5));
    block_manager_commit(bm, &a, p, 5);
    block_manager_commit(bm, &b, p, 5);
    ASSERT_TRUE(bm->blocks[a.ids[0]].cached);
    ASSERT_TRUE(!bm->blocks[b.ids[0]].cached);
    ASSERT_EQ(b.n_hashed, 1); // chain continues for b's later blocks
    block_manager_release(bm, &a);
    block_manager_release(bm, &b);
    ASSERT_EQ(bm->n_lru, 1);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_manager_free(bm);
}

// The sliding-window group of a hybrid model: a prefix of k blocks is a hit there when the blocks
// the next token reads, [lo(k), k) with lo(k) = max(0, k bs - W + 1) / bs, are cached, whatever
// happened to the blocks before them (dropped, evicted); a missing window block shortens the hit.
TEST(block_manager_window_lookup_needs_only_the_window) {
    struct block_manager *bm = make(8, 4, true);
    int32_t t[24];
    for (int i = 0; i < 24; i++) t[i] = 100 + i;
    struct block_table a, b;
    block_table_init(&a);
    block_table_init(&b);
    ASSERT_TRUE(block_manager_allocate(bm, &a, 21)); // 6 blocks, 5 full
    block_manager_commit(bm, &a, t, 21);
    // Window 6 at token 20: keys from 15 on, blocks 3 and 4; the leading three are dropped.
    ASSERT_EQ(block_manager_drop_before(bm, &a, 20 - 6 + 1), 3);
    ASSERT_EQ(block_manager_num_free(bm), 2 + 3);
    ASSERT_TRUE(consistent(bm));
    int32_t ids[8];
    int lo = -1, rev = -1;
    uint64_t h = 0;
    ASSERT_EQ(block_manager_lookup_window(bm, t, 5, 6, ids, &lo, &rev, &h), 5);
    ASSERT_EQ(lo, 3); // token 20 reads 15.. : block 3 on
    ASSERT_EQ(rev, 0); // blocks 3 and 4 are still held by a
    uint64_t want = 0;
    for (int i = 0; i < 5; i++) want = block_hash_xxh64(t + 4 * i, 4, want);
    ASSERT_TRUE(h == want);
    // Evict the dropped blocks (least recently freed first): the hit stays, it never needed them.
    struct block_table c;
    block_table_init(&c);
    ASSERT_TRUE(block_manager_allocate(bm, &c, 20)); // 5 blocks: 2 fresh + the 3 cached free ones
    ASSERT_EQ(block_manager_lookup_window(bm, t, 5, 6, ids, &lo, &rev, &h), 5);
    block_manager_acquire_window(bm, &b, ids, lo, 5, h);
    ASSERT_EQ(b.n, 5);
    ASSERT_EQ(b.n_dropped, 3);
    ASSERT_EQ(b.n_hashed, 5);
    ASSERT_TRUE(b.ids[3] == a.ids[3] && b.ids[4] == a.ids[4]);
    ASSERT_TRUE(consistent(bm));
    // b continues as its own sequence: its next block registers on the chain of the hit.
    ASSERT_TRUE(block_manager_allocate(bm, &b, 24) || block_manager_num_free(bm) == 0);
    block_manager_release(bm, &b);
    block_manager_release(bm, &c);
    // A window reaching back to block 1 (W = 16 at token 20: keys from 5 on): blocks 1 and 2 were
    // evicted by c, so only shorter prefixes qualify: k = 1 (token 4 reads 0..4: block 0, also
    // gone) fails too; nothing matches.
    ASSERT_EQ(block_manager_lookup_window(bm, t, 5, 16, ids, &lo, &rev, &h), 0);
    block_manager_release(bm, &a);
    ASSERT_EQ(block_manager_num_free(bm), 8);
    ASSERT_TRUE(consistent(bm));
    block_table_free(&a);
    block_table_free(&b);
    block_table_free(&c);
    block_manager_free(bm);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
