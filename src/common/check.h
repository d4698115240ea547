// One macro per kind of call that can fail, reporting expression, file and line.
// CHECK is for invariants (programmer bugs): it aborts. System / CUDA calls on paths
// driven by input return statuses instead; see error.h.
#ifndef ATOMC_COMMON_CHECK_H
#define ATOMC_COMMON_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "atomc: check failed: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
            abort();                                                                     \
        }                                                                                \
    } while (0)

#define CHECK_MSG(cond, ...)                                                             \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "atomc: check failed: %s at %s:%d: ", #cond, __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                                \
            fputc('\n', stderr);                                                         \
            abort();                                                                     \
        }                                                                                \
    } while (0)

// malloc/calloc/realloc that abort on failure: only for small, bounded allocations
// whose failure means the process is already lost. Large, input-sized allocations
// must use plain malloc and return ATOMC_ERR_OUT_OF_MEMORY.
void *xmalloc(size_t n);
void *xcalloc(size_t count, size_t size);
void *xrealloc(void *p, size_t n);
char *xstrdup(const char *s);

#endif
