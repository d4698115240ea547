// Tool-call parsers (src/server/tool_parser.c, hermes and llama3_json): whole-text and incremental parsing agree
// for every split of the input, tags split across deltas are held back and never leak as
// content, malformed or unterminated blocks come back as content.
#include <string.h>

#include "server/tool_parser.h"
#include "test.h"

struct parsed {
    struct tool_text content;
    json_t *calls;
};

// Feeds `text` in pieces of `step` bytes (0 = all at once); *max_held gets the most bytes held back
// at any point while not inside a call.
static struct parsed parse_steps_kind(enum tool_parser_kind kind, const char *text, size_t step, size_t *max_held) {
    struct parsed r = {{0}, json_array()};
    struct tool_stream t;
    tool_stream_init(&t, kind);
    size_t n = strlen(text), i = 0;
    if (max_held) *max_held = 0;
    while (i < n) {
        size_t k = step ? (n - i < step ? n - i : step) : n;
        tool_stream_feed(&t, text + i, k, &r.content, r.calls);
        if (max_held && !t.in_call && t.held.len > *max_held) *max_held = t.held.len;
        i += k;
    }
    tool_stream_finish(&t, &r.content);
    tool_stream_free(&t);
    return r;
}

static struct parsed parse_steps(const char *text, size_t step, size_t *max_held) {
    return parse_steps_kind(TOOL_PARSER_HERMES, text, step, max_held);
}

static const char *content_of(struct parsed *p) {
    return p->content.p ? p->content.p : "";
}

static void parsed_free(struct parsed *p) {
    tool_text_free(&p->content);
    json_decref(p->calls);
}

static const char *call_name(json_t *calls, size_t i) {
    return json_string_value(json_object_get(json_object_get(json_array_get(calls, i), "function"), "name"));
}
static const char *call_args(json_t *calls, size_t i) {
    return json_string_value(json_object_get(json_object_get(json_array_get(calls, i), "function"), "arguments"));
}

// Every split size gives the same content and calls as the whole text.
static void check_splits_kind(enum tool_parser_kind kind, const char *text) {
    struct parsed whole = parse_steps_kind(kind, text, 0, NULL);
    for (size_t step = 1; step <= strlen(text); step++) {
        struct parsed p = parse_steps_kind(kind, text, step, NULL);
        ASSERT_STREQ(content_of(&p), content_of(&whole));
        ASSERT_TRUE(json_equal(p.calls, whole.calls));
        parsed_free(&p);
    }
    parsed_free(&whole);
}

static void check_all_splits(const char *text) {
    check_splits_kind(TOOL_PARSER_HERMES, text);
}
static void check_all_splits_l3(const char *text) {
    check_splits_kind(TOOL_PARSER_LLAMA3_JSON, text);
}

TEST(tool_parser_plain_text_passes_through) {
    struct parsed p = parse_steps("The weather is nice. a < b, <tool is not a tag", 0, NULL);
    ASSERT_STREQ(content_of(&p), "The weather is nice. a < b, <tool is not a tag");
    ASSERT_EQ(json_array_size(p.calls), 0);
    parsed_free(&p);
    check_all_splits("The weather is nice. a < b, <tool is not a tag");
}

TEST(tool_parser_one_call_with_leading_content) {
    const char *t = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                    "\"unit\": \"°C\"}}\n</tool_call>";
    struct parsed p = parse_steps(t, 0, NULL);
    ASSERT_STREQ(content_of(&p), "Let me check.\n");
    ASSERT_EQ(json_array_size(p.calls), 1);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"city\":\"Paris\",\"unit\":\"°C\"}"); // compact, UTF-8 kept
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(p.calls, 0), "type")), "function");
    parsed_free(&p);
    check_all_splits(t);
}

TEST(tool_parser_parallel_calls_and_string_arguments) {
    const char *t = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", "
                    "\"arguments\": \"{\\\"x\\\": 1}\"}</tool_call><tool_call>{\"name\": \"c\"}</tool_call>";
    struct parsed p = parse_steps(t, 0, NULL);
    ASSERT_EQ(json_array_size(p.calls), 3);
    ASSERT_STREQ(call_name(p.calls, 0), "a");
    ASSERT_STREQ(call_args(p.calls, 0), "{}");
    ASSERT_STREQ(call_args(p.calls, 1), "{\"x\": 1}"); // a string is passed through
    ASSERT_STREQ(call_args(p.calls, 2), "{}");         // missing arguments
    ASSERT_STREQ(content_of(&p), "\n");
    parsed_free(&p);
    check_all_splits(t);
}

static void feed_str(struct tool_stream *t, const char *s, struct tool_text *c, json_t *calls) {
    tool_stream_feed(t, s, strlen(s), c, calls);
}

TEST(tool_parser_holds_back_only_tag_prefixes) {
    size_t held;
    // While streaming, at most a proper prefix of "<tool_call>" (10 bytes) is ever held back.
    struct parsed p = parse_steps("abc <tool_ca", 1, &held);
    ASSERT_TRUE(held <= 10);
    ASSERT_STREQ(content_of(&p), "abc <tool_ca"); // released at the end
    parsed_free(&p);
    struct tool_stream t;
    struct tool_text c = {0};
    json_t *calls = json_array();
    tool_stream_init(&t, TOOL_PARSER_HERMES);
    feed_str(&t, "hello <tool", &c, calls);
    ASSERT_STREQ(c.p, "hello ");
    feed_str(&t, "box", &c, calls); // not a tag after all: released
    ASSERT_STREQ(c.p, "hello <toolbox");
    feed_str(&t, " <tool_call>{\"name\": \"f\", \"argu", &c, calls);
    ASSERT_STREQ(c.p, "hello <toolbox ");
    ASSERT_EQ(json_array_size(calls), 0);
    feed_str(&t, "ments\": {\"k\": [1, 2]}}</tool_", &c, calls);
    ASSERT_EQ(json_array_size(calls), 0);
    feed_str(&t, "call> done", &c, calls);
    ASSERT_EQ(json_array_size(calls), 1);
    ASSERT_STREQ(call_args(calls, 0), "{\"k\":[1,2]}");
    ASSERT_STREQ(c.p, "hello <toolbox  done");
    ASSERT_EQ(t.n_calls, 1);
    tool_stream_finish(&t, &c);
    tool_stream_free(&t);
    tool_text_free(&c);
    json_decref(calls);
}

TEST(tool_parser_malformed_and_unterminated_blocks_are_content) {
    const char *bad = "x<tool_call>{not json}</tool_call>y<tool_call>[1, 2]</tool_call>z"
                      "<tool_call>{\"arguments\": {}}</tool_call>";
    struct parsed p = parse_steps(bad, 0, NULL);
    ASSERT_EQ(json_array_size(p.calls), 0);
    ASSERT_STREQ(content_of(&p), bad);
    parsed_free(&p);
    check_all_splits(bad);
    const char *cut = "ok <tool_call>{\"name\": \"f\", \"arguments\": {\"a\"";
    p = parse_steps(cut, 0, NULL);
    ASSERT_EQ(json_array_size(p.calls), 0);
    ASSERT_STREQ(content_of(&p), cut);
    parsed_free(&p);
    check_all_splits(cut);
}

TEST(tool_parser_llama3_json_calls) {
    const char *one = "  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    struct parsed p = parse_steps_kind(TOOL_PARSER_LLAMA3_JSON, one, 0, NULL);
    ASSERT_EQ(json_array_size(p.calls), 1);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"city\":\"Paris\"}"); // "parameters" read as the arguments
    ASSERT_STREQ(content_of(&p), "");
    parsed_free(&p);
    check_all_splits_l3(one);
    const char *two = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": "
                      "{\"s\": \"x;}{\"}}\n";
    p = parse_steps_kind(TOOL_PARSER_LLAMA3_JSON, two, 0, NULL);
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_name(p.calls, 1), "b");
    ASSERT_STREQ(call_args(p.calls, 1), "{\"s\":\"x;}{\"}"); // separators inside strings are data
    ASSERT_STREQ(content_of(&p), "\n");
    parsed_free(&p);
    check_all_splits_l3(two);
}

TEST(tool_parser_llama3_json_plain_and_broken_outputs_are_content) {
    const char *texts[] = {
        "The answer is {42}.",                      // does not start with an object
        "{\"name\": 7, \"parameters\": {}}",        // not a call
        "{\"name\": \"f\", \"parameters\": {\"a\"", // cut off
        "<|python_ta",                              // a tag prefix, then the end
        "{not json} at all",                        // invalid
    };
    for (int i = 0; i < 5; i++) {
        struct parsed p = parse_steps_kind(TOOL_PARSER_LLAMA3_JSON, texts[i], 0, NULL);
        ASSERT_EQ(json_array_size(p.calls), 0);
        ASSERT_STREQ(content_of(&p), texts[i]);
        parsed_free(&p);
        check_all_splits_l3(texts[i]);
    }
    // A call followed by prose: the call, then the prose as content.
    struct parsed p = parse_steps_kind(TOOL_PARSER_LLAMA3_JSON, "{\"name\": \"f\"} ok", 0, NULL);
    ASSERT_EQ(json_array_size(p.calls), 1);
    ASSERT_STREQ(content_of(&p), "ok");
    parsed_free(&p);
}

TEST(tool_parser_names) {
    ASSERT_EQ(tool_parser_from_name("hermes"), TOOL_PARSER_HERMES);
    ASSERT_EQ(tool_parser_from_name("llama3_json"), TOOL_PARSER_LLAMA3_JSON);
    ASSERT_EQ(tool_parser_from_name("mistral"), TOOL_PARSER_NONE);
    ASSERT_EQ(tool_parser_from_name(NULL), TOOL_PARSER_NONE);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
