// OpenAI request validation (src/server/openai_request.c), response shapes
// (openai_response.c) and Prometheus rendering (metrics.c): pure functions, no sockets.
#include <jansson.h>
#include <stddef.h>
#include <stdlib.h>

#include "server/metrics.h"
#include "server/openai_request.h"
#include "server/openai_response.h"
#include "test.h"

static struct oai_limits lim(void) {
    struct oai_limits l;
    oai_limits_init(&l, 1000);
    return l;
}

static int parse(enum oai_endpoint ep, const char *body, struct oai_request *r, struct oai_error *e) {
    struct oai_limits l = lim();
    return oai_request_parse(ep, body, strlen(body), &l, r, e);
}

// Expects a 400 whose param names `param` and whose message contains `part`.
static int rejects(enum oai_endpoint ep, const char *body, const char *param, const char *part) {
    struct oai_request r;
    struct oai_error e;
    memset(&e, 0, sizeof e);
    int rc = parse(ep, body, &r, &e);
    oai_request_free(&r);
    if (rc == 0) {
        fprintf(stderr, "  accepted: %s\n", body);
        return 0;
    }
    if (e.http_status != 400 || (param && strcmp(e.param, param)) || (part && !strstr(e.message, part))) {
        fprintf(stderr, "  %s -> %d param=%s msg=%s\n", body, e.http_status, e.param, e.message);
        return 0;
    }
    return 1;
}

TEST(completion_defaults_and_fields) {
    struct oai_request r;
    struct oai_error e;
    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS,
                    "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,"
                    "\"top_k\":40,\"min_p\":0.1,\"seed\":42,\"stop\":[\"a\",\"bc\"],\"stop_token_ids\":[2,3],"
                    "\"n\":3,\"logprobs\":5,\"echo\":true,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,"
                    "\"repetition_penalty\":1.1,\"ignore_eos\":true,\"min_tokens\":2,\"user\":\"u\","
                    "\"include_stop_str_in_output\":true,\"skip_special_tokens\":false,\"stream\":null}",
                    &r, &e));
    ASSERT_STREQ(r.model, "m");
    ASSERT_EQ(r.n_prompts, 1);
    ASSERT_STREQ(r.prompts[0].text, "hi");
    ASSERT_EQ(r.params.max_tokens, 7);
    ASSERT_NEAR(r.params.temperature, 0.5, 1e-6);
    ASSERT_NEAR(r.params.top_p, 0.9, 1e-6);
    ASSERT_EQ(r.params.top_k, 40);
    ASSERT_TRUE(r.params.has_seed);
    ASSERT_EQ(r.params.seed, 42);
    ASSERT_EQ(r.params.n_stop, 2);
    ASSERT_STREQ(r.params.stop[1], "bc");
    ASSERT_EQ(r.params.n_stop_token_ids, 2);
    ASSERT_EQ(r.n, 3);
    ASSERT_EQ(r.params.logprobs, 5);
    ASSERT_EQ(r.params.prompt_logprobs, 5); // echo + logprobs -> prompt logprobs
    ASSERT_TRUE(r.params.ignore_eos && r.params.include_stop_str_in_output && !r.params.skip_special_tokens);
    ASSERT_TRUE(!r.stream && r.add_special_tokens);
    oai_request_free(&r);

    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":\"x\"}", &r, &e));
    ASSERT_EQ(r.params.max_tokens, 16); // OpenAI's completions default
    ASSERT_TRUE(!r.max_tokens_set);
    ASSERT_NEAR(r.params.temperature, 1.0, 0);
    ASSERT_NEAR(r.params.repetition_penalty, 1.0, 0);
    ASSERT_EQ(r.params.logprobs, -1);
    ASSERT_EQ(r.params.prompt_logprobs, -1);
    ASSERT_TRUE(r.params.skip_special_tokens);
    oai_request_free(&r);
}

// The parser sets sampling defaults itself; they must be the engine's.
TEST(parser_defaults_match_engine_defaults) {
    struct oai_request r;
    struct oai_error e;
    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":\"x\"}", &r, &e));
    atomc_sampling_params d;
    atomc_sampling_params_init(&d);
    ASSERT_NEAR(r.params.temperature, d.temperature, 0);
    ASSERT_NEAR(r.params.top_p, d.top_p, 0);
    ASSERT_EQ(r.params.top_k, d.top_k);
    ASSERT_NEAR(r.params.min_p, d.min_p, 0);
    ASSERT_NEAR(r.params.repetition_penalty, d.repetition_penalty, 0);
    ASSERT_NEAR(r.params.presence_penalty, d.presence_penalty, 0);
    ASSERT_NEAR(r.params.frequency_penalty, d.frequency_penalty, 0);
    ASSERT_EQ(r.params.max_tokens, d.max_tokens);
    ASSERT_EQ(r.params.min_tokens, d.min_tokens);
    ASSERT_EQ(r.params.skip_special_tokens, d.skip_special_tokens);
    ASSERT_EQ(r.params.ignore_eos, d.ignore_eos);
    ASSERT_EQ(r.params.logprobs, d.logprobs);
    ASSERT_EQ(r.params.prompt_logprobs, d.prompt_logprobs);
    ASSERT_EQ(r.params.has_seed, d.has_seed);
    oai_request_free(&r);
}

TEST(prompt_forms) {
    struct oai_request r;
    struct oai_error e;
    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"]}", &r, &e));
    ASSERT_EQ(r.n_prompts, 2);
    ASSERT_STREQ(r.prompts[1].text, "b");
    oai_request_free(&r);
    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[1,2,3]}", &r, &e));
    ASSERT_EQ(r.n_prompts, 1);
    ASSERT_EQ(r.prompts[0].n_ids, 3);
    ASSERT_EQ(r.prompts[0].ids[2], 3);
    oai_request_free(&r);
    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[[1],[4,5]]}", &r, &e));
    ASSERT_EQ(r.n_prompts, 2);
    ASSERT_EQ(r.prompts[1].ids[1], 5);
    oai_request_free(&r);
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[]}", "prompt", "empty"));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[1000]}", "prompt", "out of range"));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[-1]}", "prompt", "out of range"));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[\"a\",[1]]}", "prompt", "mix"));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":[1.5]}", "prompt", NULL));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":{}}", "prompt", NULL));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":\"a\\u0000b\"}", NULL, "u0000"));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_COMPLETIONS, "{}", "prompt", "required"));
}

TEST(ranges_types_and_unknown_fields) {
    const enum oai_endpoint C = OAI_ENDPOINT_COMPLETIONS, CH = OAI_ENDPOINT_CHAT;
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":-0.1}", "temperature", ">= 0"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", "temperature", "number"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_p\":0}", "top_p", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_p\":1.5}", "top_p", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"min_p\":2}", "min_p", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_k\":-2}", "top_k", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"n\":0}", "n", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"n\":100000}", "n", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"n\":true}", "n", "integer"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"max_tokens\":0}", "max_tokens", "echo"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"max_tokens\":-5}", "max_tokens", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"max_tokens\":99999999999}", "max_tokens", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"logprobs\":21}", "logprobs", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"presence_penalty\":3}", "presence_penalty", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"repetition_penalty\":0}", "repetition_penalty", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"stop\":\"\"}", "stop", "empty"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"stop\":[1]}", "stop", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"stop_token_ids\":[5000]}", "stop_token_ids", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"min_tokens\":5,\"max_tokens\":2}", "min_tokens", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", "stream_options", "stream"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"best_of\":3}", "best_of", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"logit_bias\":{\"5\":1}}", "logit_bias", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"suffix\":\"s\"}", "suffix", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"frobnicate\":1}", "frobnicate", "unsupported field"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"messages\":[]}", "messages", "unsupported field"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":true}", "echo", "unsupported"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":3}", "top_logprobs", "logprobs"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"always\"}", "tool_choice", NULL));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"yaml\"}}", "response_format", "unsupported"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "messages", "role"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\"}]}", "messages", "content"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", "messages", "image_url"));
    ASSERT_TRUE(rejects(CH, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"continue_final_message\":true}",
                        "continue_final_message", NULL));
    // Malformed bodies.
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\"", NULL, "invalid JSON"));
    ASSERT_TRUE(rejects(C, "[1,2]", NULL, "JSON object"));
    ASSERT_TRUE(rejects(C, "", NULL, "empty"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":NaN}", NULL, "invalid JSON"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":1e999}", NULL, "invalid JSON"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"\xc3\x28\"}", NULL, "invalid JSON"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"prompt\":\"y\"}", NULL, "duplicate"));
    // Deep nesting: refused by the parser's depth limit, no stack overflow.
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 32);
    strcpy(deep, "{\"prompt\":");
    size_t o = strlen(deep);
    for (size_t i = 0; i < depth; i++) deep[o++] = '[';
    for (size_t i = 0; i < depth; i++) deep[o++] = ']';
    deep[o++] = '}';
    deep[o] = '\0';
    ASSERT_TRUE(rejects(C, deep, NULL, NULL));
    free(deep);
}

// Numeric sampling parameters are checked against the engine's float (issue 28 item 4): a double
// that is finite but overflows a float, or a positive one that rounds to 0, is refused naming the
// parameter; the bounds are exact (as /openapi.json states them), so the float is in range too.
static int accepts_float(const char *body, size_t off, float want) {
    struct oai_request r;
    struct oai_error e;
    memset(&e, 0, sizeof e);
    int rc = parse(OAI_ENDPOINT_COMPLETIONS, body, &r, &e);
    float got = rc == 0 ? *(const float *)((const char *)&r.params + off) : NAN;
    oai_request_free(&r);
    if (rc != 0 || got != want) {
        fprintf(stderr, "  %s -> rc %d (%s) value %g, want %g\n", body, rc, e.message, got, want);
        return 0;
    }
    return 1;
}

TEST(sampling_params_checked_as_float) {
    const enum oai_endpoint C = OAI_ENDPOINT_COMPLETIONS;
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":1e308}", "temperature", "temperature"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":3.5e38}", "temperature", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_p\":5e-324}", "top_p", "top_p"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_p\":1e-46}", "top_p", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"presence_penalty\":1e300}", "presence_penalty", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"frequency_penalty\":-1e300}", "frequency_penalty", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"min_p\":1e300}", "min_p", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"repetition_penalty\":1e-300}", "repetition_penalty", NULL));
    // The engine accepts repetition_penalty in (0, 2]; the parser must not let more through
    // (the engine's own refusal would carry no param).
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"repetition_penalty\":50}", "repetition_penalty", "2"));
    // Values that round into range are taken as rounded.
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"temperature\":1e-300}", offsetof(atomc_sampling_params, temperature), 0.0f));
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"temperature\":1e30}", offsetof(atomc_sampling_params, temperature), 1e30f));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_p\":1.00000001}", "top_p", NULL)); // stated bounds are exact
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"top_p\":1.4e-45}", "top_p", "1.4e-45"));
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"top_p\":1.401298464324817e-45}", offsetof(atomc_sampling_params, top_p), 1e-45f));
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"temperature\":3.4028234663852886e38}", offsetof(atomc_sampling_params, temperature), 3.4028234663852886e38f));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"temperature\":3.4028235e38}", "temperature", "largest"));
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"top_p\":1e-40}", offsetof(atomc_sampling_params, top_p), 1e-40f));
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"min_p\":1e-50}", offsetof(atomc_sampling_params, min_p), 0.0f));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"presence_penalty\":2.00000001}", "presence_penalty", NULL));
    ASSERT_TRUE(accepts_float("{\"prompt\":\"x\",\"repetition_penalty\":2}", offsetof(atomc_sampling_params, repetition_penalty), 2.0f));
}

TEST(chat_fields) {
    struct oai_request r;
    struct oai_error e;
    ASSERT_OK(parse(OAI_ENDPOINT_CHAT,
                    "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":"
                    "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}],"
                    "\"max_completion_tokens\":9,\"max_tokens\":3,\"logprobs\":true,\"top_logprobs\":4,"
                    "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"chat_template_kwargs\":{\"x\":1},"
                    "\"tools\":[{\"type\":\"function\"}],\"tool_choice\":\"auto\",\"parallel_tool_calls\":false,"
                    "\"response_format\":{\"type\":\"text\"},\"store\":false,\"metadata\":{}}",
                    &r, &e));
    ASSERT_EQ(r.params.max_tokens, 9); // max_completion_tokens wins
    ASSERT_EQ(r.params.logprobs, 4);
    ASSERT_TRUE(r.stream && r.include_usage && r.add_generation_prompt && !r.add_special_tokens);
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(r.messages, 1), "content")), "a\nb");
    ASSERT_EQ(json_integer_value(json_object_get(r.chat_template_kwargs, "x")), 1);
    ASSERT_EQ(json_array_size(r.tools), 1);
    ASSERT_EQ(r.params.max_tokens, 9);
    oai_request_free(&r);
    ASSERT_OK(parse(OAI_ENDPOINT_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true}", &r, &e));
    ASSERT_EQ(r.params.logprobs, 0);
    ASSERT_EQ(r.params.max_tokens, -1); // up to the context
    oai_request_free(&r);
    ASSERT_OK(parse(OAI_ENDPOINT_CHAT,
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":\"y\"}],"
                    "\"continue_final_message\":true,\"add_generation_prompt\":false}",
                    &r, &e));
    ASSERT_TRUE(r.continue_final_message && !r.add_generation_prompt);
    oai_request_free(&r);
}


// Structured output fields: each form maps to (kind, text) for the engine; conflicts and bad
// shapes are 400s naming the field.
static void expect_grammar(enum oai_endpoint ep, const char *body, atomc_grammar_kind kind, const char *text) {
    struct oai_request r;
    struct oai_error e;
    if (parse(ep, body, &r, &e)) {
        test_fail(__FILE__, __LINE__, "%s rejected: %s", body, e.message);
        return;
    }
    if (r.params.grammar_kind != kind) test_fail(__FILE__, __LINE__, "%s: kind %d, want %d", body, r.params.grammar_kind, kind);
    if (text && (!r.params.grammar || strcmp(r.params.grammar, text)))
        test_fail(__FILE__, __LINE__, "%s: text '%s', want '%s'", body, r.params.grammar ? r.params.grammar : "(null)", text);
    if (r.params.grammar_start_token != -1) test_fail(__FILE__, __LINE__, "grammar_start_token not -1");
    oai_request_free(&r);
}

#define MSG "\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]"
TEST(structured_output_fields_parse) {
    const enum oai_endpoint C = OAI_ENDPOINT_COMPLETIONS, CH = OAI_ENDPOINT_CHAT;
    expect_grammar(CH, "{" MSG ",\"response_format\":{\"type\":\"json_object\"}}", ATOMC_GRAMMAR_JSON_OBJECT, NULL);
    expect_grammar(CH, "{" MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"strict\":true,"
                       "\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}}}}",
                   ATOMC_GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}");
    expect_grammar(CH, "{" MSG ",\"response_format\":{\"type\":\"text\"}}", ATOMC_GRAMMAR_NONE, NULL);
    expect_grammar(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"regex\":\"[0-9]+\"}}", ATOMC_GRAMMAR_REGEX, "[0-9]+");
    expect_grammar(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"choice\":[\"a\",\"b\"]}}", ATOMC_GRAMMAR_CHOICE, "[\"a\",\"b\"]");
    expect_grammar(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"json\":\"{\\\"type\\\": \\\"string\\\"}\"}}",
                   ATOMC_GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\"}");
    expect_grammar(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"grammar\":\"root ::= \\\"a\\\"\"}}", ATOMC_GRAMMAR_EBNF,
                   "root ::= \"a\"");
    expect_grammar(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"grammar\":\"start: \\\"a\\\"\"}}", ATOMC_GRAMMAR_LARK,
                   "start: \"a\"");
    expect_grammar(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"json_object\":true,\"disable_fallback\":true}}",
                   ATOMC_GRAMMAR_JSON_OBJECT, NULL);
    expect_grammar(C, "{\"prompt\":\"x\",\"guided_json\":{\"type\":\"boolean\"},\"guided_decoding_backend\":\"xgrammar\"}",
                   ATOMC_GRAMMAR_JSON_SCHEMA, "{\"type\":\"boolean\"}");
    expect_grammar(C, "{\"prompt\":\"x\",\"guided_regex\":\"a|b\"}", ATOMC_GRAMMAR_REGEX, "a|b");
    expect_grammar(C, "{\"prompt\":\"x\",\"guided_choice\":[\"yes\"]}", ATOMC_GRAMMAR_CHOICE, "[\"yes\"]");
    expect_grammar(C, "{\"prompt\":\"x\",\"guided_grammar\":\"root ::= [a-z]+\"}", ATOMC_GRAMMAR_EBNF, "root ::= [a-z]+");

    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_regex\":\"a\",\"guided_choice\":[\"b\"]}", NULL, "only one kind"));
    ASSERT_TRUE(rejects(CH, "{" MSG ",\"response_format\":{\"type\":\"json_object\"},\"guided_regex\":\"a\"}", NULL, "only one kind"));
    ASSERT_TRUE(rejects(CH, "{" MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"}}}",
                        "response_format.json_schema.schema", "required"));
    ASSERT_TRUE(rejects(CH, "{" MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":3}}}",
                        "response_format.json_schema.schema", "schema object"));
    ASSERT_TRUE(rejects(CH, "{" MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{},\"strict\":\"y\"}}}",
                        "response_format.json_schema.strict", NULL));
    ASSERT_TRUE(rejects(CH, "{" MSG ",\"response_format\":\"json\"}", "response_format", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_json\":\"{not json\"}", "guided_json", "not valid JSON"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_choice\":[]}", "guided_choice", "non-empty"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_choice\":[\"a\",1]}", "guided_choice", "[1]"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_regex\":\"\"}", "guided_regex", "empty"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_regex\":5}", "guided_regex", "string"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"guided_whitespace_pattern\":\" \"}", "guided_whitespace_pattern", NULL));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"structured_outputs\":{\"whitespace_pattern\":\" \"}}",
                        "structured_outputs.whitespace_pattern", "unsupported"));
    ASSERT_TRUE(rejects(C, "{\"prompt\":\"x\",\"structured_outputs\":[1]}", "structured_outputs", NULL));
}

TEST(tool_choice_required_builds_a_call_grammar) {
    const char *body = "{" MSG ",\"tool_choice\":\"required\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                       "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}},"
                       "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]}";
    struct oai_request r;
    struct oai_error e;
    ASSERT_EQ(parse(OAI_ENDPOINT_CHAT, body, &r, &e), 0);
    ASSERT_TRUE(r.tool_choice_required && !r.tool_choice_name);
    char *g = oai_tool_call_grammar(&r, "hermes", &e);
    ASSERT_TRUE(g != NULL);
    json_t *j = json_loads(g, 0, NULL);
    ASSERT_STREQ(json_string_value(json_object_get(j, "type")), "structural_tag");
    json_t *fmt = json_object_get(j, "format");
    ASSERT_STREQ(json_string_value(json_object_get(fmt, "begin")), "<tool_call>\n");
    ASSERT_STREQ(json_string_value(json_object_get(fmt, "end")), "\n</tool_call>");
    json_t *any = json_object_get(json_object_get(json_object_get(fmt, "content"), "json_schema"), "anyOf");
    ASSERT_EQ((int)json_array_size(any), 2);
    json_t *alt0 = json_object_get(json_array_get(any, 0), "properties");
    ASSERT_STREQ(json_string_value(json_object_get(json_object_get(alt0, "name"), "const")), "get_weather");
    ASSERT_TRUE(json_is_object(json_object_get(json_object_get(alt0, "arguments"), "properties")));
    json_decref(j);
    free(g);
    ASSERT_TRUE(oai_tool_call_grammar(&r, NULL, &e) == NULL);
    ASSERT_TRUE(strstr(e.message, "--tool-call-parser") != NULL);
    oai_request_free(&r);
    // A named function: only that one; an unknown name is a 400.
    const char *named = "{" MSG ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"now\"}},"
                        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]}";
    ASSERT_EQ(parse(OAI_ENDPOINT_CHAT, named, &r, &e), 0);
    g = oai_tool_call_grammar(&r, "llama3_json", &e);
    ASSERT_TRUE(g && strstr(g, "\"parameters\"") && strstr(g, "\"now\"") && !strstr(g, "anyOf"));
    free(g);
    free(r.tool_choice_name);
    r.tool_choice_name = strdup("later");
    ASSERT_TRUE(oai_tool_call_grammar(&r, "hermes", &e) == NULL);
    ASSERT_TRUE(strstr(e.message, "'later'") != NULL);
    oai_request_free(&r);
    ASSERT_TRUE(rejects(OAI_ENDPOINT_CHAT, "{" MSG ",\"tool_choice\":\"required\",\"guided_regex\":\"a\"}", "tool_choice", "cannot be combined"));
    ASSERT_TRUE(rejects(OAI_ENDPOINT_CHAT, "{" MSG ",\"tool_choice\":{\"type\":\"function\"}}", "tool_choice", NULL));
}

TEST(echo_with_zero_max_tokens_is_allowed) {
    struct oai_request r;
    struct oai_error e;
    ASSERT_OK(parse(OAI_ENDPOINT_COMPLETIONS, "{\"prompt\":\"x\",\"echo\":true,\"max_tokens\":0,\"logprobs\":1}", &r, &e));
    ASSERT_EQ(r.params.max_tokens, 0);
    ASSERT_EQ(r.params.prompt_logprobs, 1);
    oai_request_free(&r);
}

TEST(tokenize_detokenize_parse) {
    struct oai_tokenize_request t;
    struct oai_error e;
    const char *b1 = "{\"prompt\":\"hello\",\"add_special_tokens\":false,\"return_token_strs\":true}";
    ASSERT_OK(oai_tokenize_parse(b1, strlen(b1), &t, &e));
    ASSERT_STREQ(t.prompt, "hello");
    ASSERT_TRUE(!t.add_special_tokens && t.return_token_strs);
    oai_tokenize_free(&t);
    const char *b2 = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
    ASSERT_OK(oai_tokenize_parse(b2, strlen(b2), &t, &e));
    ASSERT_TRUE(t.messages && !t.add_special_tokens && t.add_generation_prompt);
    oai_tokenize_free(&t);
    const char *b3 = "{\"prompt\":\"a\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
    ASSERT_TRUE(oai_tokenize_parse(b3, strlen(b3), &t, &e) != 0);
    oai_tokenize_free(&t);
    struct oai_detokenize_request d;
    struct oai_limits l = lim();
    const char *b4 = "{\"tokens\":[1,2,999]}";
    ASSERT_OK(oai_detokenize_parse(b4, strlen(b4), &l, &d, &e));
    ASSERT_EQ(d.n_tokens, 3);
    oai_detokenize_free(&d);
    const char *b5 = "{\"tokens\":[1000]}";
    ASSERT_TRUE(oai_detokenize_parse(b5, strlen(b5), &l, &d, &e) != 0);
    ASSERT_EQ(e.http_status, 400);
    oai_detokenize_free(&d);
}

TEST(error_json_shape) {
    struct oai_error e;
    oai_error_set(&e, 400, "top_p", "bad %s", "value");
    char *s = oai_error_json(&e);
    json_t *j = json_loads(s, 0, NULL);
    json_t *err = json_object_get(j, "error");
    ASSERT_STREQ(json_string_value(json_object_get(err, "message")), "bad value");
    ASSERT_STREQ(json_string_value(json_object_get(err, "type")), "invalid_request_error");
    ASSERT_STREQ(json_string_value(json_object_get(err, "param")), "top_p");
    ASSERT_EQ(json_integer_value(json_object_get(err, "code")), 400);
    json_decref(j);
    free(s);
}

// Token "bytes": id 0 -> "a", 1 -> "\xc3" (half of 'é'), 2 -> "\xa9", 3 -> " b"
static const char *tb(void *ctx, int32_t id, size_t *len) {
    static const char *t[] = {"a", "\xc3", "\xa9", " b"};
    if (id < 0 || id > 3) return NULL;
    *len = strlen(t[id]);
    return t[id];
}

TEST(logprobs_shapes) {
    struct oai_token_text tt = {tb, NULL, false};
    char *s = oai_token_string(&tt, 1);
    ASSERT_STREQ(s, "\xef\xbf\xbd"); // partial UTF-8 -> U+FFFD
    free(s);
    ASSERT_TRUE(oai_utf8_valid("a\xc3\xa9", 3));
    ASSERT_TRUE(!oai_utf8_valid("a\xc3", 2));
    ASSERT_TRUE(!oai_utf8_valid("a\0b", 3));
    size_t sl;
    char *fixed = oai_utf8_sanitize("a\xc3", 2, &sl);
    ASSERT_STREQ(fixed, "a\xef\xbf\xbd");
    ASSERT_EQ(sl, 4);
    free(fixed);
    struct oai_token_text ids = {tb, NULL, true};
    s = oai_token_string(&ids, 3);
    ASSERT_STREQ(s, "token_id:3");
    free(s);

    atomc_top_logprob top[2] = {{3, -0.5f}, {0, -1.5f}};
    atomc_token_logprobs lp = {.token = 3, .logprob = -0.5f, .n_top = 2, .top = top};
    json_t *o = oai_completion_logprobs_new();
    size_t off = 0;
    oai_completion_logprobs_append(o, &tt, 0, NULL, 2, &off); // first prompt token: nulls
    oai_completion_logprobs_append(o, &tt, 3, &lp, 2, &off);
    ASSERT_TRUE(json_is_null(json_array_get(json_object_get(o, "token_logprobs"), 0)));
    ASSERT_NEAR(json_real_value(json_array_get(json_object_get(o, "token_logprobs"), 1)), -0.5, 1e-6);
    ASSERT_STREQ(json_string_value(json_array_get(json_object_get(o, "tokens"), 1)), " b");
    ASSERT_EQ(json_integer_value(json_array_get(json_object_get(o, "text_offset"), 1)), 1);
    json_t *t1 = json_array_get(json_object_get(o, "top_logprobs"), 1);
    ASSERT_EQ(json_object_size(t1), 2);
    ASSERT_NEAR(json_real_value(json_object_get(t1, "a")), -1.5, 1e-6);
    ASSERT_EQ(off, 3);
    json_decref(o);

    json_t *c = oai_chat_logprob_entry(&tt, &lp, 1);
    ASSERT_STREQ(json_string_value(json_object_get(c, "token")), " b");
    json_t *bytes = json_object_get(c, "bytes");
    ASSERT_EQ(json_array_size(bytes), 2);
    ASSERT_EQ(json_integer_value(json_array_get(bytes, 0)), ' ');
    ASSERT_EQ(json_array_size(json_object_get(c, "top_logprobs")), 1);
    json_decref(c);

    json_t *u = oai_usage_json(10, 5, 4);
    ASSERT_EQ(json_integer_value(json_object_get(u, "total_tokens")), 15);
    ASSERT_EQ(json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens")), 4);
    json_decref(u);
}

TEST(metrics_render_prometheus_text) {
    struct metrics m;
    metrics_init(&m, "my\"model");
    metrics_record_request(&m, ATOMC_FINISH_STOP, 10, 5, 0.03, 0.7, -1);
    metrics_record_request(&m, ATOMC_FINISH_ABORT, 3, 1, -1, 100, -1);
    histogram_observe(&m.itl, 0.02);
    atomc_stats st = {.num_running = 2, .num_waiting = 1, .kv_cache_usage = 0.25, .prompt_tokens_total = 13,
                      .generation_tokens_total = 6, .prefix_cache_queries = 8, .prefix_cache_hits = 4,
                      .num_preemptions = 1};
    char *txt;
    size_t len;
    ASSERT_OK(metrics_render(&m, &st, &txt, &len));
    ASSERT_EQ(strlen(txt), len);
    ASSERT_TRUE(strstr(txt, "vllm:num_requests_running{model_name=\"my\\\"model\"} 2\n") != NULL);
    ASSERT_TRUE(strstr(txt, "vllm:num_requests_waiting{model_name=\"my\\\"model\"} 1\n") != NULL);
    ASSERT_TRUE(strstr(txt, "vllm:kv_cache_usage_perc{model_name=\"my\\\"model\"} 0.25\n") != NULL);
    ASSERT_TRUE(strstr(txt, "vllm:prompt_tokens_total{model_name=\"my\\\"model\"} 13\n") != NULL);
    ASSERT_TRUE(strstr(txt, "vllm:prefix_cache_hits_total{model_name=\"my\\\"model\"} 4\n") != NULL);
    ASSERT_TRUE(strstr(txt, "vllm:num_preemptions_total{model_name=\"my\\\"model\"} 1\n") != NULL);
    ASSERT_TRUE(strstr(txt, "vllm:request_success_total{finished_reason=\"stop\",model_name=\"my\\\"model\"} 1\n"));
    ASSERT_TRUE(strstr(txt, "vllm:request_success_total{finished_reason=\"abort\",model_name=\"my\\\"model\"} 1\n"));
    // TTFT 0.03 lands in le=0.04 (cumulative), not in le=0.02; e2e 100 only from le=120 on.
    ASSERT_TRUE(strstr(txt, "vllm:time_to_first_token_seconds_bucket{le=\"0.02\",model_name=\"my\\\"model\"} 0\n"));
    ASSERT_TRUE(strstr(txt, "vllm:time_to_first_token_seconds_bucket{le=\"0.04\",model_name=\"my\\\"model\"} 1\n"));
    ASSERT_TRUE(strstr(txt, "vllm:time_to_first_token_seconds_count{model_name=\"my\\\"model\"} 1\n"));
    ASSERT_TRUE(strstr(txt, "vllm:e2e_request_latency_seconds_bucket{le=\"60\",model_name=\"my\\\"model\"} 1\n"));
    ASSERT_TRUE(strstr(txt, "vllm:e2e_request_latency_seconds_bucket{le=\"120\",model_name=\"my\\\"model\"} 2\n"));
    ASSERT_TRUE(strstr(txt, "vllm:e2e_request_latency_seconds_bucket{le=\"+Inf\",model_name=\"my\\\"model\"} 2\n"));
    ASSERT_TRUE(strstr(txt, "vllm:inter_token_latency_seconds_sum{model_name=\"my\\\"model\"} 0.02"));
    ASSERT_TRUE(strstr(txt, "# TYPE vllm:e2e_request_latency_seconds histogram\n"));
    free(txt);
    metrics_free(&m);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
