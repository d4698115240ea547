// The production engine table: atomc_engine for generation and stats, the tokenizer for text,
// the chat template for messages (see engine_adapter.h).
#include "server/engine_adapter.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/check.h"
#include "common/log.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

struct engine_adapter {
    atomc_engine *engine;
    struct tokenizer *tok;
    struct chat_template *tmpl; // NULL: the model has no chat template
    char *bos, *eos;
    char *template_text;        // the chat template's source (GET /tokenizer_info)
    char *model_path;
    int max_model_len, vocab_size;
};

static atomc_status a_add(void *ctx, const atomc_request *r, uint64_t *id, char *err, size_t err_len) {
    struct engine_adapter *a = ctx;
    return atomc_engine_add_request(a->engine, r, id, err, err_len);
}

static atomc_status a_abort(void *ctx, uint64_t id) {
    struct engine_adapter *a = ctx;
    return atomc_engine_abort(a->engine, id);
}

static void a_stats(void *ctx, atomc_stats *s) {
    struct engine_adapter *a = ctx;
    atomc_engine_get_stats(a->engine, s);
}

static atomc_status a_tokenize(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids, int *n,
                               struct error *err) {
    struct engine_adapter *a = ctx;
    return tokenizer_encode(a->tok, text, len, add_special, ids, n, err);
}

static atomc_status a_detokenize(void *ctx, const int32_t *ids, int n, bool skip, char **text, struct error *err) {
    struct engine_adapter *a = ctx;
    return tokenizer_decode(a->tok, ids, n, skip, text, err);
}

static const char *a_token_bytes(void *ctx, int32_t id, size_t *len) {
    struct engine_adapter *a = ctx;
    return tokenizer_token_bytes(a->tok, id, len);
}

static atomc_status a_render(void *ctx, json_t *messages, json_t *tools, bool add_gen, bool cont, json_t *kwargs,
                             char **out, struct error *err) {
    struct engine_adapter *a = ctx;
    if (!a->tmpl) return error_set(err, ATOMC_ERR_UNSUPPORTED, "the model has no chat template");
    return chat_template_render(a->tmpl, messages, tools, add_gen, cont, kwargs, a->bos, a->eos, out, err);
}

static atomc_status a_start_profile(void *ctx, char *err, size_t err_len) {
    struct engine_adapter *a = ctx;
    return atomc_engine_start_profile(a->engine, err, err_len);
}

static atomc_status a_stop_profile(void *ctx, char *path, size_t path_len, char *err, size_t err_len) {
    struct engine_adapter *a = ctx;
    return atomc_engine_stop_profile(a->engine, path, path_len, err, err_len);
}

static bool is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

atomc_status engine_adapter_create(atomc_engine *e, const char *model_path, const char *chat_template,
                                   struct engine_adapter **adapter, struct server_engine *out, struct error *err) {
    struct engine_adapter *a = xcalloc(1, sizeof *a);
    a->engine = e;
    a->model_path = xstrdup(model_path);
    size_t mp_len = strlen(model_path);
    atomc_status st;
    if (is_file(model_path) && mp_len >= 5 && !strcmp(model_path + mp_len - 5, ".json")) {
        // A bare config (--load-format dummy with bench/configs/*.json) runs token ids only; the server
        // renders and detokenizes text, so it needs the tokenizer beside it.
        st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                       "the server needs a tokenizer: %s is a bare config.json; give a model directory with "
                       "config.json and tokenizer.json",
                       model_path);
        goto fail;
    }
    st = tokenizer_load(model_path, &a->tok, err);
    if (st != ATOMC_OK) {
        error_prefix(err, "loading the tokenizer of %s: ", model_path);
        goto fail;
    }
    // Template: --chat-template as a file, as inline text, or the model's own.
    bool inline_text = chat_template && !is_file(chat_template);
    struct chat_template_source src;
    memset(&src, 0, sizeof src);
    st = chat_template_source_load(model_path, inline_text ? NULL : chat_template, false, &src, err);
    if (st != ATOMC_OK) {
        error_prefix(err, "loading the chat template: ");
        goto fail;
    }
    if (inline_text) {
        free(src.template_src);
        src.template_src = xstrdup(chat_template);
    }
    a->bos = src.bos_token;
    a->eos = src.eos_token;
    src.bos_token = src.eos_token = NULL;
    if (src.template_src) {
        st = chat_template_compile(src.template_src, &a->tmpl, err);
        a->template_text = src.template_src;
        if (st != ATOMC_OK) {
            error_prefix(err, "compiling the chat template: ");
            goto fail;
        }
    } else {
        LOG_WARN("%s has no chat template: /v1/chat/completions will answer 400 (pass --chat-template)", model_path);
    }
    atomc_model_info info;
    atomc_engine_get_model_info(e, &info);
    a->max_model_len = info.max_model_len;
    a->vocab_size = info.vocab_size;
    int tv = tokenizer_vocab_size(a->tok);
    if (tv < a->vocab_size) a->vocab_size = tv; // ids must be valid for both the model and the tokenizer

    memset(out, 0, sizeof *out);
    out->ctx = a;
    out->add_request = a_add;
    out->abort_request = a_abort;
    out->get_stats = a_stats;
    out->tokenize = a_tokenize;
    out->detokenize = a_detokenize;
    out->token_bytes = a_token_bytes;
    out->render_chat = a_render;
    out->start_profile = a_start_profile;
    out->stop_profile = a_stop_profile;
    out->max_model_len = a->max_model_len;
    out->vocab_size = a->vocab_size;
    out->model_path = a->model_path;
    out->bos_token = a->bos;
    out->eos_token = a->eos;
    out->chat_template = a->template_text;
    atomc_kv_info kv;
    atomc_engine_get_kv_info(e, &kv);
    out->kv_role = kv.role;
    out->kv_engine_id = kv.engine_id;
    out->kv_host = kv.host;
    out->kv_port = kv.port;
    *adapter = a;
    return ATOMC_OK;
fail:
    engine_adapter_free(a);
    return st;
}

void engine_adapter_free(struct engine_adapter *a) {
    if (!a) return;
    if (a->tmpl) chat_template_free(a->tmpl);
    if (a->tok) tokenizer_free(a->tok);
    free(a->bos);
    free(a->eos);
    free(a->template_text);
    free(a->model_path);
    free(a);
}
