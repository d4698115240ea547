// libFuzzer target for the Jinja interpreter and the chat-template layer. The input is
// split at the first NUL byte into a template source and a JSON document of variables (if
// it parses; else a default conversation). The template is compiled and, when it
// compiles, rendered under small limits so that every input finishes quickly; when the
// variables hold "messages", the chat-template API renders them too. Any crash, sanitizer
// report, leak or hang is a bug: bad templates must only ever produce error statuses.
//   make fuzz && nice build-fuzz/fuzz/fuzz_jinja -dict=fuzz/jinja.dict -max_len=4096 fuzz/corpus/jinja
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "template/chat_template.h"
#include "template/jinja.h"

static const char *DEFAULT_VARS =
    "{\"messages\":[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"user\",\"content\":\"hi \\u00e9\"},"
    "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
    "\"arguments\":{\"a\":[1,2.5,null,true]}}}]}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
    "\"add_generation_prompt\":true,\"bos_token\":\"<s>\",\"n\":3,\"s\":\"abc\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *src = (const char *)data;
    const uint8_t *nul = memchr(data, 0, size);
    size_t src_len = nul ? (size_t)(nul - data) : size;
    json_t *vars = NULL;
    if (nul) vars = json_loadb((const char *)nul + 1, size - src_len - 1, 0, NULL);
    if (!vars || !json_is_object(vars)) {
        json_decref(vars);
        vars = json_loads(DEFAULT_VARS, 0, NULL);
    }
    struct jinja_template *t = NULL;
    struct error err;
    struct jinja_limits lim;
    jinja_limits_init(&lim);
    lim.max_steps = 20000;
    lim.max_output_bytes = 1 << 16;
    lim.max_memory_bytes = 16 << 20;
    struct jinja_render_options opt = {.limits = &lim, .now = 1700000000};
    if (jinja_compile(src, src_len, &t, &err) == ATOMC_OK) {
        char *out = NULL;
        size_t n = 0;
        if (jinja_render(t, vars, &opt, &out, &n, &err) == ATOMC_OK) {
            if (strlen(out) > n) abort(); // length must cover the text
            free(out);
        }
        jinja_template_free(t);
        // the chat-template layer on top: message validation, content flattening,
        // reasoning aliasing, continue_final_message, kwargs
        json_t *msgs = json_object_get(vars, "messages");
        if (msgs && src_len < 8192) {
            char *copy = malloc(src_len + 1);
            if (copy) {
                memcpy(copy, src, src_len);
                copy[src_len] = '\0';
                struct chat_template *ct = NULL;
                if (strlen(copy) == src_len && chat_template_compile(copy, &ct, &err) == ATOMC_OK) {
                    bool cont = src_len & 1;
                    char *out = NULL;
                    if (chat_template_render_ex(ct, msgs, json_object_get(vars, "tools"), !cont, cont,
                                                json_object_get(vars, "kwargs"), "<s>", "</s>", &opt, &out,
                                                &err) == ATOMC_OK)
                        free(out);
                    chat_template_free(ct);
                }
                free(copy);
            }
        }
    }
    json_decref(vars);
    return 0;
}
