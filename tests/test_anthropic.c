// Anthropic Messages request translation (src/server/anthropic.c, anthropic_to_openai): the
// OpenAI chat request each Messages body becomes, field by field, and the 400 (naming the field)
// of each bad input; the error body's shape. The HTTP side is in tests/py/test_anthropic.py and
// tests/test_parser_http.c.
#include <string.h>

#include "server/anthropic.h"
#include "test.h"

static json_t *translate(const char *body, bool count_only, struct oai_error *e) {
    return anthropic_to_openai(body, strlen(body), count_only, e);
}

// The translation of body, compared with the expected OpenAI request (JSON text).
static void check_translation(const char *body, const char *want_text) {
    struct oai_error e;
    json_t *got = translate(body, false, &e);
    if (!got) fprintf(stderr, "unexpected error: %s\n", e.message);
    ASSERT_TRUE(got != NULL);
    json_t *want = json_loads(want_text, 0, NULL);
    ASSERT_TRUE(want != NULL);
    if (!json_equal(got, want)) {
        char *g = json_dumps(got, JSON_COMPACT | JSON_SORT_KEYS);
        fprintf(stderr, "got  %s\n", g);
        free(g);
    }
    ASSERT_TRUE(json_equal(got, want));
    json_decref(got);
    json_decref(want);
}

static void check_refused(const char *body, bool count_only, const char *param, const char *part) {
    struct oai_error e;
    json_t *got = translate(body, count_only, &e);
    ASSERT_TRUE(got == NULL);
    ASSERT_EQ(e.http_status, 400);
    ASSERT_STREQ(e.param, param);
    if (!strstr(e.message, part)) fprintf(stderr, "message: %s\n", e.message);
    ASSERT_TRUE(strstr(e.message, part) != NULL);
}

TEST(anthropic_text_and_system) {
    check_translation(
        "{\"model\": \"m\", \"max_tokens\": 5, \"system\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": "
        "\"text\", \"text\": \"b\", \"cache_control\": {\"type\": \"ephemeral\"}}], \"messages\": [{\"role\": "
        "\"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": "
        "\"x\"}, {\"type\": \"text\", \"text\": \"y\"}]}], \"stop_sequences\": [\"END\"], \"temperature\": 0.5, "
        "\"top_p\": 0.9, \"top_k\": 40, \"stream\": true, \"metadata\": {\"user_id\": \"u\"}}",
        "{\"model\": \"m\", \"max_tokens\": 5, \"messages\": [{\"role\": \"system\", \"content\": \"a\\nb\"}, "
        "{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"x\\ny\"}], "
        "\"stop\": [\"END\"], \"temperature\": 0.5, \"top_p\": 0.9, \"top_k\": 40, \"stream\": true}");
    // top_k 0 is "unset"; a null system is none.
    check_translation("{\"model\": \"m\", \"max_tokens\": 1, \"top_k\": 0, \"system\": null, \"messages\": [{\"role\": "
                      "\"user\", \"content\": []}]}",
                      "{\"model\": \"m\", \"max_tokens\": 1, \"messages\": [{\"role\": \"user\", \"content\": \"\"}]}");
}

TEST(anthropic_tool_use_round_trip) {
    check_translation(
        "{\"model\": \"m\", \"max_tokens\": 9, \"tools\": [{\"name\": \"get_weather\", \"description\": \"d\", "
        "\"input_schema\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}], "
        "\"tool_choice\": "
        "{\"type\": \"tool\", \"name\": \"get_weather\"}, \"messages\": [{\"role\": \"user\", \"content\": \"w?\"}, "
        "{\"role\": "
        "\"assistant\", \"content\": [{\"type\": \"thinking\", \"thinking\": \"t\", \"signature\": \"s\"}, {\"type\": "
        "\"text\", "
        "\"text\": \"Checking.\"}, {\"type\": \"tool_use\", \"id\": \"toolu_1\", \"name\": \"get_weather\", \"input\": "
        "{\"city\": \"Paris\"}}, {\"type\": \"tool_use\", \"id\": \"toolu_2\", \"name\": \"get_weather\", \"input\": "
        "{}}]}, "
        "{\"role\": \"user\", \"content\": [{\"type\": \"tool_result\", \"tool_use_id\": \"toolu_1\", \"content\": "
        "\"18 C\"}, "
        "{\"type\": \"tool_result\", \"tool_use_id\": \"toolu_2\", \"content\": [{\"type\": \"text\", \"text\": "
        "\"ok\"}], "
        "\"is_error\": true}, {\"type\": \"text\", \"text\": \"thanks\"}]}]}",
        "{\"model\": \"m\", \"max_tokens\": 9, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
        "\"get_weather\", "
        "\"description\": \"d\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
        "\"string\"}}}}}], "
        "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}, \"messages\": "
        "[{\"role\": "
        "\"user\", \"content\": \"w?\"}, {\"role\": \"assistant\", \"content\": \"Checking.\", \"tool_calls\": "
        "[{\"id\": "
        "\"toolu_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\":"
        "\\\"Paris\\\"}\"}}, {\"id\": \"toolu_2\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"arguments\": \"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"toolu_1\", \"content\": \"18 C\"}, "
        "{\"role\": "
        "\"tool\", \"tool_call_id\": \"toolu_2\", \"content\": \"ok\"}, {\"role\": \"user\", \"content\": "
        "\"thanks\"}]}");
    // A user turn of tool results only adds no empty user message; any -> required, none, auto.
    check_translation(
        "{\"model\": \"m\", \"max_tokens\": 2, \"tool_choice\": {\"type\": \"any\"}, \"thinking\": {\"type\": "
        "\"disabled\"}, \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"tool_result\", "
        "\"tool_use_id\": \"a\"}]}]}",
        "{\"model\": \"m\", \"max_tokens\": 2, \"tool_choice\": \"required\", \"chat_template_kwargs\": "
        "{\"enable_thinking\": false}, \"messages\": [{\"role\": \"tool\", \"tool_call_id\": \"a\", "
        "\"content\": \"\"}]}");
}

TEST(anthropic_count_tokens_needs_no_max_tokens) {
    struct oai_error e;
    json_t *o = translate(
        "{\"model\": \"m\", \"stream\": true, \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", true, &e);
    ASSERT_TRUE(o != NULL);
    ASSERT_TRUE(json_object_get(o, "max_tokens") == NULL);
    ASSERT_TRUE(json_object_get(o, "stream") == NULL);
    json_decref(o);
    check_refused("{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", false, "max_tokens",
                  "positive integer");
}

TEST(anthropic_bad_inputs_name_the_field) {
    const char *msgs = "\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]";
    char b[512];
    check_refused("[1]", false, "", "object");
    check_refused("{\"max_tokens\": 3, \"messages\": []}", false, "model", "string");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 0, %s}", msgs);
    check_refused(b, false, "max_tokens", "positive");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"messages\": []}");
    check_refused(b, false, "messages", "non-empty");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"frobnicate\": 1, %s}", msgs);
    check_refused(b, false, "frobnicate", "unknown field");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"temperature\": 1.5, %s}", msgs);
    check_refused(b, false, "temperature", "between 0 and 1");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"top_p\": 0, %s}", msgs);
    check_refused(b, false, "top_p", "(0, 1]");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"top_k\": -1, %s}", msgs);
    check_refused(b, false, "top_k", "non-negative");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"stop_sequences\": \"x\", %s}", msgs);
    check_refused(b, false, "stop_sequences", "list");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"system\": 5, %s}", msgs);
    check_refused(b, false, "system", "string or a list");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"tools\": [{\"name\": \"f\"}], %s}", msgs);
    check_refused(b, false, "tools", "input_schema");
    snprintf(b, sizeof b,
             "{\"model\": \"m\", \"max_tokens\": 3, \"tools\": [{\"type\": \"web_search_20250305\", "
             "\"name\": \"web_search\"}], %s}",
             msgs);
    check_refused(b, false, "tools", "web_search_20250305");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"tool_choice\": {\"type\": \"maybe\"}, %s}", msgs);
    check_refused(b, false, "tool_choice", "maybe");
    snprintf(b, sizeof b, "{\"model\": \"m\", \"max_tokens\": 3, \"thinking\": {\"type\": \"on\"}, %s}", msgs);
    check_refused(b, false, "thinking", "enabled");
    snprintf(b, sizeof b,
             "{\"model\": \"m\", \"max_tokens\": 3, \"output_config\": {\"format\": {\"type\": "
             "\"json_schema\"}}, %s}",
             msgs);
    check_refused(b, false, "output_config", "format");
    check_refused("{\"model\": \"m\", \"max_tokens\": 3, \"messages\": [{\"role\": \"system\", \"content\": \"x\"}]}",
                  false, "messages", "messages[0].role");
    check_refused("{\"model\": \"m\", \"max_tokens\": 3, \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
                  "\"image\", \"source\": {}}]}]}",
                  false, "messages", "'image' are not supported");
    check_refused("{\"model\": \"m\", \"max_tokens\": 3, \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
                  "\"tool_use\", \"id\": \"a\", \"name\": \"f\", \"input\": {}}]}]}",
                  false, "messages", "messages[0].content[0]: tool_use blocks belong to assistant");
    check_refused(
        "{\"model\": \"m\", \"max_tokens\": 3, \"messages\": [{\"role\": \"assistant\", \"content\": [{\"type\": "
        "\"tool_use\", \"id\": \"a\", \"name\": \"f\", \"input\": []}]}]}",
        false, "messages", "object \"input\"");
    check_refused("{\"model\": \"m\", \"max_tokens\": 3, \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
                  "\"tool_result\", \"tool_use_id\": \"a\", \"content\": [{\"type\": \"image\"}]}]}]}",
                  false, "messages", "only text blocks");
    check_refused("{\"model\": \"m\", \"max_tokens\": 3, \"messages\": [{\"role\": \"user\", \"content\": 7}]}", false,
                  "messages", "content must be");
}

TEST(anthropic_error_shape) {
    struct oai_error e;
    oai_error_set(&e, 401, NULL, "bad key");
    char *s = anthropic_error_json(&e);
    ASSERT_STREQ(s, "{\"type\":\"error\",\"error\":{\"type\":\"authentication_error\",\"message\":\"bad key\"}}");
    free(s);
    const int codes[] = {400, 404, 413, 503, 500};
    const char *types[] = {"invalid_request_error", "not_found_error", "request_too_large", "overloaded_error",
                           "api_error"};
    for (int i = 0; i < 5; i++) {
        oai_error_set(&e, codes[i], NULL, "m");
        s = anthropic_error_json(&e);
        json_t *o = json_loads(s, 0, NULL);
        ASSERT_STREQ(json_string_value(json_object_get(json_object_get(o, "error"), "type")), types[i]);
        json_decref(o);
        free(s);
    }
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
