// libFuzzer target for config.json / generation_config.json parsing and validation.
// Build: `make fuzz`; run: build-fuzz/fuzz/fuzz_config CORPUS_DIR tests/fixtures/configs fuzz/corpus/config
// (the latter: quantization_config seeds). Parsed quantization configs go through the refusal
// check and the description inspect prints.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/config.h"
#include "model/quant.h"

static struct model_config cfg;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    struct error err;
    if (model_config_parse_json(&cfg, text, "fuzz/config.json", &err) == ATOMC_OK) {
        (void)model_config_validate(&cfg, "fuzz/config.json", &err);
        for (int l = 0; l < cfg.num_layers + 2; l++) (void)model_config_layer_is_moe(&cfg, l);
        static char desc[4096];
        (void)model_quant_check(&cfg, &err);
        quant_config_describe(&cfg.quant, desc, sizeof desc);
    }
    (void)model_config_merge_generation_config(&cfg, text, "fuzz/generation_config.json", &err);
    (void)model_config_parse_quant_file(&cfg, text, "fuzz/quantize_config.json", "quantize_config.json",
                                        QUANT_METHOD_GPTQ, &err);
    free(text);
    return 0;
}
