// Communicator wrappers shared by every implementation (see comm.h).
#include <stdlib.h>

#include "parallel/comm.h"

double comm_default_timeout_s(void) {
    const char *e = getenv("ATOMC_COMM_TIMEOUT_S");
    if (e && *e) {
        char *end;
        double v = strtod(e, &end);
        if (end != e && v > 0) return v;
    }
    return 300.0;
}

static atomc_status comm_usable(struct comm *c, const char *op, struct error *err) {
    if (c->broken)
        return error_set(err, ATOMC_ERR_BACKEND, "%s communicator (rank %d of %d): %s after an earlier failure; the "
                         "group must be rebuilt", c->ops->name, c->rank, c->world_size, op);
    return ATOMC_OK;
}

static atomc_status comm_finish(struct comm *c, atomc_status st) {
    if (st != ATOMC_OK) c->broken = true;
    return st;
}

static bool comm_dtype_ok(enum dtype dt) { return dt == DTYPE_F32 || dt == DTYPE_BF16; }

atomc_status comm_all_reduce_sum(struct comm *c, void *buf, enum dtype dt, size_t count, struct error *err) {
    atomc_status st = comm_usable(c, "all_reduce", err);
    if (st != ATOMC_OK) return st;
    if (!comm_dtype_ok(dt))
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "all_reduce: dtype %s (F32 and BF16 only)", dtype_name(dt));
    if (count == 0) return ATOMC_OK;
    if (c->world_size == 1) return ATOMC_OK;
    return comm_finish(c, c->ops->all_reduce_sum(c, buf, dt, count, err));
}

atomc_status comm_all_gather(struct comm *c, void *dst, const void *src, enum dtype dt, size_t count,
                             struct error *err) {
    atomc_status st = comm_usable(c, "all_gather", err);
    if (st != ATOMC_OK) return st;
    if (!comm_dtype_ok(dt) && dt != DTYPE_I32)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "all_gather: dtype %s (F32, BF16, I32 only)", dtype_name(dt));
    if (count == 0) return ATOMC_OK;
    return comm_finish(c, c->ops->all_gather(c, dst, src, dt, count, err));
}

atomc_status comm_all_gather_cols(struct comm *c, void *dst, const void *src, void *tmp, enum dtype dt, size_t rows,
                                  size_t cols, struct error *err) {
    atomc_status st = comm_usable(c, "all_gather_cols", err);
    if (st != ATOMC_OK) return st;
    if (!comm_dtype_ok(dt) && dt != DTYPE_I32)
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "all_gather_cols: dtype %s (F32, BF16, I32 only)",
                         dtype_name(dt));
    if (rows == 0 || cols == 0) return ATOMC_OK;
    return comm_finish(c, c->ops->all_gather_cols(c, dst, src, tmp, dt, rows, cols, err));
}

atomc_status comm_broadcast_host(struct comm *c, void *buf, size_t bytes, int root, struct error *err) {
    atomc_status st = comm_usable(c, "broadcast", err);
    if (st != ATOMC_OK) return st;
    if (root < 0 || root >= c->world_size)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "broadcast: root %d outside [0, %d)", root, c->world_size);
    if (bytes == 0 || c->world_size == 1) return ATOMC_OK;
    return comm_finish(c, c->ops->broadcast_host(c, buf, bytes, root, err));
}

atomc_status comm_barrier(struct comm *c, struct error *err) {
    atomc_status st = comm_usable(c, "barrier", err);
    if (st != ATOMC_OK) return st;
    if (c->world_size == 1) return ATOMC_OK;
    return comm_finish(c, c->ops->barrier(c, err));
}

void comm_destroy(struct comm *c) {
    if (c) c->ops->destroy(c);
}
