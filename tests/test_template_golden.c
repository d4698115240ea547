// Golden chat-template tests: every conversation in tests/fixtures/template/*_cases.json
// (made by tools/gen_template_refs.py with Python jinja2 under HF's settings) must render
// byte-identical with atomc's interpreter, or fail where jinja2 failed.
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "template/chat_template.h"
#include "test.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = '\0';
    fclose(f);
    return s;
}

// Prints the first differing position with some context.
static void show_diff(const char *name, const char *want, const char *got) {
    size_t i = 0;
    while (want[i] && want[i] == got[i]) i++;
    size_t from = i > 40 ? i - 40 : 0;
    fprintf(stderr, "  case %s differs at byte %zu\n    want: ...%.80s\n    got:  ...%.80s\n", name, i, want + from,
            got + from);
}

static int run_golden(const char *model) {
    char path[512];
    snprintf(path, sizeof path, "template/%s_cases.json", model);
    json_error_t je;
    json_t *doc = json_load_file(test_fixture(path), 0, &je);
    if (!doc) {
        fprintf(stderr, "  cannot load %s: %s\n", test_fixture(path), je.text);
        return -1;
    }
    snprintf(path, sizeof path, "template/%s", json_string_value(json_object_get(doc, "template_file")));
    char *src = slurp(test_fixture(path));
    if (!src) {
        json_decref(doc);
        return -1;
    }
    struct error err = {0};
    struct chat_template *t = NULL;
    int failures = 0;
    if (chat_template_compile(src, &t, &err) != ATOMC_OK) {
        fprintf(stderr, "  compile %s: %s\n", model, err.msg);
        failures = 1000;
    }
    const char *bos = json_string_value(json_object_get(doc, "bos_token"));
    const char *eos = json_string_value(json_object_get(doc, "eos_token"));
    size_t i, n_cases = 0;
    json_t *c;
    json_array_foreach(t ? json_object_get(doc, "cases") : NULL, i, c) {
        n_cases++;
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *tools = json_object_get(c, "tools");
        char *out = NULL;
        atomc_status st = chat_template_render(
            t, json_object_get(c, "messages"), tools, json_is_true(json_object_get(c, "add_generation_prompt")),
            json_is_true(json_object_get(c, "continue_final_message")), json_object_get(c, "kwargs"), bos, eos, &out,
            &err);
        json_t *expected = json_object_get(c, "expected");
        if (expected) {
            if (st != ATOMC_OK) {
                fprintf(stderr, "  case %s: render failed: %s\n", name, err.msg);
                failures++;
            } else if (strcmp(out, json_string_value(expected))) {
                show_diff(name, json_string_value(expected), out);
                failures++;
            }
        } else if (st == ATOMC_OK) {
            fprintf(stderr, "  case %s: jinja2 failed (%s) but atomc rendered\n", name,
                    json_string_value(json_object_get(c, "error")));
            failures++;
        }
        free(out);
    }
    if (n_cases < 30) {
        fprintf(stderr, "  %s: only %zu cases\n", model, n_cases);
        failures++;
    }
    chat_template_free(t);
    free(src);
    json_decref(doc);
    return failures;
}

TEST(golden_llama3) { ASSERT_EQ(run_golden("llama3"), 0); }
TEST(golden_qwen3) { ASSERT_EQ(run_golden("qwen3"), 0); }
TEST(golden_deepseek_v3) { ASSERT_EQ(run_golden("deepseek_v3"), 0); }
TEST(golden_smollm2) { ASSERT_EQ(run_golden("smollm2"), 0); }

int main(int argc, char **argv) { return test_main(argc, argv); }
