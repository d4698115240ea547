#include "bench/bench_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"

void sample_vec_push(struct sample_vec *s, double x) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 64;
        s->v = xrealloc(s->v, s->cap * sizeof *s->v);
    }
    s->v[s->n++] = x;
}

void sample_vec_free(struct sample_vec *s) {
    free(s->v);
    memset(s, 0, sizeof *s);
}

double stats_mean(const double *v, size_t n) {
    if (!n) return 0;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += v[i];
    return s / (double)n;
}

double stats_std(const double *v, size_t n) {
    if (!n) return 0;
    double m = stats_mean(v, n), s = 0;
    for (size_t i = 0; i < n; i++) s += (v[i] - m) * (v[i] - m);
    return sqrt(s / (double)n);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double stats_percentile(const double *v, size_t n, double p) {
    if (!n) return 0;
    double *c = xmalloc(n * sizeof *c);
    memcpy(c, v, n * sizeof *c);
    qsort(c, n, sizeof *c, cmp_double);
    double rank = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(rank), hi = (size_t)ceil(rank);
    double r = c[lo] + (c[hi] - c[lo]) * (rank - (double)lo);
    free(c);
    return r;
}
