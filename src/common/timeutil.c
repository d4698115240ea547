#include "common/timeutil.h"

#include <time.h>

#include "common/check.h"

// clock_gettime fails only for an unknown clock id or a bad pointer: a programmer bug.
static struct timespec clock_read(clockid_t id) {
    struct timespec ts;
    CHECK(clock_gettime(id, &ts) == 0);
    return ts;
}

uint64_t time_now_ns(void) {
    struct timespec ts = clock_read(CLOCK_MONOTONIC);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double time_now_s(void) { return (double)time_now_ns() * 1e-9; }

double time_wall_s(void) {
    struct timespec ts = clock_read(CLOCK_REALTIME);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
