// Tokenizers from GGUF metadata (tokenizer.ggml.*). Wired to the GGUF reader (src/loader/gguf.h).
#include "tokenizer/tokenizer_internal.h"

atomc_status tokenizer_load_gguf(const struct gguf_file *g, struct tokenizer **out, struct error *err) {
    (void)g;
    *out = NULL;
    return error_set(err, ATOMC_ERR_UNSUPPORTED, "tokenizer: GGUF reader not merged yet");
}

atomc_status tokenizer_load_gguf_path(const char *path, struct tokenizer **out, struct error *err) {
    *out = NULL;
    return error_set(err, ATOMC_ERR_UNSUPPORTED, "tokenizer: %s: GGUF reader not merged yet", path);
}
