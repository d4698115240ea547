// Per-step timeline tracing. When enabled, named spans (schedule, prepare inputs, forward,
// sample, postprocess, detokenize, ...) are recorded with microsecond timestamps into a
// bounded buffer and written as Chrome trace JSON (chrome://tracing, Perfetto). In CUDA
// builds every span is also an NVTX range, so Nsight Systems shows the same steps.
// Recording costs two clock reads and a mutex per span; disabled tracing costs a branch
// (plus the NVTX push/pop, which are no-ops when no tool is attached).
#ifndef ATOMC_COMMON_TRACE_H
#define ATOMC_COMMON_TRACE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"

struct trace;

struct trace *trace_create(size_t max_events);
void trace_free(struct trace *t);
// Starting clears previously recorded events.
void trace_start(struct trace *t);
void trace_stop(struct trace *t);
bool trace_is_enabled(const struct trace *t);

// `name` must be a string literal (or otherwise outlive the trace).
void trace_begin(struct trace *t, const char *name);
void trace_end(struct trace *t, const char *name);
void trace_counter(struct trace *t, const char *name, double value);

// Writes {"traceEvents": [...]} to path. Returns the number of events written in *n (may be NULL).
atomc_status trace_write_json(struct trace *t, const char *path, size_t *n, struct error *err);

#endif
