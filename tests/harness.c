// Support code for tests/test.h, linked into every test binary.
#include <stdarg.h>
#include <stdlib.h>

#include "test.h"

#define MAX_TESTS 1024

static struct { const char *name; test_fn fn; } tests[MAX_TESTS];
static int n_tests;
static int current_failed;

void test_register(const char *name, test_fn fn) {
    if (n_tests < MAX_TESTS) {
        tests[n_tests].name = name;
        tests[n_tests].fn = fn;
        n_tests++;
    }
}

void test_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  FAIL %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    current_failed = 1;
}

int test_failed_now(void) { return current_failed; }

const char *test_fixture(const char *rel) {
    static char buf[4096];
    const char *dir = getenv("ATOMC_FIXTURES");
    snprintf(buf, sizeof buf, "%s/%s", dir ? dir : "tests/fixtures", rel);
    return buf;
}

int test_main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    int passed = 0, failed = 0;
    for (int i = 0; i < n_tests; i++) {
        if (filter && !strstr(tests[i].name, filter)) continue;
        current_failed = 0;
        tests[i].fn();
        if (current_failed) {
            failed++;
            fprintf(stderr, "FAIL %s\n", tests[i].name);
        } else {
            passed++;
            fprintf(stderr, "ok   %s\n", tests[i].name);
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
