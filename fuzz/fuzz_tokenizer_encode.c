// libFuzzer target: arbitrary bytes (invalid UTF-8 included) through encode, decode and the
// streaming detokenizer of one tokenizer ($ATOMC_FUZZ_TOKENIZER, default the synth_meta fixture).
// Property checked: the streamed deltas concatenate to the full decode.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

static struct tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *p = getenv("ATOMC_FUZZ_TOKENIZER");
    struct error err;
    if (tokenizer_load(p ? p : "tests/fixtures/tokenizer/synth_meta.json", &tok, &err) != ATOMC_OK) {
        fprintf(stderr, "fuzz_tokenizer_encode: %s\n", err.msg);
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int32_t *ids;
    int n;
    struct error err;
    if (tokenizer_encode(tok, (const char *)data, size, size & 1, &ids, &n, &err) != ATOMC_OK) return 0;
    char *full;
    size_t full_len;
    if (tokenizer_decode_n(tok, ids, n, false, &full, &full_len, &err) != ATOMC_OK) abort();
    struct detokenizer d;
    detokenizer_init(&d, tok, false);
    char *acc = malloc(full_len + 1);
    size_t acc_len = 0;
    for (int i = 1; i <= n + 1; i++) {
        bool final = i == n + 1;
        char *delta;
        size_t len;
        if (detokenizer_step(&d, ids, final ? n : i, final ? 0 : 1, final, &delta, &len) != ATOMC_OK) abort();
        if (acc_len + len > full_len) abort();  // more text than the full decode
        if (len) memcpy(acc + acc_len, delta, len);
        acc_len += len;
        free(delta);
    }
    if (acc_len != full_len || memcmp(acc, full, full_len)) abort();
    detokenizer_free(&d);
    free(acc);
    free(full);
    free(ids);
    return 0;
}
