// Clocks for timestamps and benchmarks: the monotonic clock measures intervals (request
// timings, step latencies); the wall clock only stamps results (e.g. OpenAI `created`).
#ifndef ATOMC_COMMON_TIMEUTIL_H
#define ATOMC_COMMON_TIMEUTIL_H

#include <stdint.h>

// Monotonic clock in seconds / nanoseconds; wall clock in seconds since the epoch.
double time_now_s(void);
uint64_t time_now_ns(void);
double time_wall_s(void);

#endif
