// The harness's own contract (tests/harness.c): a skipped test is counted and listed with its
// reason, the closing line is "N passed, N failed, N skipped", and ATOMC_REQUIRE_FIXTURES=1 turns
// a skip into a failure (exit status 1). Each check re-runs this binary on one "child" test with
// ATOMC_HARNESS_CHILD=1 and reads what it prints; outside such a run the child tests do nothing.
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

static bool is_child(void) { return getenv("ATOMC_HARNESS_CHILD") != NULL; }

TEST(child_skips) {
    if (!is_child()) return;
    SKIP("the reason %d", 42);
}

TEST(child_smollm2) {
    if (!is_child()) return;
    const char *p = test_smollm2_path();
    if (!p) return;
}

TEST(child_shared) {
    if (!is_child()) return;
    const char *p = test_shared_path("no/such/thing");
    if (!p) return;
    ASSERT_TRUE(false); // not reached: the path does not exist
}

// Runs this binary on test `name` with env's arguments (`-u NAME` options first, then NAME=VALUE,
// space-separated) and ATOMC_REQUIRE_FIXTURES unset unless env sets it; stdout+stderr into out.
// Returns the exit status (-1 on error).
static int run_child(const char *name, const char *env, char *out, size_t cap) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return -1;
    self[n] = '\0';
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "env -u ATOMC_REQUIRE_FIXTURES %s ATOMC_HARNESS_CHILD=1 '%s' %s 2>&1", env, self, name);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t len = fread(out, 1, cap - 1, f);
    out[len] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const char *last_line(char *out) {
    size_t n = strlen(out);
    while (n && out[n - 1] == '\n') out[--n] = '\0';
    const char *nl = strrchr(out, '\n');
    return nl ? nl + 1 : out;
}

TEST(harness_counts_a_skip_with_its_reason) {
    static char out[16384];
    ASSERT_EQ(run_child("child_skips", "", out, sizeof out), 0);
    ASSERT_TRUE(strstr(out, "skip child_skips: tests/test_harness.c:") != NULL);
    ASSERT_TRUE(strstr(out, "the reason 42") != NULL);
    ASSERT_STREQ(last_line(out), "0 passed, 0 failed, 1 skipped");
}

TEST(harness_skip_fails_under_require_fixtures) {
    static char out[16384];
    ASSERT_EQ(run_child("child_skips", "ATOMC_REQUIRE_FIXTURES=1", out, sizeof out), 1);
    ASSERT_TRUE(strstr(out, "FAIL child_skips") != NULL);
    ASSERT_TRUE(strstr(out, "the reason 42 (a skip is a failure under ATOMC_REQUIRE_FIXTURES=1)") != NULL);
    ASSERT_STREQ(last_line(out), "0 passed, 1 failed, 0 skipped");
    // "0" and "" leave the switch off, as in tests/py/conftest.py.
    ASSERT_EQ(run_child("child_skips", "ATOMC_REQUIRE_FIXTURES=0", out, sizeof out), 0);
    ASSERT_STREQ(last_line(out), "0 passed, 0 failed, 1 skipped");
}

TEST(harness_smollm2_unset_or_unreadable_skips) {
    static char out[16384];
    ASSERT_EQ(run_child("child_smollm2", "-u ATOMC_SMOLLM2", out, sizeof out), 0);
    ASSERT_TRUE(strstr(out, "ATOMC_SMOLLM2 is not set") != NULL);
    ASSERT_STREQ(last_line(out), "0 passed, 0 failed, 1 skipped");
    ASSERT_EQ(run_child("child_smollm2", "ATOMC_SMOLLM2=/nonexistent/smollm2.gguf", out, sizeof out), 0);
    ASSERT_TRUE(strstr(out, "/nonexistent/smollm2.gguf cannot be read") != NULL);
    ASSERT_STREQ(last_line(out), "0 passed, 0 failed, 1 skipped");
    ASSERT_EQ(run_child("child_smollm2", "-u ATOMC_SMOLLM2 ATOMC_REQUIRE_FIXTURES=1", out, sizeof out), 1);
    ASSERT_STREQ(last_line(out), "0 passed, 1 failed, 0 skipped");
}

TEST(harness_shared_path_absent_skips) {
    static char out[16384];
    ASSERT_EQ(run_child("child_shared", "", out, sizeof out), 0);
    ASSERT_TRUE(strstr(out, "no/such/thing is absent") != NULL);
    ASSERT_STREQ(last_line(out), "0 passed, 0 failed, 1 skipped");
    ASSERT_EQ(run_child("child_shared", "ATOMC_REQUIRE_FIXTURES=1", out, sizeof out), 1);
    ASSERT_STREQ(last_line(out), "0 passed, 1 failed, 0 skipped");
}

int main(int argc, char **argv) { return test_main(argc, argv); }
