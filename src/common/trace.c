#include "common/trace.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/check.h"
#include "common/timeutil.h"

#ifdef ATOMC_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

struct trace_event {
    const char *name;
    char ph;        // 'B', 'E' or 'C'
    int tid;
    uint64_t ts_ns;
    double value;   // counters
};

struct trace {
    pthread_mutex_t mu;
    atomic_bool enabled;
    struct trace_event *ev;
    size_t n, cap;
    size_t dropped;
    uint64_t t0;
};

struct trace *trace_create(size_t max_events) {
    struct trace *t = xcalloc(1, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    t->cap = max_events ? max_events : 1u << 20;
    t->ev = xmalloc(t->cap * sizeof *t->ev);
    t->t0 = time_now_ns();
    return t;
}

void trace_free(struct trace *t) {
    if (!t) return;
    pthread_mutex_destroy(&t->mu);
    free(t->ev);
    free(t);
}

void trace_start(struct trace *t) {
    pthread_mutex_lock(&t->mu);
    t->n = 0;
    t->dropped = 0;
    t->t0 = time_now_ns();
    pthread_mutex_unlock(&t->mu);
    atomic_store(&t->enabled, true);
}

void trace_stop(struct trace *t) { atomic_store(&t->enabled, false); }

bool trace_is_enabled(const struct trace *t) { return t && atomic_load(&((struct trace *)t)->enabled); }

static void record(struct trace *t, const char *name, char ph, double value) {
    uint64_t now = time_now_ns();
    int tid = (int)syscall(SYS_gettid);
    pthread_mutex_lock(&t->mu);
    if (t->n < t->cap) t->ev[t->n++] = (struct trace_event){name, ph, tid, now, value};
    else t->dropped++;
    pthread_mutex_unlock(&t->mu);
}

void trace_begin(struct trace *t, const char *name) {
#ifdef ATOMC_CUDA
    nvtxRangePushA(name);
#endif
    if (trace_is_enabled(t)) record(t, name, 'B', 0);
}

void trace_end(struct trace *t, const char *name) {
    if (trace_is_enabled(t)) record(t, name, 'E', 0);
#ifdef ATOMC_CUDA
    nvtxRangePop();
#endif
}

void trace_counter(struct trace *t, const char *name, double value) {
    if (trace_is_enabled(t)) record(t, name, 'C', value);
}

static void write_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

atomc_status trace_write_json(struct trace *t, const char *path, size_t *n_out, struct error *err) {
    FILE *f = fopen(path, "w");
    if (!f) return error_set(err, ATOMC_ERR_IO, "%s: cannot write trace: %s", path, strerror(errno));
    pthread_mutex_lock(&t->mu);
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"dropped_events\": %zu}, \"traceEvents\": [\n", t->dropped);
    for (size_t i = 0; i < t->n; i++) {
        const struct trace_event *e = &t->ev[i];
        double ts = (double)(e->ts_ns - t->t0) / 1000.0;
        fprintf(f, "%s{\"name\": ", i ? ",\n" : "");
        write_json_string(f, e->name);
        fprintf(f, ", \"ph\": \"%c\", \"ts\": %.3f, \"pid\": 1, \"tid\": %d", e->ph, ts, e->tid);
        if (e->ph == 'C') {
            fprintf(f, ", \"args\": {");
            write_json_string(f, e->name);
            fprintf(f, ": %.6g}", e->value);
        }
        fputc('}', f);
    }
    fprintf(f, "\n]}\n");
    size_t n = t->n;
    pthread_mutex_unlock(&t->mu);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return error_set(err, ATOMC_ERR_IO, "%s: write failed", path);
    if (n_out) *n_out = n;
    return ATOMC_OK;
}
