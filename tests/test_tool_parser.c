// Tool-call parsers (src/server/tool_parser.c, every format it reads): whole-text and incremental parsing agree
// for every split of the input, tags split across deltas are held back and never leak as
// content, malformed or unterminated blocks come back as content.
#include <string.h>

#include "server/tool_parser.h"
#include "test.h"

struct parsed {
    struct tool_text content;
    json_t *calls;
};

static json_t *test_tools; // the request's tools for typed formats (qwen3_coder, glm45)

// Feeds `text` in pieces of `step` bytes (0 = all at once); *max_held gets the most bytes held back
// at any point while not inside a call.
static struct parsed parse_steps_kind(enum tool_parser_kind kind, const char *text, size_t step, size_t *max_held) {
    struct parsed r = {{0}, json_array()};
    struct tool_stream t;
    tool_stream_init(&t, kind);
    tool_stream_set_tools(&t, test_tools);
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
    ASSERT_EQ(tool_parser_from_name("mistral"), TOOL_PARSER_MISTRAL);
    ASSERT_EQ(tool_parser_from_name("pythonic"), TOOL_PARSER_PYTHONIC);
    ASSERT_EQ(tool_parser_from_name("deepseek_v3"), TOOL_PARSER_DEEPSEEK_V3);
    ASSERT_EQ(tool_parser_from_name("kimi_k2"), TOOL_PARSER_KIMI_K2);
    ASSERT_EQ(tool_parser_from_name("qwen3_coder"), TOOL_PARSER_QWEN3_CODER);
    ASSERT_EQ(tool_parser_from_name("glm45"), TOOL_PARSER_GLM45);
    ASSERT_EQ(tool_parser_from_name("openai"), TOOL_PARSER_OPENAI);
    ASSERT_EQ(tool_parser_from_name("granite"), TOOL_PARSER_NONE);
    ASSERT_EQ(tool_parser_from_name(NULL), TOOL_PARSER_NONE);
    ASSERT_TRUE(tool_parser_needs_special_tokens(TOOL_PARSER_MISTRAL));
    ASSERT_TRUE(!tool_parser_needs_special_tokens(TOOL_PARSER_DEEPSEEK_V3));
}

// ---------------------------------------------------------------- more formats (real samples)

// Every step size and every two-piece cut give the calls and content of the whole text.
static void check_every_cut(enum tool_parser_kind kind, const char *text) {
    check_splits_kind(kind, text);
    struct parsed whole = parse_steps_kind(kind, text, 0, NULL);
    size_t n = strlen(text);
    for (size_t cut = 1; cut < n; cut++) {
        struct parsed p = {{0}, json_array()};
        struct tool_stream t;
        tool_stream_init(&t, kind);
        tool_stream_set_tools(&t, test_tools);
        tool_stream_feed(&t, text, cut, &p.content, p.calls);
        tool_stream_feed(&t, text + cut, n - cut, &p.content, p.calls);
        tool_stream_finish(&t, &p.content);
        ASSERT_EQ(t.n_calls, (int)json_array_size(p.calls));
        tool_stream_free(&t);
        ASSERT_STREQ(content_of(&p), content_of(&whole));
        ASSERT_TRUE(json_equal(p.calls, whole.calls));
        parsed_free(&p);
    }
    parsed_free(&whole);
}

static struct parsed parse_whole(enum tool_parser_kind kind, const char *text) {
    check_every_cut(kind, text);
    return parse_steps_kind(kind, text, 0, NULL);
}

TEST(tool_parser_mistral) {
    // Mistral-7B-Instruct-v0.3 (tokenizer v3): a JSON list after [TOOL_CALLS].
    struct parsed p =
        parse_whole(TOOL_PARSER_MISTRAL,
                    "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\": {\"location\": "
                    "\"Paris, France\", \"format\": \"celsius\"}}, {\"name\": \"get_time\", \"arguments\": {}}]");
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_name(p.calls, 0), "get_current_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"location\":\"Paris, France\",\"format\":\"celsius\"}");
    ASSERT_STREQ(call_name(p.calls, 1), "get_time");
    ASSERT_STREQ(content_of(&p), "");
    parsed_free(&p);
    // Mistral-Small-3.2 / Magistral (tokenizer v11+): NAME[ARGS]{...} per [TOOL_CALLS], content before.
    p = parse_whole(TOOL_PARSER_MISTRAL, "Checking.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}"
                                         "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{\"tz\": \"CET\"}");
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"city\":\"Paris\"}");
    ASSERT_STREQ(call_name(p.calls, 1), "get_time");
    ASSERT_STREQ(call_args(p.calls, 1), "{\"tz\":\"CET\"}");
    ASSERT_STREQ(content_of(&p), "Checking.");
    parsed_free(&p);
    // Not calls after the marker: everything from it is content.
    p = parse_whole(TOOL_PARSER_MISTRAL, "a [TOOL_CALLS] {broken");
    ASSERT_EQ(json_array_size(p.calls), 0);
    ASSERT_STREQ(content_of(&p), "a [TOOL_CALLS] {broken");
    parsed_free(&p);
    p = parse_whole(TOOL_PARSER_MISTRAL, "No tools [TOOL here].");
    ASSERT_STREQ(content_of(&p), "No tools [TOOL here].");
    parsed_free(&p);
}

TEST(tool_parser_pythonic) {
    // Llama-3.2 pythonic calls, Python literals of every kind.
    struct parsed p =
        parse_whole(TOOL_PARSER_PYTHONIC,
                    "[get_weather(city='San Francisco', metric=\"celsius\"), get_time(tz=\"PST\", precise=True, "
                    "n=3, x=-1.5, tags=['a', \"b\"], opts={'k': None, 'q': 'it\\'s'}, t=(1, 2))]");
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"city\":\"San Francisco\",\"metric\":\"celsius\"}");
    ASSERT_STREQ(call_name(p.calls, 1), "get_time");
    ASSERT_STREQ(call_args(p.calls, 1), "{\"tz\":\"PST\",\"precise\":true,\"n\":3,\"x\":-1.5,\"tags\":[\"a\",\"b\"],"
                                        "\"opts\":{\"k\":null,\"q\":\"it's\"},\"t\":[1,2]}");
    ASSERT_STREQ(content_of(&p), "");
    parsed_free(&p);
    // Llama 4 wraps them; no arguments is fine.
    p = parse_whole(TOOL_PARSER_PYTHONIC, "<|python_start|>[refresh()]<|python_end|>");
    ASSERT_EQ(json_array_size(p.calls), 1);
    ASSERT_STREQ(call_args(p.calls, 0), "{}");
    ASSERT_STREQ(content_of(&p), "");
    parsed_free(&p);
    // Plain text, a list that is not calls, and an unfinished list are content.
    const char *plain[] = {"The answer is [4].", "[1, 2, 3]", "[f(a=1), g(b=", "[f(a=undefined_name)]"};
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        p = parse_whole(TOOL_PARSER_PYTHONIC, plain[i]);
        ASSERT_EQ(json_array_size(p.calls), 0);
        ASSERT_STREQ(content_of(&p), plain[i]);
        parsed_free(&p);
    }
}

TEST(tool_parser_deepseek_v3) {
    // Exactly what the DeepSeek-V3 chat template writes for two calls (shared/tokenizers/deepseek_v3).
    const char *v3 =
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        "{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
        "```json\n{\"tz\": \"JST\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    struct parsed p = parse_whole(TOOL_PARSER_DEEPSEEK_V3, v3);
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"location\":\"Tokyo\"}");
    ASSERT_STREQ(call_name(p.calls, 1), "get_time");
    ASSERT_STREQ(call_args(p.calls, 1), "{\"tz\":\"JST\"}");
    ASSERT_STREQ(content_of(&p), "Let me look.");
    parsed_free(&p);
    // DeepSeek-V3.1: NAME<｜tool▁sep｜>ARGS.
    p = parse_whole(TOOL_PARSER_DEEPSEEK_V3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                                             "{\"location\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
    ASSERT_EQ(json_array_size(p.calls), 1);
    ASSERT_STREQ(call_args(p.calls, 0), "{\"location\":\"Oslo\"}");
    parsed_free(&p);
    // A body that is not a call is content, tags included.
    p = parse_whole(TOOL_PARSER_DEEPSEEK_V3, "<｜tool▁call▁begin｜>nonsense<｜tool▁call▁end｜>");
    ASSERT_EQ(json_array_size(p.calls), 0);
    ASSERT_STREQ(content_of(&p), "<｜tool▁call▁begin｜>nonsense<｜tool▁call▁end｜>");
    parsed_free(&p);
}

TEST(tool_parser_kimi_k2) {
    const char *t = "I'll check both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                    "<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|><|tool_call_begin|>"
                    "functions.get_time:1<|tool_call_argument_begin|>{\"tz\": \"Asia/Shanghai\"}<|tool_call_end|>"
                    "<|tool_calls_section_end|>";
    struct parsed p = parse_whole(TOOL_PARSER_KIMI_K2, t);
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    ASSERT_STREQ(call_args(p.calls, 0), "{\"city\":\"Beijing\"}");
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(p.calls, 0), "id")), "functions.get_weather:0");
    ASSERT_STREQ(call_name(p.calls, 1), "get_time");
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(p.calls, 1), "id")), "functions.get_time:1");
    ASSERT_STREQ(content_of(&p), "I'll check both.");
    parsed_free(&p);
}

TEST(tool_parser_qwen3_coder) {
    test_tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{"
                            "\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":"
                            "\"integer\"},\"detailed\":{\"type\":\"boolean\"},\"note\":{\"type\":\"string\"},\"opts\":{"
                            "\"type\":\"object\"}}}}}]",
                            0, NULL);
    const char *t =
        "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n<parameter=note>\n42\n"
        "</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
        "</function>\n</tool_call>";
    struct parsed p = parse_whole(TOOL_PARSER_QWEN3_CODER, t);
    ASSERT_EQ(json_array_size(p.calls), 1);
    ASSERT_STREQ(call_name(p.calls, 0), "get_weather");
    // Typed by the schema; "note" stays a string; the unknown "extra" is a string.
    ASSERT_STREQ(
        call_args(p.calls, 0),
        "{\"city\":\"New York\",\"days\":3,\"detailed\":true,\"note\":\"42\",\"opts\":{\"a\":[1]},\"extra\":\"7\"}");
    ASSERT_STREQ(content_of(&p), "I will check.\n");
    parsed_free(&p);
    // GLM-4.5 / 4.7 (arg_key / arg_value) against the same tools.
    p = parse_whole(TOOL_PARSER_GLM45,
                    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><tool_call>get_weather"
                    "<arg_key>city</arg_key><arg_value>2024</arg_value><arg_key>flag</arg_key><arg_value>"
                    "true</arg_value></tool_call>");
    ASSERT_EQ(json_array_size(p.calls), 2);
    ASSERT_STREQ(call_args(p.calls, 0), "{\"city\":\"Beijing\",\"days\":2}");
    ASSERT_STREQ(call_args(p.calls, 1), "{\"city\":\"2024\",\"flag\":true}"); // unknown "flag": JSON
    ASSERT_STREQ(content_of(&p), "");
    parsed_free(&p);
    // No function / no name: content.
    p = parse_whole(TOOL_PARSER_QWEN3_CODER, "<tool_call>plain</tool_call>");
    ASSERT_EQ(json_array_size(p.calls), 0);
    ASSERT_STREQ(content_of(&p), "<tool_call>plain</tool_call>");
    parsed_free(&p);
    json_decref(test_tools);
    test_tools = NULL;
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
