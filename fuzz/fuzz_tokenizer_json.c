// libFuzzer target: arbitrary bytes as tokenizer.json. Loading must fail cleanly or give a tokenizer
// that encodes and decodes without crashing.
#include <stdint.h>
#include <stdlib.h>

#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct tokenizer *t;
    struct error err;
    if (tokenizer_load_json_buffer((const char *)data, size, NULL, 0, &t, &err) != ATOMC_OK) return 0;
    static const char text[] = "Hello, world! 123 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x91\x8D <s>\xff";
    int32_t *ids;
    int n;
    if (tokenizer_encode(t, text, sizeof text - 1, true, &ids, &n, &err) == ATOMC_OK) {
        char *out;
        if (tokenizer_decode(t, ids, n, false, &out, &err) == ATOMC_OK) free(out);
        free(ids);
    }
    tokenizer_free(t);
    return 0;
}
