// libFuzzer target for the safetensors header parser (safetensors_open_memory).
// Build: `make fuzz`; run: build-fuzz/fuzz/fuzz_safetensors CORPUS_DIR (seed with
// tests/fixtures/loader/ref.safetensors). Every accepted tensor's bytes must lie inside
// the buffer (ASan checks the first and last byte of each view).
#include <stddef.h>
#include <stdint.h>

#include "loader/safetensors.h"

static volatile unsigned char sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct safetensors_file *f;
    struct error err;
    if (safetensors_open_memory(&f, data, size, "fuzz.safetensors", &err) != ATOMC_OK) return 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        const struct safetensors_tensor *st = &f->tensors[i];
        if (st->end > st->begin)
            sink ^= ((const unsigned char *)st->data)[0] ^ ((const unsigned char *)st->data)[st->end - st->begin - 1];
        struct tensor t;
        if (safetensors_get_tensor(f, st->name, &t, &err) != ATOMC_OK) continue;
        size_t bytes = tensor_bytes(&t);
        if (bytes) sink ^= ((const unsigned char *)t.data)[0] ^ ((const unsigned char *)t.data)[bytes - 1];
    }
    safetensors_close(f);
    return 0;
}
