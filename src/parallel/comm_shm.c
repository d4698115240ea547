// Shared-memory communicator for CPU ranks on one host (see comm.h).
//
// Segment layout (POSIX shm_open + mmap, so threads of one process and separate processes
// use the same code): a header page, then world_size slots of slot_bytes each, every slot
// split into two halves used by alternate chunks.
//
// Synchronisation is a generation barrier on C11 atomics in the segment: each rank reads
// `gen`, increments `arrive`; the last arriver resets `arrive`, bumps `gen` and wakes the
// waiters (futex on `gen`, shared, so it works across processes); the others spin briefly,
// then futex-wait in short slices, each time checking the deadline and the `abort_rank`
// word. A rank that times out writes its rank into `abort_rank`, so every peer fails at
// its next wait instead of waiting out its own timeout. No process-shared pthread objects:
// a dead peer can never leave a mutex held, it is simply detected by timeout.
//
// all_reduce_sum per chunk (one slot half): every rank copies its chunk into its slot;
// barrier; rank r reduces segment r of the chunk over all slots in rank order (F32
// accumulation) into its own slot (reduce-scatter); barrier; every rank copies segment j
// from slot j (all-gather). The next chunk uses the other half, so no third barrier is
// needed: a rank can only rewrite a half after a barrier that every reader of the
// previous use of that half has passed.
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/timeutil.h"
#include "parallel/comm.h"

#define SHM_MAGIC 0x61746f6d63736d31ull // "atomcsm1"
#define SHM_HEADER_BYTES 4096
#define SHM_DEFAULT_SLOT_BYTES ((size_t)4 << 20)
#define SHM_SPINS 4000

struct shm_header {
    _Atomic uint64_t magic;      // written last by rank 0 (release)
    int32_t world_size;
    uint64_t slot_bytes;
    _Atomic uint32_t attached;   // ranks that have mapped the segment
    _Atomic uint32_t arrive;     // barrier arrivals in the current generation
    _Atomic uint32_t gen;        // barrier generation (futex word)
    _Atomic int32_t abort_rank;  // -1, or the first rank that gave up waiting
};

struct shm_comm {
    struct comm base;
    char name[128];
    struct shm_header *h;
    unsigned char *slots;  // world_size * slot_bytes
    size_t map_bytes;
    size_t half_bytes;     // slot_bytes / 2
    int phase;             // slot half of the next chunk
};

static void futex_wait_ns(_Atomic uint32_t *addr, uint32_t val, long ns) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = ns};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Waits until every rank has called it (with the same `what`), or fails on timeout / abort.
static atomc_status shm_barrier_wait(struct shm_comm *s, const char *what, struct error *err) {
    struct shm_header *h = s->h;
    const int W = s->base.world_size;
    uint32_t g = atomic_load_explicit(&h->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&h->arrive, 1, memory_order_acq_rel) == (uint32_t)W - 1) {
        atomic_store_explicit(&h->arrive, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&h->gen, 1, memory_order_release);
        futex_wake_all(&h->gen);
        return ATOMC_OK;
    }
    double deadline = time_now_s() + s->base.timeout_s;
    for (int spins = 0; atomic_load_explicit(&h->gen, memory_order_acquire) == g; spins++) {
        int ab = atomic_load_explicit(&h->abort_rank, memory_order_relaxed);
        if (ab >= 0)
            return error_set(err, ATOMC_ERR_BACKEND, "shm communicator %s, rank %d of %d: %s aborted because rank %d "
                             "timed out waiting for a peer", s->name, s->base.rank, W, what, ab);
        if (spins < SHM_SPINS) {
            cpu_relax();
            continue;
        }
        if (time_now_s() > deadline) {
            int expected = -1;
            atomic_compare_exchange_strong(&h->abort_rank, &expected, s->base.rank);
            futex_wake_all(&h->gen);
            uint32_t here = atomic_load_explicit(&h->arrive, memory_order_relaxed);
            return error_set(err, ATOMC_ERR_BACKEND, "shm communicator %s, rank %d of %d: timed out after %.1f s in %s: "
                             "only %u of %d ranks arrived (a peer died or hangs)", s->name, s->base.rank, W,
                             s->base.timeout_s, what, here, W);
        }
        futex_wait_ns(&h->gen, g, 2 * 1000 * 1000);
    }
    return ATOMC_OK;
}

static unsigned char *slot_half(struct shm_comm *s, int rank, int phase) {
    return s->slots + (size_t)rank * 2 * s->half_bytes + (size_t)phase * s->half_bytes;
}

// Sums elements [i0, i1) of the chunk over all ranks' slots (rank order) into this rank's slot.
static void shm_reduce_segment(struct shm_comm *s, enum dtype dt, size_t i0, size_t i1) {
    const int W = s->base.world_size, me = s->base.rank;
    if (dt == DTYPE_F32) {
        float *out = (float *)slot_half(s, me, s->phase);
        for (size_t i = i0; i < i1; i++) {
            float acc = ((const float *)slot_half(s, 0, s->phase))[i];
            for (int j = 1; j < W; j++) acc += ((const float *)slot_half(s, j, s->phase))[i];
            out[i] = acc;
        }
    } else {
        uint16_t *out = (uint16_t *)slot_half(s, me, s->phase);
        for (size_t i = i0; i < i1; i++) {
            float acc = bf16_to_f32(((const uint16_t *)slot_half(s, 0, s->phase))[i]);
            for (int j = 1; j < W; j++) acc += bf16_to_f32(((const uint16_t *)slot_half(s, j, s->phase))[i]);
            out[i] = f32_to_bf16(acc);
        }
    }
}

static atomc_status shm_all_reduce_sum(struct comm *c, void *buf, enum dtype dt, size_t count, struct error *err) {
    struct shm_comm *s = (struct shm_comm *)c;
    const int W = c->world_size, me = c->rank;
    const size_t esz = dtype_row_bytes(dt, 1);
    const size_t per_chunk = s->half_bytes / esz;
    unsigned char *p = buf;
    for (size_t off = 0; off < count; off += per_chunk) {
        size_t n = count - off < per_chunk ? count - off : per_chunk;
        memcpy(slot_half(s, me, s->phase), p + off * esz, n * esz);
        atomc_status st = shm_barrier_wait(s, "all_reduce (scatter)", err);
        if (st != ATOMC_OK) return st;
        size_t seg = (n + (size_t)W - 1) / (size_t)W;
        size_t i0 = (size_t)me * seg < n ? (size_t)me * seg : n, i1 = i0 + seg < n ? i0 + seg : n;
        shm_reduce_segment(s, dt, i0, i1);
        if ((st = shm_barrier_wait(s, "all_reduce (gather)", err)) != ATOMC_OK) return st;
        for (int j = 0; j < W; j++) {
            size_t j0 = (size_t)j * seg < n ? (size_t)j * seg : n, j1 = j0 + seg < n ? j0 + seg : n;
            if (j1 > j0) memcpy(p + (off + j0) * esz, slot_half(s, j, s->phase) + j0 * esz, (j1 - j0) * esz);
        }
        s->phase ^= 1;
    }
    return ATOMC_OK;
}

static atomc_status shm_all_gather(struct comm *c, void *dst, const void *src, enum dtype dt, size_t count,
                                   struct error *err) {
    struct shm_comm *s = (struct shm_comm *)c;
    const int W = c->world_size, me = c->rank;
    const size_t esz = dtype_row_bytes(dt, 1);
    const size_t per_chunk = s->half_bytes / esz;
    for (size_t off = 0; off < count; off += per_chunk) {
        size_t n = count - off < per_chunk ? count - off : per_chunk;
        memcpy(slot_half(s, me, s->phase), (const unsigned char *)src + off * esz, n * esz);
        atomc_status st = shm_barrier_wait(s, "all_gather", err);
        if (st != ATOMC_OK) return st;
        for (int j = 0; j < W; j++)
            memcpy((unsigned char *)dst + ((size_t)j * count + off) * esz, slot_half(s, j, s->phase), n * esz);
        s->phase ^= 1;
    }
    return ATOMC_OK;
}

static atomc_status shm_all_gather_cols(struct comm *c, void *dst, const void *src, void *tmp, enum dtype dt,
                                       size_t rows, size_t cols, struct error *err) {
    struct shm_comm *s = (struct shm_comm *)c;
    const int W = c->world_size, me = c->rank;
    const size_t row_bytes = dtype_row_bytes(dt, (int64_t)cols);
    if (row_bytes > s->half_bytes)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "shm communicator %s: all_gather_cols row of %zu bytes exceeds "
                         "the %zu-byte slot half (create it with a larger slot)", s->name, row_bytes, s->half_bytes);
    const size_t per_chunk = s->half_bytes / row_bytes;
    for (size_t r0 = 0; r0 < rows; r0 += per_chunk) {
        size_t n = rows - r0 < per_chunk ? rows - r0 : per_chunk;
        memcpy(slot_half(s, me, s->phase), (const unsigned char *)src + r0 * row_bytes, n * row_bytes);
        atomc_status st = shm_barrier_wait(s, "all_gather_cols", err);
        if (st != ATOMC_OK) return st;
        for (int j = 0; j < W; j++)
            for (size_t i = 0; i < n; i++)
                memcpy((unsigned char *)dst + ((r0 + i) * (size_t)W + (size_t)j) * row_bytes,
                       slot_half(s, j, s->phase) + i * row_bytes, row_bytes);
        s->phase ^= 1;
    }
    (void)tmp;
    return ATOMC_OK;
}

static atomc_status shm_broadcast_host(struct comm *c, void *buf, size_t bytes, int root, struct error *err) {
    struct shm_comm *s = (struct shm_comm *)c;
    for (size_t off = 0; off < bytes; off += s->half_bytes) {
        size_t n = bytes - off < s->half_bytes ? bytes - off : s->half_bytes;
        if (c->rank == root) memcpy(slot_half(s, root, s->phase), (unsigned char *)buf + off, n);
        atomc_status st = shm_barrier_wait(s, "broadcast", err);
        if (st != ATOMC_OK) return st;
        if (c->rank != root) memcpy((unsigned char *)buf + off, slot_half(s, root, s->phase), n);
        s->phase ^= 1;
    }
    return ATOMC_OK;
}

static atomc_status shm_barrier(struct comm *c, struct error *err) {
    return shm_barrier_wait((struct shm_comm *)c, "barrier", err);
}

static void shm_destroy(struct comm *c) {
    struct shm_comm *s = (struct shm_comm *)c;
    if (s->h) munmap(s->h, s->map_bytes);
    free(s);
}

static const struct comm_ops SHM_OPS = {
    .name = "shm",
    .all_reduce_sum = shm_all_reduce_sum,
    .all_gather = shm_all_gather,
    .all_gather_cols = shm_all_gather_cols,
    .broadcast_host = shm_broadcast_host,
    .barrier = shm_barrier,
    .destroy = shm_destroy,
};

static void sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

atomc_status comm_shm_create(const char *name, int rank, int world_size, size_t slot_bytes, double timeout_s,
                             struct comm **out, struct error *err) {
    *out = NULL;
    if (!name || name[0] != '/' || strlen(name) >= sizeof(((struct shm_comm *)0)->name) || strchr(name + 1, '/'))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "shm communicator name '%s' must be '/' followed by up to "
                         "126 characters without '/'", name ? name : "(null)");
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "shm communicator %s: rank %d outside world size %d", name,
                         rank, world_size);
    if (timeout_s <= 0) timeout_s = comm_default_timeout_s();
    if (slot_bytes == 0) slot_bytes = SHM_DEFAULT_SLOT_BYTES;
    slot_bytes = (slot_bytes + 127) & ~(size_t)127;
    size_t map_bytes = SHM_HEADER_BYTES + (size_t)world_size * slot_bytes;
    double deadline = time_now_s() + timeout_s;
    int fd;
    if (rank == 0) {
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0)
            return error_set(err, ATOMC_ERR_IO, "shm communicator: cannot create %s: %s%s", name, strerror(errno),
                             errno == EEXIST ? " (another group uses this name, or a crashed one left it: "
                                               "remove /dev/shm/<name>)" : "");
        if (ftruncate(fd, (off_t)map_bytes) != 0) {
            int e = errno;
            close(fd);
            shm_unlink(name);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "shm communicator: cannot size %s to %zu bytes: %s", name,
                             map_bytes, strerror(e));
        }
    } else {
        for (;;) {
            fd = shm_open(name, O_RDWR, 0600);
            struct stat sb;
            if (fd >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size >= SHM_HEADER_BYTES) break;
            if (fd < 0 && errno != ENOENT)
                return error_set(err, ATOMC_ERR_IO, "shm communicator: cannot open %s: %s", name, strerror(errno));
            if (fd >= 0) close(fd);
            if (time_now_s() > deadline)
                return error_set(err, ATOMC_ERR_BACKEND, "shm communicator: rank %d timed out after %.1f s waiting for "
                                 "rank 0 to create %s", rank, timeout_s, name);
            sleep_ms(2);
        }
    }
    void *map = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        if (rank == 0) shm_unlink(name);
        return error_set(err, ATOMC_ERR_IO, "shm communicator: cannot map %s (%zu bytes): %s", name, map_bytes,
                         strerror(errno));
    }
    struct shm_comm *s = xcalloc(1, sizeof *s);
    s->base = (struct comm){.ops = &SHM_OPS, .rank = rank, .world_size = world_size, .timeout_s = timeout_s};
    snprintf(s->name, sizeof s->name, "%s", name);
    s->h = map;
    s->map_bytes = map_bytes;
    s->slots = (unsigned char *)map + SHM_HEADER_BYTES;
    s->half_bytes = slot_bytes / 2;
    struct shm_header *h = s->h;
    atomc_status st = ATOMC_OK;
    if (rank == 0) {
        h->world_size = world_size;
        h->slot_bytes = slot_bytes;
        atomic_store(&h->attached, 0);
        atomic_store(&h->arrive, 0);
        atomic_store(&h->gen, 0);
        atomic_store(&h->abort_rank, -1);
        atomic_store_explicit(&h->magic, SHM_MAGIC, memory_order_release);
    } else {
        while (atomic_load_explicit(&h->magic, memory_order_acquire) != SHM_MAGIC) {
            if (time_now_s() > deadline) {
                st = error_set(err, ATOMC_ERR_BACKEND, "shm communicator: rank %d timed out after %.1f s waiting for "
                               "rank 0 to initialise %s", rank, timeout_s, name);
                goto fail;
            }
            sleep_ms(1);
        }
        if (h->world_size != world_size || h->slot_bytes != slot_bytes) {
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "shm communicator %s: rank %d was started with world size "
                           "%d and slot %zu bytes, rank 0 with %d and %llu", name, rank, world_size, slot_bytes,
                           h->world_size, (unsigned long long)h->slot_bytes);
            goto fail;
        }
    }
    atomic_fetch_add(&h->attached, 1);
    st = shm_barrier_wait(s, "attach", err);
    if (rank == 0) shm_unlink(name); // everyone has mapped it (or the group failed): leave nothing behind
    if (st != ATOMC_OK) goto fail;
    *out = &s->base;
    return ATOMC_OK;
fail:
    shm_destroy(&s->base);
    return st;
}
