// Support code for tests/test.h, linked into every test binary.
#include <arpa/inet.h>
#include <ftw.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

#define MAX_TESTS 1024

static struct { const char *name; test_fn fn; } tests[MAX_TESTS];
static int n_tests;
static int current_failed;
static int current_skipped;
static char current_skip_reason[512];

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

bool test_require_fixtures(void) {
    const char *v = getenv("ATOMC_REQUIRE_FIXTURES");
    return v && *v && strcmp(v, "0") != 0;
}

void test_skip(const char *file, int line, const char *fmt, ...) {
    char reason[sizeof current_skip_reason];
    int n = snprintf(reason, sizeof reason, "%s:%d: ", file, line);
    if (n < 0 || (size_t)n >= sizeof reason) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason + n, sizeof reason - (size_t)n, fmt, ap);
    va_end(ap);
    if (test_require_fixtures()) {
        test_fail(file, line, "%s (a skip is a failure under ATOMC_REQUIRE_FIXTURES=1)", reason + n);
        return;
    }
    if (!current_skipped) memcpy(current_skip_reason, reason, sizeof reason);
    current_skipped = 1;
}

const char *test_smollm2_path_at(const char *file, int line) {
    const char *p = getenv("ATOMC_SMOLLM2");
    if (!p || !*p) {
        test_skip(file, line, "ATOMC_SMOLLM2 is not set (scripts/fetch_model.sh prints the path)");
        return NULL;
    }
    if (access(p, R_OK) != 0) {
        test_skip(file, line, "ATOMC_SMOLLM2=%s cannot be read", p);
        return NULL;
    }
    return p;
}

const char *test_shared_path_at(const char *file, int line, const char *rel) {
    static char bufs[4][1024];
    static int next;
    char *p = bufs[next++ % 4];
    const char *dir = getenv("ATOMC_SHARED");
    int n = snprintf(p, sizeof bufs[0], "%s/%s", dir && *dir ? dir : "../shared", rel);
    if (n < 0 || (size_t)n >= sizeof bufs[0]) abort();
    struct stat st;
    if (stat(p, &st) != 0) {
        test_skip(file, line, "%s is absent (the shared tokenizers live in ../shared or $ATOMC_SHARED)", p);
        return NULL;
    }
    return p;
}

const char *test_fixture(const char *rel) {
    static char buf[4096];
    const char *dir = getenv("ATOMC_FIXTURES");
    snprintf(buf, sizeof buf, "%s/%s", dir ? dir : "tests/fixtures", rel);
    return buf;
}

// The binary's scratch directory: made on first use, removed by test_main.
static char tmp_dir[64];

const char *test_tmp_dir(void) {
    if (!tmp_dir[0]) {
        snprintf(tmp_dir, sizeof tmp_dir, "/tmp/atomc_test_XXXXXX");
        if (!mkdtemp(tmp_dir)) {
            perror("mkdtemp");
            abort();
        }
    }
    return tmp_dir;
}

const char *test_tmp_path(const char *name) {
    static char bufs[8][512];
    static int next;
    char *p = bufs[next++ % 8];
    int n = snprintf(p, sizeof bufs[0], "%s/%s", test_tmp_dir(), name);
    if (n < 0 || (size_t)n >= sizeof bufs[0]) abort();
    return p;
}

void test_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror(path);
        abort();
    }
}

int test_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = 0;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port ? port : 20000 + (int)(getpid() % 20000);
}

json_t *test_fixture_json(const char *rel) {
    json_error_t je;
    json_t *j = json_load_file(test_fixture(rel), 0, &je);
    if (!j) fprintf(stderr, "  %s: %s (line %d)\n", test_fixture(rel), je.text, je.line);
    return j;
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    if (remove(path) != 0) perror(path);
    return 0;
}

int test_main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < n_tests; i++) {
        if (filter && !strstr(tests[i].name, filter)) continue;
        current_failed = 0;
        current_skipped = 0;
        tests[i].fn();
        if (current_failed) {
            failed++;
            fprintf(stderr, "FAIL %s\n", tests[i].name);
        } else if (current_skipped) {
            skipped++;
            fprintf(stderr, "skip %s: %s\n", tests[i].name, current_skip_reason);
        } else {
            passed++;
            fprintf(stderr, "ok   %s\n", tests[i].name);
        }
    }
    if (tmp_dir[0]) nftw(tmp_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
