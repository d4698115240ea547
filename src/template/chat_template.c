// Chat template API over the Jinja interpreter; see chat_template.h for the contract.
//
// Content given as a list of parts: most templates (Llama-3, Qwen3, DeepSeek-V3,
// SmolLM2) concatenate `message.content` as a string, so, like vLLM's "string" content
// format, text parts are joined with "\n" into one string before rendering. Templates
// that walk the parts themselves (they test `content is string` or loop over the
// content) get the list unchanged (vLLM's "openai" format).
#include "template/chat_template.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/check.h"
#include "loader/gguf.h"
#include "template/jinja_internal.h"

struct chat_template {
    struct jinja_template *jt;
    char *src;
    bool content_as_parts; // template handles list-of-parts content itself
};

// Same pattern as tools/gen_template_refs.py's PARTS_RE.
static bool template_walks_parts(const char *src) {
    static const char *pattern = "for\\s+\\w+\\s+in\\s+[\\w.\\[\\]'\"]*content\\b|"
                                 "content\\s+is\\s+(not\\s+)?(string|iterable|sequence|mapping)";
    int errcode;
    PCRE2_SIZE erroff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, 0, &errcode, &erroff, NULL);
    CHECK(re);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    CHECK(md);
    int rc = pcre2_match(re, (PCRE2_SPTR)src, strlen(src), 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc >= 0;
}

atomc_status chat_template_compile(const char *src, struct chat_template **out, struct error *err) {
    *out = NULL;
    if (!src) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "no chat template");
    struct chat_template *t = calloc(1, sizeof *t);
    if (!t) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
    t->src = strdup(src);
    if (!t->src) {
        free(t);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
    }
    atomc_status st = jinja_compile(src, strlen(src), &t->jt, err);
    if (st != ATOMC_OK) {
        error_prefix(err, "chat template: ");
        free(t->src);
        free(t);
        return st;
    }
    t->content_as_parts = template_walks_parts(src);
    *out = t;
    return ATOMC_OK;
}

void chat_template_free(struct chat_template *t) {
    if (!t) return;
    jinja_template_free(t->jt);
    free(t->src);
    free(t);
}

const char *chat_template_source(const struct chat_template *t) { return t->src; }

bool chat_template_starts_with_bos(const char *rendered, const char *bos_token) {
    if (!rendered || !bos_token || !bos_token[0]) return false;
    return !strncmp(rendered, bos_token, strlen(bos_token));
}

atomc_status chat_template_validate_messages(const json_t *messages, struct error *err) {
    if (!messages || !json_is_array(messages))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'messages' must be an array of message objects");
    if (json_array_size(messages) == 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'messages' must contain at least one message");
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "messages[%zu] must be an object", i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role))
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "messages[%zu].role must be a string", i);
        json_t *content = json_object_get(m, "content");
        if (content && !json_is_null(content) && !json_is_string(content)) {
            if (!json_is_array(content))
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                 "messages[%zu].content must be a string, null or an array of content parts", i);
            size_t k;
            json_t *part;
            json_array_foreach(content, k, part) {
                json_t *type = json_object_get(part, "type");
                if (!json_is_object(part) || !json_is_string(type))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                     "messages[%zu].content[%zu] must be an object with a string 'type'", i, k);
                if (strcmp(json_string_value(type), "text"))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                     "messages[%zu].content[%zu]: content part type '%s' is not supported (text only)",
                                     i, k, json_string_value(type));
                if (!json_is_string(json_object_get(part, "text")))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                     "messages[%zu].content[%zu].text must be a string", i, k);
            }
        }
        json_t *rc = json_object_get(m, "reasoning_content");
        if (rc && !json_is_null(rc) && !json_is_string(rc))
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "messages[%zu].reasoning_content must be a string", i);
        json_t *calls = json_object_get(m, "tool_calls");
        if (calls && !json_is_null(calls)) {
            if (!json_is_array(calls))
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "messages[%zu].tool_calls must be an array", i);
            size_t k;
            json_t *c;
            json_array_foreach(calls, k, c) {
                if (!json_is_object(c))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "messages[%zu].tool_calls[%zu] must be an object",
                                     i, k);
                json_t *fn = json_object_get(c, "function");
                if (fn && !json_is_object(fn))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                     "messages[%zu].tool_calls[%zu].function must be an object", i, k);
                if (fn && !json_is_string(json_object_get(fn, "name")))
                    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                     "messages[%zu].tool_calls[%zu].function.name must be a string", i, k);
            }
        }
    }
    return ATOMC_OK;
}

// Joins text parts with "\n" (vLLM's string content format). Returns a new reference.
static json_t *flatten_parts(const json_t *content) {
    size_t total = 0, k;
    json_t *part;
    json_array_foreach(content, k, part) total += json_string_length(json_object_get(part, "text")) + 1;
    char *buf = malloc(total + 1);
    if (!buf) return NULL;
    size_t o = 0;
    json_array_foreach(content, k, part) {
        json_t *tx = json_object_get(part, "text");
        if (k) buf[o++] = '\n';
        memcpy(buf + o, json_string_value(tx), json_string_length(tx));
        o += json_string_length(tx);
    }
    json_t *s = json_stringn_nocheck(buf, o);
    free(buf);
    return s;
}

// The message's reasoning under any of the names clients use for it (HF's order), or NULL.
static json_t *reasoning_of(const json_t *m) {
    static const char *const names[] = {"reasoning_content", "thinking", "reasoning"};
    for (int i = 0; i < 3; i++) {
        json_t *v = json_object_get(m, names[i]);
        if (v && !json_is_null(v)) return v;
    }
    return NULL;
}

// As transformers' _alias_reasoning_fields: {"thinking": r, **message, "reasoning_content": r},
// so templates reading either name see the reasoning. Consumes m; returns a new object.
static json_t *alias_reasoning(json_t *m, json_t *reasoning) {
    json_t *r = json_incref(reasoning);
    json_t *out = json_object();
    if (out) {
        json_object_set(out, "thinking", r);
        const char *k;
        json_t *v;
        json_object_foreach(m, k, v) json_object_set(out, k, v);
        json_object_set(out, "reasoning_content", r);
    }
    json_decref(r);
    json_decref(m);
    return out;
}

#define CONTINUE_TAG "CONTINUE_FINAL_MESSAGE_TAG "

// Python str.strip() of ASCII/Unicode whitespace for the "final message appears" check.
static void strip_bounds(const char *s, size_t n, size_t *a, size_t *b) {
    size_t i = 0, j = n;
    while (i < j && (s[i] == ' ' || (s[i] >= '\t' && s[i] <= '\r') || (s[i] >= 0x1c && s[i] <= 0x1f))) i++;
    while (j > i && (s[j - 1] == ' ' || (s[j - 1] >= '\t' && s[j - 1] <= '\r') || (s[j - 1] >= 0x1c && s[j - 1] <= 0x1f)))
        j--;
    *a = i;
    *b = j;
}

static atomc_status render_impl(const struct chat_template *t, const json_t *messages, const json_t *tools,
                                const json_t *documents, bool add_generation_prompt, bool continue_final_message,
                                const json_t *kwargs, const char *bos_token, const char *eos_token,
                                const struct jinja_render_options *opt, char **out, struct error *err) {
    *out = NULL;
    if (documents && !json_is_null(documents) && !json_is_array(documents))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'documents' must be an array");
    atomc_status st = chat_template_validate_messages(messages, err);
    if (st != ATOMC_OK) return st;
    if (tools && !json_is_null(tools) && !json_is_array(tools))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'tools' must be an array");
    if (kwargs && !json_is_null(kwargs) && !json_is_object(kwargs))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'chat_template_kwargs' must be an object");
    if (continue_final_message && add_generation_prompt)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "continue_final_message and add_generation_prompt are not compatible: use "
                         "continue_final_message to continue the final message, add_generation_prompt to start a new "
                         "assistant message");

    // Messages as the template sees them: a copy only when something must change.
    json_t *msgs = (json_t *)messages;
    bool copied = false;
    size_t n = json_array_size(messages);
    {
        for (size_t i = 0; i < n; i++) {
            json_t *m = json_array_get(msgs, i);
            json_t *c = json_object_get(m, "content");
            bool last = i + 1 == n;
            bool flatten = !t->content_as_parts && json_is_array(c);
            json_t *reasoning = reasoning_of(m);
            if (!flatten && !reasoning && !(continue_final_message && last)) continue;
            if (!copied) {
                msgs = json_copy(msgs); // shallow: messages are replaced one by one below
                if (!msgs) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
                copied = true;
            }
            json_t *nm = json_deep_copy(m);
            if (!nm) {
                json_decref(msgs);
                return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
            }
            if (flatten) json_object_set_new(nm, "content", flatten_parts(c));
            if (reasoning) nm = alias_reasoning(nm, reasoning);
            if (!nm) {
                json_decref(msgs);
                return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
            }
            json_array_set_new(msgs, i, nm);
        }
    }
    char *final_text = NULL;
    if (continue_final_message) {
        if (!strstr(t->src, "content")) {
            if (copied) json_decref(msgs);
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "continue_final_message is set but the chat template does not read 'content'");
        }
        json_t *last = json_array_get(msgs, n - 1), *c = json_object_get(last, "content");
        json_t *target = NULL, *owner = last;
        if (json_is_string(c)) target = c;
        else if (json_is_array(c)) {
            for (size_t k = json_array_size(c); k-- > 0;) {
                json_t *tx = json_object_get(json_array_get(c, k), "text");
                if (json_is_string(tx)) {
                    target = tx;
                    owner = json_array_get(c, k);
                    break;
                }
            }
        }
        if (!target) {
            if (copied) json_decref(msgs);
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "continue_final_message is set but the final message has no text content to continue");
        }
        size_t tl = json_string_length(target);
        final_text = malloc(tl + sizeof CONTINUE_TAG);
        if (!final_text) {
            if (copied) json_decref(msgs);
            return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
        }
        memcpy(final_text, json_string_value(target), tl);
        memcpy(final_text + tl, CONTINUE_TAG, sizeof CONTINUE_TAG);
        json_object_set_new(owner, owner == last ? "content" : "text",
                            json_stringn_nocheck(final_text, tl + sizeof CONTINUE_TAG - 1));
        final_text[tl] = '\0';
    }

    json_t *vars = json_object();
    if (!vars) {
        free(final_text);
        if (copied) json_decref(msgs);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (bos_token) json_object_set_new(vars, "bos_token", json_string(bos_token));
    if (eos_token) json_object_set_new(vars, "eos_token", json_string(eos_token));
    if (kwargs && json_is_object(kwargs)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)kwargs, k, v) {
            if (!strcmp(k, "messages") || !strcmp(k, "tools") || !strcmp(k, "documents") ||
                !strcmp(k, "add_generation_prompt")) {
                json_decref(vars);
                free(final_text);
                if (copied) json_decref(msgs);
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                                 "chat_template_kwargs may not set '%s' (it is a request field)", k);
            }
            json_object_set(vars, k, v);
        }
    }
    json_object_set(vars, "messages", msgs);
    json_object_set_new(vars, "tools", tools ? json_incref((json_t *)tools) : json_null());
    json_object_set_new(vars, "documents", documents ? json_incref((json_t *)documents) : json_null());
    json_object_set_new(vars, "add_generation_prompt", json_boolean(add_generation_prompt));
    if (copied) json_decref(msgs);

    char *text = NULL;
    size_t len = 0;
    st = jinja_render(t->jt, vars, opt, &text, &len, err);
    json_decref(vars);
    if (st != ATOMC_OK) {
        free(final_text);
        return error_prefix(err, "chat template: ");
    }
    if (continue_final_message) {
        // cut where the tagged final content ends (HF semantics)
        const char *tag = "CONTINUE_FINAL_MESSAGE_TAG";
        size_t a, b;
        strip_bounds(final_text, strlen(final_text), &a, &b);
        bool present = b == a || memmem(text, len, final_text + a, b - a) != NULL;
        char *loc = NULL;
        for (char *p = text; (p = memmem(p, len - (size_t)(p - text), tag, strlen(tag))); p++) loc = p;
        free(final_text);
        if (!present || !loc) {
            free(text);
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "continue_final_message is set but the final message does not appear in the rendered "
                             "chat: the template changes or drops it");
        }
        if (!strncmp(loc, CONTINUE_TAG, strlen(CONTINUE_TAG))) *loc = '\0';
        else {
            while (loc > text && (loc[-1] == ' ' || (loc[-1] >= '\t' && loc[-1] <= '\r'))) loc--;
            *loc = '\0';
        }
    }
    *out = text;
    return ATOMC_OK;
}

atomc_status chat_template_render_ex(const struct chat_template *t, const json_t *messages, const json_t *tools,
                                     bool add_generation_prompt, bool continue_final_message, const json_t *kwargs,
                                     const char *bos_token, const char *eos_token,
                                     const struct jinja_render_options *opt, char **out, struct error *err) {
    return render_impl(t, messages, tools, NULL, add_generation_prompt, continue_final_message, kwargs, bos_token,
                       eos_token, opt, out, err);
}

atomc_status chat_template_render(const struct chat_template *t, const json_t *messages, const json_t *tools,
                                  bool add_generation_prompt, bool continue_final_message, const json_t *kwargs,
                                  const char *bos_token, const char *eos_token, char **out, struct error *err) {
    return chat_template_render_ex(t, messages, tools, add_generation_prompt, continue_final_message, kwargs,
                                   bos_token, eos_token, NULL, out, err);
}

atomc_status chat_template_render_request(const struct chat_template *t, const json_t *request, const char *bos_token,
                                          const char *eos_token, char **out, struct error *err) {
    *out = NULL;
    if (!json_is_object(request)) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "request body must be a JSON object");
    json_t *messages = json_object_get(request, "messages");
    if (!messages) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'messages' is required");
    json_t *tools = json_object_get(request, "tools");
    if (tools && json_is_null(tools)) tools = NULL;
    const char *bools[2] = {"add_generation_prompt", "continue_final_message"};
    bool vals[2] = {true, false};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(request, bools[i]);
        if (v && !json_is_null(v)) {
            if (!json_is_boolean(v))
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "'%s' must be a boolean", bools[i]);
            vals[i] = json_is_true(v);
        }
    }
    // continuing the final message implies no new assistant header unless asked explicitly
    if (vals[1] && !json_is_true(json_object_get(request, "add_generation_prompt"))) vals[0] = false;
    json_t *kwargs = json_object_get(request, "chat_template_kwargs");
    if (kwargs && json_is_null(kwargs)) kwargs = NULL;
    json_t *documents = json_object_get(request, "documents");
    if (documents && json_is_null(documents)) documents = NULL;
    return render_impl(t, messages, tools, documents, vals[0], vals[1], kwargs, bos_token, eos_token, NULL, out, err);
}

// ---------------------------------------------------------------- loading
static atomc_status read_file(const char *path, char **out, struct error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return error_set(err, ATOMC_ERR_IO, "cannot open %s", path);
    struct sbuf b;
    sbuf_init(&b, (size_t)64 << 20);
    char tmp[65536];
    size_t k;
    while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) sbuf_put(&b, tmp, k);
    bool bad = ferror(f);
    fclose(f);
    if (bad || b.overflow) {
        sbuf_free(&b);
        return error_set(err, ATOMC_ERR_IO, "cannot read %s (error or larger than 64 MiB)", path);
    }
    if (!b.p) {
        b.p = strdup("");
        if (!b.p) return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "out of memory");
    }
    *out = b.p;
    return ATOMC_OK;
}

static char *token_text(json_t *v) {
    if (json_is_string(v)) return strdup(json_string_value(v));
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return strdup(json_string_value(json_object_get(v, "content")));
    return NULL;
}

static atomc_status load_tokenizer_config(const char *path, bool want_tools, struct chat_template_source *out,
                                          struct error *err) {
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je);
    if (!cfg) return error_set(err, ATOMC_ERR_FORMAT, "%s: invalid JSON at line %d: %s", path, je.line, je.text);
    out->bos_token = token_text(json_object_get(cfg, "bos_token"));
    out->eos_token = token_text(json_object_get(cfg, "eos_token"));
    json_t *ct = json_object_get(cfg, "chat_template");
    atomc_status st = ATOMC_OK;
    if (json_is_string(ct)) {
        out->template_src = strdup(json_string_value(ct));
    } else if (json_is_array(ct)) {
        const char *def = NULL, *tool_use = NULL;
        size_t i;
        json_t *e;
        json_array_foreach(ct, i, e) {
            const char *name = json_string_value(json_object_get(e, "name"));
            const char *tpl = json_string_value(json_object_get(e, "template"));
            if (!name || !tpl) {
                st = error_set(err, ATOMC_ERR_FORMAT, "%s: chat_template[%zu] must have string 'name' and 'template'",
                               path, i);
                break;
            }
            if (!strcmp(name, "default")) def = tpl;
            if (!strcmp(name, "tool_use")) tool_use = tpl;
        }
        if (st == ATOMC_OK) {
            const char *pick = (want_tools && tool_use) ? tool_use : def;
            if (!pick)
                st = error_set(err, ATOMC_ERR_FORMAT, "%s: chat_template list has no 'default' template", path);
            else out->template_src = strdup(pick);
        }
    } else if (ct && !json_is_null(ct)) {
        st = error_set(err, ATOMC_ERR_FORMAT, "%s: chat_template must be a string or a list of {name, template}", path);
    }
    json_decref(cfg);
    return st;
}

static atomc_status load_gguf(const char *path, bool want_tools, struct chat_template_source *out,
                              struct error *err) {
    struct gguf_file *g;
    atomc_status st = gguf_open(&g, path, err);
    if (st != ATOMC_OK) return st;
    const char *s;
    size_t len;
    // named templates live under tokenizer.chat_template.<name> (llama.cpp's convention)
    const char *key = want_tools && gguf_has_key(g, "tokenizer.chat_template.tool_use") ? "tokenizer.chat_template.tool_use"
                                                                                          : "tokenizer.chat_template";
    if (gguf_has_key(g, key) && gguf_get_str(g, key, &s, &len, NULL) == ATOMC_OK) out->template_src = strndup(s, len);
    const char *keys[2] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"};
    char **dst[2] = {&out->bos_token, &out->eos_token};
    enum gguf_type et;
    uint64_t n_tok = 0;
    bool have_tokens = gguf_has_key(g, "tokenizer.ggml.tokens") &&
                       gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n_tok, NULL) == ATOMC_OK &&
                       et == GGUF_TYPE_STRING;
    for (int i = 0; i < 2 && have_tokens; i++) {
        uint32_t id;
        if (!gguf_has_key(g, keys[i]) || gguf_get_u32(g, keys[i], &id, NULL) != ATOMC_OK || id >= n_tok) continue;
        if (gguf_get_arr_str(g, "tokenizer.ggml.tokens", id, &s, &len, NULL) == ATOMC_OK) *dst[i] = strndup(s, len);
    }
    gguf_close(g);
    return ATOMC_OK;
}

// A directory with exactly one .gguf file (and no tokenizer_config.json) means that file.
static bool find_single_gguf(const char *dir, char *path, size_t n) {
    DIR *d = opendir(dir);
    if (!d) return false;
    int found = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l > 5 && !strcmp(e->d_name + l - 5, ".gguf")) {
            if (++found == 1) snprintf(path, n, "%s/%s", dir, e->d_name);
        }
    }
    closedir(d);
    return found == 1;
}

atomc_status chat_template_source_load(const char *model_path, const char *override_file, bool want_tools,
                                       struct chat_template_source *out, struct error *err) {
    memset(out, 0, sizeof *out);
    atomc_status st = ATOMC_OK;
    if (model_path) {
        struct stat sb;
        if (stat(model_path, &sb) != 0) return error_set(err, ATOMC_ERR_IO, "model path %s does not exist", model_path);
        size_t pl = strlen(model_path);
        if (S_ISDIR(sb.st_mode)) {
            char p[4096];
            snprintf(p, sizeof p, "%s/tokenizer_config.json", model_path);
            if (stat(p, &sb) == 0) st = load_tokenizer_config(p, want_tools, out, err);
            else if (find_single_gguf(model_path, p, sizeof p)) st = load_gguf(p, want_tools, out, err);
            // transformers >= 4.43 may keep the template in its own file, which wins
            snprintf(p, sizeof p, "%s/chat_template.jinja", model_path);
            if (st == ATOMC_OK && stat(p, &sb) == 0) {
                free(out->template_src);
                out->template_src = NULL;
                st = read_file(p, &out->template_src, err);
            }
        } else if (pl >= 5 && !strcmp(model_path + pl - 5, ".gguf")) {
            st = load_gguf(model_path, want_tools, out, err);
        } else {
            st = load_tokenizer_config(model_path, want_tools, out, err);
        }
    }
    if (st == ATOMC_OK && override_file) {
        free(out->template_src);
        out->template_src = NULL;
        st = read_file(override_file, &out->template_src, err);
    }
    if (st == ATOMC_OK && !out->template_src)
        st = error_set(err, ATOMC_ERR_NOT_FOUND,
                       "%s has no chat template (tokenizer_config.json chat_template / GGUF tokenizer.chat_template); "
                       "pass --chat-template FILE",
                       model_path ? model_path : "the model");
    if (st != ATOMC_OK) chat_template_source_free(out);
    return st;
}

void chat_template_source_free(struct chat_template_source *s) {
    free(s->template_src);
    free(s->bos_token);
    free(s->eos_token);
    memset(s, 0, sizeof *s);
}
