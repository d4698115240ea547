// Minimal C test harness. Each tests/test_*.c is its own binary:
//
//   TEST(block_manager_allocates) { ASSERT_EQ(1, 1); }
//   int main(int argc, char **argv) { return test_main(argc, argv); }
//
// Tests register themselves (constructor attribute); `test_main` runs them all (or those
// whose name contains argv[1]) and prints "N passed, N failed, N skipped" as its last line.
#ifndef ATOMC_TESTS_TEST_H
#define ATOMC_TESTS_TEST_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

typedef void (*test_fn)(void);
void test_register(const char *name, test_fn fn);
int test_main(int argc, char **argv);
void test_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int test_failed_now(void);
// Skips. A test that cannot run because something from outside the repository is missing (the
// SmolLM2 GGUF, a tokenizer under ../shared) marks itself skipped with a reason: SKIP(...) records
// it and returns, test_skip only records it. Skipped tests are listed with their reason and
// counted in the closing line. Under ATOMC_REQUIRE_FIXTURES=1 (CI: .ci/run, scripts/test.sh) a skip
// is a failure instead, so a missing file cannot pass silently. A committed fixture under
// tests/fixtures is never a reason to skip: a test whose fixture is missing fails.
void test_skip(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
#define SKIP(...) do { test_skip(__FILE__, __LINE__, __VA_ARGS__); return; } while (0)
// Whether ATOMC_REQUIRE_FIXTURES is set (to anything but "" or "0").
bool test_require_fixtures(void);
// $ATOMC_SMOLLM2 if it names a readable file; otherwise NULL and the current test is skipped
// (a failure under ATOMC_REQUIRE_FIXTURES=1). Callers return on NULL.
#define test_smollm2_path() test_smollm2_path_at(__FILE__, __LINE__)
const char *test_smollm2_path_at(const char *file, int line);
// $ATOMC_SHARED (default ../shared) "/" rel if that file or directory exists; otherwise NULL and
// the current test is skipped (a failure under the switch). One of 4 rotating buffers.
#define test_shared_path(rel) test_shared_path_at(__FILE__, __LINE__, rel)
const char *test_shared_path_at(const char *file, int line, const char *rel);

// Path of a fixture file under tests/fixtures (honours ATOMC_FIXTURES).
const char *test_fixture(const char *rel);
// Fixture `rel` parsed as JSON (json_t from jansson; caller decrefs), or NULL with the
// reason on stderr.
struct json_t *test_fixture_json(const char *rel);

// A loopback TCP port that was free a moment ago (the kernel's choice), for a rendezvous
// server to listen on; a pid-derived port if no socket could be bound.
int test_free_port(void);

// Scratch files. test_tmp_dir() is a private directory made on first use and removed, with
// everything in it, when test_main returns. test_tmp_path(name) is name inside it, in one of 8
// rotating buffers (so a few paths can be live at once). test_write_file writes n bytes to
// path and aborts on any I/O error: a broken test setup is not a test result.
const char *test_tmp_dir(void);
const char *test_tmp_path(const char *name);
void test_write_file(const char *path, const void *data, size_t n);

// a equals the reference b up to float rounding: |a - b| <= 1e-6 (1 + |b|).
static inline int test_close_rel(double a, double b) { return fabs(a - b) <= 1e-6 * (1.0 + fabs(b)); }

#define TEST(name)                                                                 \
    static void test_##name(void);                                                 \
    __attribute__((constructor)) static void test_register_##name(void) {          \
        test_register(#name, test_##name);                                         \
    }                                                                              \
    static void test_##name(void)

#define ASSERT_TRUE(c)                                                              \
    do { if (!(c)) { test_fail(__FILE__, __LINE__, "expected true: %s", #c); return; } } while (0)
#define ASSERT_EQ(a, b)                                                              \
    do { long long _a = (long long)(a), _b = (long long)(b);                          \
        if (_a != _b) { test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, _a, _b); return; } } while (0)
#define ASSERT_NE(a, b)                                                              \
    do { long long _a = (long long)(a), _b = (long long)(b);                          \
        if (_a == _b) { test_fail(__FILE__, __LINE__, "%s != %s: both %lld", #a, #b, _a); return; } } while (0)
#define ASSERT_STREQ(a, b)                                                           \
    do { const char *_a = (a), *_b = (b);                                             \
        if (!_a || !_b || strcmp(_a, _b)) { test_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b, _a ? _a : "(null)", _b ? _b : "(null)"); return; } } while (0)
#define ASSERT_NEAR(a, b, tol)                                                       \
    do { double _a = (a), _b = (b);                                                   \
        if (!(fabs(_a - _b) <= (tol))) { test_fail(__FILE__, __LINE__, "%s ~= %s: %g vs %g (tol %g)", #a, #b, _a, _b, (double)(tol)); return; } } while (0)
#define ASSERT_OK(st)                                                                \
    do { int _s = (int)(st); if (_s != 0) { test_fail(__FILE__, __LINE__, "%s returned status %d", #st, _s); return; } } while (0)

#endif
