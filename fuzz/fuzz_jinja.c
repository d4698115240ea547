// libFuzzer target for the Jinja interpreter: the input is split at the first NUL byte
// into a template source and a JSON document of variables (if it parses). The template
// is compiled and, when it compiles, rendered under small limits so that every input
// finishes quickly. Any crash, sanitizer report, leak or hang is a bug: bad templates
// must only ever produce error statuses.
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
    if (jinja_compile(src, src_len, &t, &err) == ATOMC_OK) {
        struct jinja_limits lim;
        jinja_limits_init(&lim);
        lim.max_steps = 20000;
        lim.max_output_bytes = 1 << 16;
        lim.max_memory_bytes = 16 << 20;
        struct jinja_render_options opt = {.limits = &lim, .now = 1700000000};
        char *out = NULL;
        size_t n = 0;
        if (jinja_render(t, vars, &opt, &out, &n, &err) == ATOMC_OK) {
            if (strlen(out) > n) abort(); // length must cover the text
            free(out);
        }
        jinja_template_free(t);
    }
    json_decref(vars);
    return 0;
}
