// Interpreter unit tests. Part 1 replays tests/fixtures/template/snippets.json: ~130
// small templates covering every statement, filter, test, string method, operator and
// value form, rendered by Python jinja2 under HF's settings (tools/gen_template_refs.py);
// output must match byte for byte, and where jinja2 failed atomc must fail with the same
// message text. Part 2 checks what the fixtures cannot: line/column in syntax errors,
// limits (steps, output, depth), the strftime_now clock, thread-independent renders.
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "template/chat_template.h"
#include "template/jinja.h"
#include "test.h"

static atomc_status render_src(const char *src, const json_t *vars, const struct jinja_render_options *opt, char **out,
                               struct error *err) {
    struct jinja_template *t;
    atomc_status st = jinja_compile(src, strlen(src), &t, err);
    if (st != ATOMC_OK) return st;
    size_t n;
    st = jinja_render(t, vars, opt, out, &n, err);
    jinja_template_free(t);
    return st;
}

TEST(snippets_match_jinja2) {
    json_error_t je;
    json_t *doc = json_load_file(test_fixture("template/snippets.json"), 0, &je);
    ASSERT_TRUE(doc != NULL);
    json_t *vars = json_object_get(doc, "vars");
    size_t i, bad = 0, n = 0;
    json_t *c;
    json_array_foreach(json_object_get(doc, "snippets"), i, c) {
        n++;
        const char *src = json_string_value(json_object_get(c, "template"));
        const char *want = json_string_value(json_object_get(c, "expected"));
        const char *want_err = json_string_value(json_object_get(c, "error"));
        struct error err = {0};
        char *out = NULL;
        atomc_status st = render_src(src, vars, NULL, &out, &err);
        if (want) {
            if (st != ATOMC_OK) {
                fprintf(stderr, "  [%zu] %s\n    failed: %s\n", i, src, err.msg);
                bad++;
            } else if (strcmp(out, want)) {
                fprintf(stderr, "  [%zu] %s\n    want: %s\n    got:  %s\n", i, src, want, out);
                bad++;
            }
        } else {
            // jinja2's message follows "ExceptionType: "; atomc's message must contain it
            const char *msg = strstr(want_err, ": ");
            msg = msg ? msg + 2 : want_err;
            char core[200];
            snprintf(core, sizeof core, "%s", msg);
            char *dot = strstr(core, ". Please"); // HF's extra advice sentence
            if (dot) *dot = '\0';
            if (st == ATOMC_OK) {
                fprintf(stderr, "  [%zu] %s\n    jinja2 failed (%s) but atomc rendered: %s\n", i, src, want_err, out);
                bad++;
            } else if (!strcasestr(err.msg, core)) {
                fprintf(stderr, "  [%zu] %s\n    want error: %s\n    got error:  %s\n", i, src, want_err, err.msg);
                bad++;
            }
        }
        free(out);
    }
    json_decref(doc);
    ASSERT_TRUE(n >= 100);
    ASSERT_EQ(bad, 0);
}

static void expect_error(const char *src, const char *needle, atomc_status status) {
    struct error err = {0};
    char *out = NULL;
    json_t *vars = json_pack("{s:[i,i]}", "xs", 1, 2);
    atomc_status st = render_src(src, vars, NULL, &out, &err);
    json_decref(vars);
    free(out);
    if (st == ATOMC_OK || !strstr(err.msg, needle) || (status && st != status))
        test_fail(__FILE__, __LINE__, "template %s: want error containing '%s' (status %d), got status %d '%s'", src,
                  needle, status, st, err.msg);
}

TEST(syntax_errors_name_line_and_column) {
    expect_error("line one\n{% if x %}\nno end", "line 3, column 7: unexpected end of template: the 'if' block opened at line 2", ATOMC_ERR_FORMAT);
    expect_error("ok\n\n  {{ 1 + }}", "line 3, column 10", ATOMC_ERR_FORMAT);
    expect_error("{% for x in xs %}{% endif %}", "unexpected 'endif'", ATOMC_ERR_FORMAT);
    expect_error("{% foo %}", "unknown tag 'foo'", ATOMC_ERR_FORMAT);
    expect_error("{{ x | nosuchfilter }}", "no filter named 'nosuchfilter'", ATOMC_ERR_FORMAT);
    expect_error("{{ x is nosuchtest }}", "no test named 'nosuchtest'", ATOMC_ERR_FORMAT);
    expect_error("{{ 'unterminated }}", "unterminated string", ATOMC_ERR_FORMAT);
    expect_error("{# never closed", "missing end of comment", ATOMC_ERR_FORMAT);
    expect_error("{{ x ", "missing '}}'", ATOMC_ERR_FORMAT);
    expect_error("{{ (1 }}", "unexpected '}'", ATOMC_ERR_FORMAT);
    expect_error("{% break %}", "outside of a for loop", ATOMC_ERR_FORMAT);
    expect_error("{{ xs[1, 2:3] }}", "slice cannot be part of a tuple subscript", ATOMC_ERR_FORMAT);
    expect_error("{% include 'x' %}", "not supported", ATOMC_ERR_FORMAT);
    expect_error("{{ 99999999999999999999 }}", "too large", ATOMC_ERR_FORMAT);
    expect_error("\xff\xfe", "not valid UTF-8", ATOMC_ERR_FORMAT);
    // deep nesting is refused at parse time, not by a stack overflow
    char deep[4000];
    size_t k = 0;
    k += (size_t)sprintf(deep, "{{ ");
    for (int i = 0; i < 1000; i++) deep[k++] = '[';
    deep[k] = '\0';
    expect_error(deep, "nested too deeply", ATOMC_ERR_FORMAT);
}

TEST(runtime_errors_name_line) {
    expect_error("a\nb {{ undefined_thing.attr }}", "line 2, column 21: 'undefined_thing' is undefined", 0);
    expect_error("{{ raise_exception('Only user and assistant roles are supported!') }}",
                 "Only user and assistant roles are supported!", ATOMC_ERR_INVALID_ARGUMENT);
}

TEST(limits_stop_runaway_templates) {
    struct jinja_limits lim;
    jinja_limits_init(&lim);
    lim.max_steps = 100000;
    struct jinja_render_options opt = {.limits = &lim};
    struct error err = {0};
    char *out = NULL;
    // nested loops: 1e10 iterations without a step limit
    atomc_status st = render_src("{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
                                 NULL, &opt, &out, &err);
    ASSERT_EQ(st, ATOMC_ERR_TOO_LONG);
    ASSERT_TRUE(strstr(err.msg, "exceeded 100000 steps") != NULL);
    // output size
    lim.max_steps = 50000000;
    lim.max_output_bytes = 1000;
    st = render_src("{% for a in range(2000) %}x{% endfor %}", NULL, &opt, &out, &err);
    ASSERT_EQ(st, ATOMC_ERR_TOO_LONG);
    ASSERT_TRUE(strstr(err.msg, "exceeds 1000 bytes") != NULL);
    // memory: doubling a string
    lim.max_output_bytes = (size_t)1 << 30;
    lim.max_memory_bytes = (size_t)8 << 20;
    st = render_src("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                    "{% endfor %}{{ ns.s | length }}",
                    NULL, &opt, &out, &err);
    ASSERT_EQ(st, ATOMC_ERR_TOO_LONG);
    // unbounded macro recursion
    jinja_limits_init(&lim);
    st = render_src("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, &opt, &out, &err);
    ASSERT_EQ(st, ATOMC_ERR_TOO_LONG);
    if (!strstr(err.msg, "too deep")) fprintf(stderr, "  message: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "too deep") != NULL);
    ASSERT_TRUE(out == NULL);
}

TEST(strftime_now_uses_the_given_clock) {
    struct jinja_render_options opt = {.now = 86400 * 365};
    struct error err = {0};
    char *out = NULL;
    setenv("TZ", "UTC", 1);
    ASSERT_OK(render_src("{{ strftime_now('%d %b %Y') }}", NULL, &opt, &out, &err));
    ASSERT_STREQ(out, "01 Jan 1971");
    free(out);
}

TEST(python_float_repr) {
    struct error err = {0};
    char *out = NULL;
    json_t *vars = json_pack("{s:[f,f,f,f,f,f,f,f]}", "v", 0.1, 100.0, 1e16, 1.5e-5, 123456789012345.6, -2.0, 5e-324,
                             1.7976931348623157e308);
    ASSERT_OK(render_src("{{ v }}|{{ v | tojson }}", vars, NULL, &out, &err));
    ASSERT_STREQ(out, "[0.1, 100.0, 1e+16, 1.5e-05, 123456789012345.6, -2.0, 5e-324, 1.7976931348623157e+308]|"
                      "[0.1, 100.0, 1e+16, 1.5e-05, 123456789012345.6, -2.0, 5e-324, 1.7976931348623157e+308]");
    free(out);
    json_decref(vars);
}

TEST(chat_template_validates_messages) {
    struct chat_template *t;
    struct error err = {0};
    ASSERT_OK(chat_template_compile("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", &t, &err));
    const char *bad[] = {"{}", "[]", "[1]", "[{\"content\":\"x\"}]", "[{\"role\":3}]",
                         "[{\"role\":\"user\",\"content\":5}]", "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]",
                         "[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]",
                         "[{\"role\":\"assistant\",\"tool_calls\":{}}]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *m = json_loads(bad[i], 0, NULL);
        char *out = NULL;
        atomc_status st = chat_template_render(t, m, NULL, false, false, NULL, NULL, NULL, &out, &err);
        if (st != ATOMC_ERR_INVALID_ARGUMENT) test_fail(__FILE__, __LINE__, "accepted bad messages %s", bad[i]);
        free(out);
        json_decref(m);
    }
    json_t *m = json_loads("[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}]", 0, NULL);
    char *out = NULL;
    ASSERT_OK(chat_template_render(t, m, NULL, false, false, NULL, NULL, NULL, &out, &err));
    ASSERT_STREQ(out, "user:a\nb;");
    free(out);
    // kwargs may not replace request fields
    json_t *kw = json_pack("{s:b}", "add_generation_prompt", 1);
    ASSERT_EQ(chat_template_render(t, m, NULL, false, false, kw, NULL, NULL, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(chat_template_render(t, m, NULL, true, true, NULL, NULL, NULL, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    json_decref(kw);
    json_decref(m);
    chat_template_free(t);
}

TEST(render_request_reads_openai_fields) {
    struct chat_template *t;
    struct error err = {0};
    ASSERT_OK(chat_template_compile("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                                    "{% if tools %}T{{ tools | length }}{% endif %}{% if add_generation_prompt %}>{% endif %}"
                                    "{{ enable_thinking }}",
                                    &t, &err));
    json_t *req = json_loads("{\"model\":\"x\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                             "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                             "\"chat_template_kwargs\":{\"enable_thinking\":false}}", 0, NULL);
    char *out = NULL;
    ASSERT_OK(chat_template_render_request(t, req, NULL, NULL, &out, &err));
    ASSERT_STREQ(out, "[user:hi]T1>False");
    free(out);
    json_object_set_new(req, "add_generation_prompt", json_string("yes"));
    ASSERT_EQ(chat_template_render_request(t, req, NULL, NULL, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "add_generation_prompt") != NULL);
    json_object_del(req, "add_generation_prompt");
    json_object_set_new(req, "continue_final_message", json_true());
    json_object_set_new(req, "messages", json_loads("[{\"role\":\"assistant\",\"content\":\"Once upon\"}]", 0, NULL));
    ASSERT_OK(chat_template_render_request(t, req, NULL, NULL, &out, &err));
    ASSERT_STREQ(out, "[assistant:Once upon");
    free(out);
    json_object_set_new(req, "documents", json_integer(3));
    ASSERT_EQ(chat_template_render_request(t, req, NULL, NULL, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    ASSERT_TRUE(strstr(err.msg, "documents") != NULL);
    json_object_del(req, "messages");
    ASSERT_EQ(chat_template_render_request(t, req, NULL, NULL, &out, &err), ATOMC_ERR_INVALID_ARGUMENT);
    json_decref(req);
    chat_template_free(t);
}

struct thread_arg {
    const struct chat_template *t;
    const json_t *messages;
    const char *want;
    int ok;
};

static void *render_many(void *p) {
    struct thread_arg *a = p;
    a->ok = 1;
    for (int i = 0; i < 300; i++) {
        struct error err;
        char *out = NULL;
        if (chat_template_render(a->t, a->messages, NULL, true, false, NULL, "<s>", "</s>", &out, &err) != ATOMC_OK ||
            strcmp(out, a->want))
            a->ok = 0;
        free(out);
    }
    return NULL;
}

TEST(one_template_renders_concurrently) {
    struct chat_template *t;
    struct error err = {0};
    ASSERT_OK(chat_template_compile("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
                                    "{% set ns.n = ns.n + 1 %}{{ m.role | upper }}:{{ m.content | tojson }}{{ ns.n }}"
                                    "{% endfor %}{{ eos_token }}",
                                    &t, &err));
    json_t *msgs[4];
    char want[4][128];
    pthread_t th[4];
    struct thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        msgs[i] = json_pack("[{s:s,s:s+},{s:s,s:s}]", "role", "user", "content", "thread ", i == 0 ? "0" : i == 1 ? "1" : i == 2 ? "2" : "3",
                            "role", "assistant", "content", "ok");
        snprintf(want[i], sizeof want[i], "<s>USER:\"thread %d\"1ASSISTANT:\"ok\"2</s>", i);
        args[i] = (struct thread_arg){t, msgs[i], want[i], 0};
        pthread_create(&th[i], NULL, render_many, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ASSERT_EQ(args[i].ok, 1);
        json_decref(msgs[i]);
    }
    chat_template_free(t);
}

// Inputs the fuzzer found; each once crashed or tripped UBSan.
TEST(fuzz_regressions) {
    const char *cases[] = {"{{ ([] | select) | list }}{{ [] | reverse | list }}{% for x in [] | select %}{% endfor %}",
                           "{{ 'abc'[::2] }}{{ 'abc'[10:2:-2] }}"};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct error err = {0};
        char *out = NULL;
        if (render_src(cases[i], NULL, NULL, &out, &err) != ATOMC_OK)
            test_fail(__FILE__, __LINE__, "%s: %s", cases[i], err.msg);
        free(out);
    }
}

TEST(bos_detection) {
    ASSERT_TRUE(chat_template_starts_with_bos("<s>[INST] hi", "<s>"));
    ASSERT_TRUE(!chat_template_starts_with_bos("[INST] hi", "<s>"));
    ASSERT_TRUE(!chat_template_starts_with_bos("<s>x", ""));
    ASSERT_TRUE(!chat_template_starts_with_bos("<s>x", NULL));
}

int main(int argc, char **argv) { return test_main(argc, argv); }
