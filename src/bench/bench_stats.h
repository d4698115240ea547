// Summary statistics for benchmark samples (milliseconds or any unit), matching numpy's
// definitions: mean, median, population std, percentiles with linear interpolation.
#ifndef ATOMC_BENCH_STATS_H
#define ATOMC_BENCH_STATS_H

#include <stddef.h>

struct sample_vec {
    double *v;
    size_t n, cap;
};

void sample_vec_push(struct sample_vec *s, double x);
void sample_vec_free(struct sample_vec *s);
double stats_mean(const double *v, size_t n);
double stats_std(const double *v, size_t n);
// p in [0, 100]; sorts a copy. Returns 0 for an empty set.
double stats_percentile(const double *v, size_t n, double p);

#endif
