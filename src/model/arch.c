// The architecture table (arch.h): every family the engine implements, looked up by the
// config's enum model_arch.
#include "model/arch.h"

#include <stdio.h>
#include <string.h>

static const struct model_arch_def *const model_arch_table[] = {
    &model_arch_llama,
    &model_arch_deepseek,
    &model_arch_gpt_oss,
    &model_arch_qwen3_next,
    &model_arch_glm4_moe,
    &model_arch_mimo,
};

#define N_ARCH_DEFS (sizeof model_arch_table / sizeof model_arch_table[0])

const struct model_arch_def *model_arch_find(enum model_arch a) {
    if (a == MODEL_ARCH_UNKNOWN) return NULL;
    for (size_t i = 0; i < N_ARCH_DEFS; i++)
        for (const enum model_arch *p = model_arch_table[i]->archs; *p != MODEL_ARCH_UNKNOWN; p++)
            if (*p == a) return model_arch_table[i];
    return NULL;
}

void model_arch_supported_list(char *buf, size_t n) {
    size_t o = 0;
    buf[0] = 0;
    for (size_t i = 0; i < N_ARCH_DEFS; i++)
        for (const enum model_arch *p = model_arch_table[i]->archs; *p != MODEL_ARCH_UNKNOWN && o < n; p++)
            o += (size_t)snprintf(buf + o, n - o, "%s%s", o ? ", " : "", model_arch_name(*p));
}
