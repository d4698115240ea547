// Reasoning parsers (src/server/reasoning_parser.c: deepseek_r1, qwen3, glm45), the harmony parser
// (src/server/harmony.c, GPT-OSS) and the pipeline that chains them with the tool-call parsers
// (src/server/chat_output.c): the expected split of real model outputs, and the same result for
// every way of cutting the text into deltas (every step size, every two-piece cut).
#include <string.h>

#include "server/chat_output.h"
#include "server/harmony.h"
#include "server/reasoning_parser.h"
#include "test.h"

struct split {
    struct tool_text reasoning, content;
    json_t *calls;
};

static const char *str_of(const struct tool_text *t) {
    return t->p ? t->p : "";
}

static void split_free(struct split *s) {
    tool_text_free(&s->reasoning);
    tool_text_free(&s->content);
    json_decref(s->calls);
}

// Cuts: pieces of `step` bytes (0 = whole), or with cut > 0 exactly two pieces [0, cut) [cut, n).
static void run_pipeline(struct split *out, enum reasoning_parser_kind rk, enum tool_parser_kind tk, json_t *tools,
                         const char *prompt, const char *text, size_t step, size_t cut) {
    struct split s = {{0}, {0}, json_array()};
    *out = s;
    struct chat_output o;
    chat_output_init(&o, rk, tk, tools, prompt, strlen(prompt));
    size_t n = strlen(text), i = 0;
    if (cut) {
        chat_output_feed(&o, text, cut, &s.reasoning, &s.content, s.calls);
        chat_output_feed(&o, text + cut, n - cut, &s.reasoning, &s.content, s.calls);
    } else {
        while (i < n) {
            size_t k = step ? (n - i < step ? n - i : step) : n;
            chat_output_feed(&o, text + i, k, &s.reasoning, &s.content, s.calls);
            i += k;
        }
    }
    chat_output_finish(&o, &s.reasoning, &s.content, s.calls);
    *out = s;
    ASSERT_EQ(o.n_calls, (int)json_array_size(s.calls));
    chat_output_free(&o);
}

// The whole text's split, checked to be the same for every step size and every two-piece cut.
static void check_every_split_into(struct split *out, enum reasoning_parser_kind rk, enum tool_parser_kind tk,
                                   json_t *tools, const char *prompt, const char *text) {
    struct split whole;
    run_pipeline(&whole, rk, tk, tools, prompt, text, 0, 0);
    *out = whole;
    size_t n = strlen(text);
    for (size_t step = 1; step <= n; step++) {
        struct split p;
        run_pipeline(&p, rk, tk, tools, prompt, text, step, 0);
        ASSERT_STREQ(str_of(&p.reasoning), str_of(&whole.reasoning));
        ASSERT_STREQ(str_of(&p.content), str_of(&whole.content));
        ASSERT_TRUE(json_equal(p.calls, whole.calls));
        split_free(&p);
    }
    for (size_t cut = 1; cut < n; cut++) {
        struct split p;
        run_pipeline(&p, rk, tk, tools, prompt, text, 0, cut);
        ASSERT_STREQ(str_of(&p.reasoning), str_of(&whole.reasoning));
        ASSERT_STREQ(str_of(&p.content), str_of(&whole.content));
        ASSERT_TRUE(json_equal(p.calls, whole.calls));
        split_free(&p);
    }
}
static struct split check_every_split(enum reasoning_parser_kind rk, enum tool_parser_kind tk, json_t *tools,
                                      const char *prompt, const char *text) {
    struct split s;
    check_every_split_into(&s, rk, tk, tools, prompt, text);
    return s;
}

static const char *call_field(json_t *calls, size_t i, const char *k) {
    return json_string_value(json_object_get(json_object_get(json_array_get(calls, i), "function"), k));
}

static json_t *weather_tools(void) {
    return json_loads(
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"location\":{\"type\":\"string\"}}}}}]",
        0, NULL);
}

// When structured output must wait for the reasoning's end tag (generate.c grammar_after_reasoning).
TEST(reasoning_grammar_waits_for_open_reasoning) {
    const char *open = "<|im_start|>assistant\n<think>\n", *closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n",
               *plain = "<|im_start|>assistant\n";
    ASSERT_TRUE(reasoning_grammar_waits(REASONING_PARSER_QWEN3, open, strlen(open)));
    ASSERT_TRUE(reasoning_grammar_waits(REASONING_PARSER_QWEN3, plain, strlen(plain))); // the model opens it
    ASSERT_TRUE(!reasoning_grammar_waits(REASONING_PARSER_QWEN3, closed, strlen(closed)));
    ASSERT_TRUE(reasoning_grammar_waits(REASONING_PARSER_DEEPSEEK_R1, plain, strlen(plain)));
    ASSERT_TRUE(!reasoning_grammar_waits(REASONING_PARSER_GLM45, closed, strlen(closed)));
    ASSERT_TRUE(!reasoning_grammar_waits(REASONING_PARSER_NONE, open, strlen(open)));
    ASSERT_TRUE(!reasoning_grammar_waits(REASONING_PARSER_OPENAI_GPTOSS, open, strlen(open)));
}

TEST(reasoning_names) {
    ASSERT_EQ(reasoning_parser_from_name("deepseek_r1"), REASONING_PARSER_DEEPSEEK_R1);
    ASSERT_EQ(reasoning_parser_from_name("qwen3"), REASONING_PARSER_QWEN3);
    ASSERT_EQ(reasoning_parser_from_name("glm45"), REASONING_PARSER_GLM45);
    ASSERT_EQ(reasoning_parser_from_name("openai_gptoss"), REASONING_PARSER_OPENAI_GPTOSS);
    ASSERT_EQ(reasoning_parser_from_name("deepseek-r1"), REASONING_PARSER_NONE);
    ASSERT_EQ(reasoning_parser_from_name(NULL), REASONING_PARSER_NONE);
}

// Qwen3 (thinking on): the model writes <think>...</think> itself.
TEST(reasoning_qwen3_think_block) {
    const char *prompt = "<|im_start|>user\nWhat is 9.11 vs 9.8?<|im_end|>\n<|im_start|>assistant\n";
    const char *out = "<think>\nCompare 9.11 and 9.8: 9.8 = 9.80 > 9.11.\n</think>\n\n9.8 is greater.";
    struct split s = check_every_split(REASONING_PARSER_QWEN3, TOOL_PARSER_NONE, NULL, prompt, out);
    ASSERT_STREQ(str_of(&s.reasoning), "\nCompare 9.11 and 9.8: 9.8 = 9.80 > 9.11.\n");
    ASSERT_STREQ(str_of(&s.content), "\n\n9.8 is greater.");
    split_free(&s);
}

// Qwen3 with enable_thinking false: the template wrote an empty think block into the prompt and
// the output is all content, "<" and "</think>"-like text included.
TEST(reasoning_qwen3_thinking_off_is_content) {
    const char *prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    const char *out = "Sure: a < b and <thin> tags stay.";
    struct split s = check_every_split(REASONING_PARSER_QWEN3, TOOL_PARSER_NONE, NULL, prompt, out);
    ASSERT_STREQ(str_of(&s.reasoning), "");
    ASSERT_STREQ(str_of(&s.content), out);
    split_free(&s);
    ASSERT_TRUE(!reasoning_prompt_opens(REASONING_PARSER_QWEN3, prompt, strlen(prompt)));
}

// Qwen3-Thinking-2507 / GLM templates that open <think> in the prompt: the output starts as reasoning.
TEST(reasoning_prompt_opened_think) {
    const char *prompt = "<|im_start|>assistant\n<think>\n";
    ASSERT_TRUE(reasoning_prompt_opens(REASONING_PARSER_QWEN3, prompt, strlen(prompt)));
    const char *out = "Let me think.\n</think>\n\nAnswer: 4";
    struct split s = check_every_split(REASONING_PARSER_QWEN3, TOOL_PARSER_NONE, NULL, prompt, out);
    ASSERT_STREQ(str_of(&s.reasoning), "Let me think.\n");
    ASSERT_STREQ(str_of(&s.content), "\n\nAnswer: 4");
    split_free(&s);
    s = check_every_split(REASONING_PARSER_GLM45, TOOL_PARSER_NONE, NULL, "<|assistant|>\n<think>", "a</think>b");
    ASSERT_STREQ(str_of(&s.reasoning), "a");
    ASSERT_STREQ(str_of(&s.content), "b");
    split_free(&s);
}

// DeepSeek-R1: the template opened <think>; the output is reasoning until </think>; without
// </think> all of it is reasoning; a <think> the model writes anyway is dropped.
TEST(reasoning_deepseek_r1) {
    const char *prompt = "<｜User｜>hi<｜Assistant｜><think>\n";
    struct split s = check_every_split(REASONING_PARSER_DEEPSEEK_R1, TOOL_PARSER_NONE, NULL, prompt,
                                       "Okay, the user greets me.\n</think>\n\nHello! How can I help?");
    ASSERT_STREQ(str_of(&s.reasoning), "Okay, the user greets me.\n");
    ASSERT_STREQ(str_of(&s.content), "\n\nHello! How can I help?");
    split_free(&s);
    s = check_every_split(REASONING_PARSER_DEEPSEEK_R1, TOOL_PARSER_NONE, NULL, "", "<think>\nHmm.</think>Hi");
    ASSERT_STREQ(str_of(&s.reasoning), "\nHmm.");
    ASSERT_STREQ(str_of(&s.content), "Hi");
    split_free(&s);
    s = check_every_split(REASONING_PARSER_DEEPSEEK_R1, TOOL_PARSER_NONE, NULL, "", "still thinking </thi");
    ASSERT_STREQ(str_of(&s.reasoning), "still thinking </thi"); // cut off: a held prefix goes where it was
    ASSERT_STREQ(str_of(&s.content), "");
    split_free(&s);
}

// GLM-4.5: <think>...</think> then content; a tool call after the reasoning goes through the tool parser.
TEST(reasoning_then_tool_call) {
    json_t *tools = weather_tools();
    const char *out = "<think>Need the weather tool.</think>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": "
                      "{\"location\": \"Tokyo\"}}</tool_call>";
    struct split s = check_every_split(REASONING_PARSER_QWEN3, TOOL_PARSER_HERMES, tools, "", out);
    ASSERT_STREQ(str_of(&s.reasoning), "Need the weather tool.");
    ASSERT_STREQ(str_of(&s.content), "\n");
    ASSERT_EQ(json_array_size(s.calls), 1);
    ASSERT_STREQ(call_field(s.calls, 0, "name"), "get_weather");
    ASSERT_STREQ(call_field(s.calls, 0, "arguments"), "{\"location\":\"Tokyo\"}");
    split_free(&s);
    // A <tool_call> inside the reasoning is reasoning text, not a call.
    s = check_every_split(REASONING_PARSER_QWEN3, TOOL_PARSER_HERMES, tools, "",
                          "<think>maybe <tool_call>{\"name\": \"x\"}</tool_call>?</think>no");
    ASSERT_EQ(json_array_size(s.calls), 0);
    ASSERT_STREQ(str_of(&s.content), "no");
    split_free(&s);
    json_decref(tools);
}

// The structured-output hook: "ended" flips at </think> and the callback runs once.
static int end_calls;
static void on_end(void *user) {
    end_calls += *(int *)user;
}

TEST(reasoning_end_hook) {
    struct reasoning_stream r;
    struct tool_text re = {0}, co = {0};
    int one = 1;
    end_calls = 0;
    reasoning_stream_init(&r, REASONING_PARSER_QWEN3, "", 0);
    r.on_end = on_end;
    r.user = &one;
    reasoning_stream_feed(&r, "<think>abc</thi", 15, &re, &co);
    ASSERT_TRUE(!r.ended);
    ASSERT_EQ(end_calls, 0);
    reasoning_stream_feed(&r, "nk>{\"a\":1}", 10, &re, &co);
    ASSERT_TRUE(r.ended);
    ASSERT_EQ(end_calls, 1);
    reasoning_stream_feed(&r, "</think>", 8, &re, &co);
    reasoning_stream_finish(&r, &re, &co);
    ASSERT_EQ(end_calls, 1);
    ASSERT_STREQ(str_of(&re), "abc");
    ASSERT_STREQ(str_of(&co), "{\"a\":1}</think>");
    reasoning_stream_free(&r);
    tool_text_free(&re);
    tool_text_free(&co);
    ASSERT_STREQ(reasoning_end_tag(REASONING_PARSER_DEEPSEEK_R1), "</think>");
}

// ---------------------------------------------------------------- harmony (GPT-OSS)

// Real gpt-oss-20b output shapes (special tokens kept in the text).
static const char HARMONY_FINAL[] =
    "<|channel|>analysis<|message|>User asks: \"What is 2+2?\" Simple arithmetic. Answer 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.";
static const char HARMONY_CALL[] =
    "<|channel|>analysis<|message|>User wants the weather in Tokyo. Use get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    "{\"location\":\"Tokyo\"}<|call|>";

TEST(harmony_reasoning_and_final) {
    struct split s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_NONE, NULL, "", HARMONY_FINAL);
    ASSERT_STREQ(str_of(&s.reasoning), "User asks: \"What is 2+2?\" Simple arithmetic. Answer 4.");
    ASSERT_STREQ(str_of(&s.content), "2 + 2 = **4**.");
    ASSERT_EQ(json_array_size(s.calls), 0);
    split_free(&s);
    // With the terminating <|return|> kept (engine not stopping on it) the result is the same.
    char buf[512];
    snprintf(buf, sizeof buf, "%s<|return|>", HARMONY_FINAL);
    s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_NONE, NULL, "", buf);
    ASSERT_STREQ(str_of(&s.content), "2 + 2 = **4**.");
    split_free(&s);
}

TEST(harmony_tool_call) {
    json_t *tools = weather_tools();
    struct split s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_OPENAI, tools, "", HARMONY_CALL);
    ASSERT_STREQ(str_of(&s.reasoning), "User wants the weather in Tokyo. Use get_weather.");
    ASSERT_STREQ(str_of(&s.content), "");
    ASSERT_EQ(json_array_size(s.calls), 1);
    ASSERT_STREQ(call_field(s.calls, 0, "name"), "get_weather");
    ASSERT_STREQ(call_field(s.calls, 0, "arguments"), "{\"location\":\"Tokyo\"}");
    split_free(&s);
    // The recipient in the role part, " json" content type, no <|call|> (the engine stopped on it),
    // a commentary preamble before the call, and two calls in a row.
    const char *two = "<|channel|>commentary<|message|>Checking both cities.<|end|>"
                      "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                      "{\"location\": \"Paris\"}<|call|><|start|>assistant<|channel|>commentary "
                      "to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Oslo\"}";
    s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_OPENAI, tools, "", two);
    ASSERT_STREQ(str_of(&s.reasoning), "");
    ASSERT_STREQ(str_of(&s.content), "Checking both cities.");
    ASSERT_EQ(json_array_size(s.calls), 2);
    ASSERT_STREQ(call_field(s.calls, 0, "arguments"), "{\"location\": \"Paris\"}");
    ASSERT_STREQ(call_field(s.calls, 1, "arguments"), "{\"location\": \"Oslo\"}");
    split_free(&s);
    // Without tools in the request a call is not reported; without the reasoning parser the
    // analysis channel is not shown.
    s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_OPENAI, NULL, "", HARMONY_CALL);
    ASSERT_EQ(json_array_size(s.calls), 0);
    split_free(&s);
    s = check_every_split(REASONING_PARSER_NONE, TOOL_PARSER_OPENAI, tools, "", HARMONY_CALL);
    ASSERT_STREQ(str_of(&s.reasoning), "");
    ASSERT_EQ(json_array_size(s.calls), 1);
    split_free(&s);
    json_decref(tools);
}

TEST(harmony_builtin_tools_dropped_and_plain_text_kept) {
    const char *browse = "<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis "
                         "to=browser.search code<|message|>{\"query\": \"x\"}<|call|>";
    json_t *tools = weather_tools();
    struct split s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_OPENAI, tools, "", browse);
    ASSERT_STREQ(str_of(&s.reasoning), "Search.");
    ASSERT_EQ(json_array_size(s.calls), 0);
    ASSERT_STREQ(str_of(&s.content), "");
    split_free(&s);
    s = check_every_split(REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_NONE, NULL, "", "Just plain text.");
    ASSERT_STREQ(str_of(&s.content), "Just plain text.");
    split_free(&s);
    json_decref(tools);
}

TEST(harmony_reasoning_end_flag) {
    struct chat_output o;
    struct tool_text re = {0}, co = {0};
    json_t *calls = json_array();
    chat_output_init(&o, REASONING_PARSER_OPENAI_GPTOSS, TOOL_PARSER_NONE, NULL, "", 0);
    ASSERT_TRUE(chat_output_needs_special_tokens(&o));
    chat_output_feed(&o, HARMONY_FINAL, 60, &re, &co, calls);
    ASSERT_TRUE(!chat_output_reasoning_ended(&o));
    chat_output_feed(&o, HARMONY_FINAL + 60, strlen(HARMONY_FINAL) - 60, &re, &co, calls);
    ASSERT_TRUE(chat_output_reasoning_ended(&o));
    chat_output_finish(&o, &re, &co, calls);
    chat_output_free(&o);
    tool_text_free(&re);
    tool_text_free(&co);
    json_decref(calls);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
