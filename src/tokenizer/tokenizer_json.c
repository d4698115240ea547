// Loads an HF tokenizer.json (+ tokenizer_config.json and chat_template.jinja beside it).
//
// Supported: model BPE (vocab, merges as "a b" strings or [a, b] pairs, byte_fallback,
// ignore_merges, unk_token, fuse_unk, continuing_subword_prefix, end_of_word_suffix);
// normalizers NFC/NFD/NFKC/NFKD, Prepend, Replace, Lowercase, Strip, Sequence; pre-tokenizers
// Split (String/Regex, all behaviours, invert), ByteLevel, Digits, Metaspace, Whitespace,
// WhitespaceSplit, Sequence; decoders ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip,
// Sequence; post-processors TemplateProcessing, ByteLevel, Bert/RobertaProcessing, Sequence.
// Anything else is refused with ATOMC_ERR_UNSUPPORTED naming the component.
//
// add_bos_token / add_eos_token in tokenizer_config.json rebuild the single-sequence template
// as transformers' Llama/Gemma fast tokenizers do (`update_post_processor`): [bos] A [eos].
// Other tokenizer classes keep the post-processor of tokenizer.json, as HF `tokenizers` does.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mapped_file.h"
#include "tokenizer/tokenizer_internal.h"

struct json_loader {
    struct tokenizer *t;
    const char *path;
    struct error *err;
};

static atomc_status bad(struct json_loader *L, atomc_status st, const char *what) {
    return error_set(L->err, st, "tokenizer: %s: %s", L->path, what);
}

static const char *jstr(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static bool jbool(json_t *o, const char *key, bool dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

// Pattern objects: {"String": "..."} or {"Regex": "..."}.
static atomc_status parse_pattern(struct json_loader *L, json_t *pat, char **literal, size_t *literal_len,
                                  pcre2_code **re) {
    json_t *s = json_object_get(pat, "String"), *r = json_object_get(pat, "Regex");
    if (json_is_string(s)) {
        size_t n = json_string_length(s);
        *literal = tokenizer_pool_strdup(L->t, json_string_value(s), n);
        *literal_len = n;
        if (!*literal) return bad(L, ATOMC_ERR_OUT_OF_MEMORY, "pattern");
        return ATOMC_OK;
    }
    if (json_is_string(r)) return tokenizer_compile_regex(json_string_value(r), json_string_length(r), re, L->err);
    return bad(L, ATOMC_ERR_FORMAT, "pattern is neither {\"String\"} nor {\"Regex\"}");
}

static atomc_status parse_normalizer(struct json_loader *L, json_t *n) {
    if (json_is_null(n) || !n) return ATOMC_OK;
    const char *type = jstr(n, "type");
    if (!type) return bad(L, ATOMC_ERR_FORMAT, "normalizer without a type");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(n, "normalizers"), *item;
        size_t i;
        json_array_foreach(list, i, item) {
            atomc_status st = parse_normalizer(L, item);
            if (st) return st;
        }
        return ATOMC_OK;
    }
    struct tokenizer *t = L->t;
    struct tok_normalizer *v = realloc(t->norms, (size_t)(t->n_norms + 1) * sizeof *v);
    if (!v) return bad(L, ATOMC_ERR_OUT_OF_MEMORY, "normalizers");
    t->norms = v;
    struct tok_normalizer *nm = &v[t->n_norms];
    memset(nm, 0, sizeof *nm);
    if (!strcmp(type, "NFC")) nm->type = TOK_NORM_NFC;
    else if (!strcmp(type, "NFD")) nm->type = TOK_NORM_NFD;
    else if (!strcmp(type, "NFKC")) nm->type = TOK_NORM_NFKC;
    else if (!strcmp(type, "NFKD")) nm->type = TOK_NORM_NFKD;
    else if (!strcmp(type, "Lowercase")) nm->type = TOK_NORM_LOWERCASE;
    else if (!strcmp(type, "Strip")) {
        nm->type = TOK_NORM_STRIP;
        nm->left = jbool(n, "strip_left", true);
        nm->right = jbool(n, "strip_right", true);
    } else if (!strcmp(type, "Prepend")) {
        json_t *p = json_object_get(n, "prepend");
        if (!json_is_string(p)) return bad(L, ATOMC_ERR_FORMAT, "Prepend normalizer without \"prepend\"");
        nm->type = TOK_NORM_PREPEND;
        nm->str_len = json_string_length(p);
        nm->str = tokenizer_pool_strdup(t, json_string_value(p), nm->str_len);
    } else if (!strcmp(type, "Replace")) {
        json_t *c = json_object_get(n, "content");
        if (!json_is_string(c)) return bad(L, ATOMC_ERR_FORMAT, "Replace normalizer without \"content\"");
        nm->type = TOK_NORM_REPLACE;
        nm->content_len = json_string_length(c);
        nm->content = tokenizer_pool_strdup(t, json_string_value(c), nm->content_len);
        atomc_status st = parse_pattern(L, json_object_get(n, "pattern"), &nm->str, &nm->str_len, &nm->re);
        if (st) return st;
        if (!nm->re && !nm->str_len) return bad(L, ATOMC_ERR_FORMAT, "Replace normalizer with an empty pattern");
    } else {
        char msg[128];
        snprintf(msg, sizeof msg, "normalizer \"%s\" is not supported", type);
        return bad(L, ATOMC_ERR_UNSUPPORTED, msg);
    }
    t->n_norms++;
    return ATOMC_OK;
}

static enum tok_prepend_scheme parse_prepend_scheme(json_t *o) {
    const char *s = jstr(o, "prepend_scheme");
    if (s) return !strcmp(s, "first") ? TOK_PREPEND_FIRST : !strcmp(s, "never") ? TOK_PREPEND_NEVER : TOK_PREPEND_ALWAYS;
    return jbool(o, "add_prefix_space", true) ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
}

static atomc_status parse_replacement(struct json_loader *L, json_t *o, char *out, size_t *len) {
    const char *r = jstr(o, "replacement");
    if (!r) r = "\xE2\x96\x81";  // U+2581
    size_t n = strlen(r);
    if (!n || n > 4 || tok_utf8_valid_len((const unsigned char *)r, n) != (int)n)
        return bad(L, ATOMC_ERR_FORMAT, "Metaspace replacement must be one character");
    memcpy(out, r, n);
    *len = n;
    return ATOMC_OK;
}

static atomc_status parse_pretok(struct json_loader *L, json_t *p) {
    if (json_is_null(p) || !p) return ATOMC_OK;
    const char *type = jstr(p, "type");
    if (!type) return bad(L, ATOMC_ERR_FORMAT, "pre_tokenizer without a type");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(p, "pretokenizers"), *item;
        size_t i;
        json_array_foreach(list, i, item) {
            atomc_status st = parse_pretok(L, item);
            if (st) return st;
        }
        return ATOMC_OK;
    }
    struct tokenizer *t = L->t;
    struct tok_pretok *v = realloc(t->pretoks, (size_t)(t->n_pretoks + 1) * sizeof *v);
    if (!v) return bad(L, ATOMC_ERR_OUT_OF_MEMORY, "pre-tokenizers");
    t->pretoks = v;
    struct tok_pretok *pt = &v[t->n_pretoks];
    memset(pt, 0, sizeof *pt);
    atomc_status st = ATOMC_OK;
    if (!strcmp(type, "Split")) {
        pt->type = TOK_PRETOK_SPLIT;
        const char *b = jstr(p, "behavior");
        if (!b) return bad(L, ATOMC_ERR_FORMAT, "Split pre-tokenizer without a behavior");
        if (!strcmp(b, "Removed")) pt->behavior = TOK_SPLIT_REMOVED;
        else if (!strcmp(b, "Isolated")) pt->behavior = TOK_SPLIT_ISOLATED;
        else if (!strcmp(b, "MergedWithPrevious")) pt->behavior = TOK_SPLIT_MERGED_WITH_PREVIOUS;
        else if (!strcmp(b, "MergedWithNext")) pt->behavior = TOK_SPLIT_MERGED_WITH_NEXT;
        else if (!strcmp(b, "Contiguous")) pt->behavior = TOK_SPLIT_CONTIGUOUS;
        else return bad(L, ATOMC_ERR_FORMAT, "Split pre-tokenizer with an unknown behavior");
        pt->invert = jbool(p, "invert", false);
        st = parse_pattern(L, json_object_get(p, "pattern"), &pt->literal, &pt->literal_len, &pt->re);
        if (!st && !pt->re && !pt->literal_len) return bad(L, ATOMC_ERR_FORMAT, "Split with an empty pattern");
    } else if (!strcmp(type, "ByteLevel")) {
        pt->type = TOK_PRETOK_BYTE_LEVEL;
        pt->add_prefix_space = jbool(p, "add_prefix_space", true);
        pt->use_regex = jbool(p, "use_regex", true);
        if (pt->use_regex) st = tokenizer_compile_regex(tokenizer_gpt2_pattern, strlen(tokenizer_gpt2_pattern), &pt->re, L->err);
    } else if (!strcmp(type, "Digits")) {
        pt->type = TOK_PRETOK_DIGITS;
        pt->individual_digits = jbool(p, "individual_digits", false);
    } else if (!strcmp(type, "Metaspace")) {
        pt->type = TOK_PRETOK_METASPACE;
        pt->prepend_scheme = parse_prepend_scheme(p);
        pt->split = jbool(p, "split", true);
        st = parse_replacement(L, p, pt->replacement, &pt->replacement_len);
    } else if (!strcmp(type, "WhitespaceSplit")) {
        pt->type = TOK_PRETOK_WHITESPACE_SPLIT;
    } else if (!strcmp(type, "Whitespace")) {
        // HF: the words of \w+|[^\w\s]+, whitespace removed.
        static const char ws[] = "\\w+|[^\\w\\s]+";
        pt->type = TOK_PRETOK_SPLIT;
        pt->behavior = TOK_SPLIT_REMOVED;
        pt->invert = true;
        st = tokenizer_compile_regex(ws, strlen(ws), &pt->re, L->err);
    } else {
        char msg[128];
        snprintf(msg, sizeof msg, "pre-tokenizer \"%s\" is not supported", type);
        return bad(L, ATOMC_ERR_UNSUPPORTED, msg);
    }
    t->n_pretoks++;  // counted even on error so tokenizer_free releases a compiled regex
    return st;
}

static atomc_status parse_decoder(struct json_loader *L, json_t *d) {
    if (json_is_null(d) || !d) return ATOMC_OK;
    const char *type = jstr(d, "type");
    if (!type) return bad(L, ATOMC_ERR_FORMAT, "decoder without a type");
    struct tokenizer *t = L->t;
    t->has_decoder = true;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(d, "decoders"), *item;
        size_t i;
        json_array_foreach(list, i, item) {
            atomc_status st = parse_decoder(L, item);
            if (st) return st;
        }
        return ATOMC_OK;
    }
    struct tok_decoder *v = realloc(t->decoders, (size_t)(t->n_decoders + 1) * sizeof *v);
    if (!v) return bad(L, ATOMC_ERR_OUT_OF_MEMORY, "decoders");
    t->decoders = v;
    struct tok_decoder *dc = &v[t->n_decoders];
    memset(dc, 0, sizeof *dc);
    if (!strcmp(type, "ByteLevel")) dc->type = TOK_DEC_BYTE_LEVEL;
    else if (!strcmp(type, "ByteFallback")) dc->type = TOK_DEC_BYTE_FALLBACK;
    else if (!strcmp(type, "Fuse")) dc->type = TOK_DEC_FUSE;
    else if (!strcmp(type, "Metaspace")) {
        dc->type = TOK_DEC_METASPACE;
        dc->prepend_scheme = parse_prepend_scheme(d);
        atomc_status st = parse_replacement(L, d, dc->replacement, &dc->replacement_len);
        if (st) return st;
    } else if (!strcmp(type, "Replace")) {
        dc->type = TOK_DEC_REPLACE;
        json_t *pat = json_object_get(json_object_get(d, "pattern"), "String"), *c = json_object_get(d, "content");
        if (!json_is_string(pat) || !json_string_length(pat) || !json_is_string(c))
            return bad(L, ATOMC_ERR_UNSUPPORTED, "Replace decoder needs a non-empty String pattern and a content");
        dc->pattern_len = json_string_length(pat);
        dc->pattern = tokenizer_pool_strdup(t, json_string_value(pat), dc->pattern_len);
        dc->content_len = json_string_length(c);
        dc->content = tokenizer_pool_strdup(t, json_string_value(c), dc->content_len);
    } else if (!strcmp(type, "Strip")) {
        dc->type = TOK_DEC_STRIP;
        const char *c = jstr(d, "content");
        if (!c || !*c) return bad(L, ATOMC_ERR_FORMAT, "Strip decoder without content");
        dc->content_len = (size_t)tok_utf8_valid_len((const unsigned char *)c, strlen(c));
        if (!dc->content_len) return bad(L, ATOMC_ERR_FORMAT, "Strip decoder content is not UTF-8");
        dc->content = tokenizer_pool_strdup(t, c, dc->content_len);
        dc->start = (int)json_integer_value(json_object_get(d, "start"));
        dc->stop = (int)json_integer_value(json_object_get(d, "stop"));
    } else {
        char msg[128];
        snprintf(msg, sizeof msg, "decoder \"%s\" is not supported", type);
        return bad(L, ATOMC_ERR_UNSUPPORTED, msg);
    }
    t->n_decoders++;
    return ATOMC_OK;
}

static atomc_status tmpl_push(struct json_loader *L, int32_t id) {
    struct tokenizer *t = L->t;
    int32_t *v = realloc(t->tmpl, (size_t)(t->n_tmpl + 1) * sizeof *v);
    if (!v) return bad(L, ATOMC_ERR_OUT_OF_MEMORY, "post-processor");
    t->tmpl = v;
    v[t->n_tmpl++] = id;
    return ATOMC_OK;
}

// Special token given as [name, id] (Bert/Roberta processors).
static atomc_status tmpl_push_pair(struct json_loader *L, json_t *pair) {
    json_t *id = json_array_get(pair, 1);
    if (!json_is_integer(id)) return bad(L, ATOMC_ERR_FORMAT, "post-processor special token without an id");
    return tmpl_push(L, (int32_t)json_integer_value(id));
}

static atomc_status parse_post(struct json_loader *L, json_t *p, bool *has_seq) {
    if (json_is_null(p) || !p) return ATOMC_OK;
    const char *type = jstr(p, "type");
    if (!type) return bad(L, ATOMC_ERR_FORMAT, "post_processor without a type");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(p, "processors"), *item;
        size_t i;
        json_array_foreach(list, i, item) {
            atomc_status st = parse_post(L, item, has_seq);
            if (st) return st;
        }
        return ATOMC_OK;
    }
    if (!strcmp(type, "ByteLevel")) return ATOMC_OK;  // offsets only
    if (*has_seq) return bad(L, ATOMC_ERR_UNSUPPORTED, "more than one template post-processor");
    *has_seq = true;
    L->t->n_tmpl = 0;
    if (!strcmp(type, "TemplateProcessing")) {
        json_t *single = json_object_get(p, "single"), *specials = json_object_get(p, "special_tokens"), *item;
        size_t i;
        json_array_foreach(single, i, item) {
            json_t *sp = json_object_get(item, "SpecialToken");
            atomc_status st;
            if (sp) {
                const char *name = jstr(sp, "id");
                json_t *ids = json_object_get(json_object_get(specials, name ? name : ""), "ids"), *id;
                if (!json_is_array(ids)) return bad(L, ATOMC_ERR_FORMAT, "template special token without ids");
                size_t k;
                json_array_foreach(ids, k, id) {
                    if (!json_is_integer(id)) return bad(L, ATOMC_ERR_FORMAT, "template special token id");
                    st = tmpl_push(L, (int32_t)json_integer_value(id));
                    if (st) return st;
                }
            } else if (json_object_get(item, "Sequence")) {
                st = tmpl_push(L, -1);
                if (st) return st;
            } else {
                return bad(L, ATOMC_ERR_FORMAT, "template item is neither SpecialToken nor Sequence");
            }
        }
        return ATOMC_OK;
    }
    if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
        atomc_status st = tmpl_push_pair(L, json_object_get(p, "cls"));
        if (!st) st = tmpl_push(L, -1);
        if (!st) st = tmpl_push_pair(L, json_object_get(p, "sep"));
        return st;
    }
    char msg[128];
    snprintf(msg, sizeof msg, "post-processor \"%s\" is not supported", type);
    return bad(L, ATOMC_ERR_UNSUPPORTED, msg);
}

static atomc_status parse_model(struct json_loader *L, json_t *m) {
    struct tokenizer *t = L->t;
    const char *type = jstr(m, "type");
    json_t *vocab = json_object_get(m, "vocab"), *merges = json_object_get(m, "merges");
    if (type && strcmp(type, "BPE")) {
        char msg[128];
        snprintf(msg, sizeof msg, "model type \"%s\" is not supported (only BPE)", type);
        return bad(L, ATOMC_ERR_UNSUPPORTED, msg);
    }
    if (!json_is_object(vocab)) return bad(L, ATOMC_ERR_FORMAT, "model.vocab is missing or not an object");
    if (merges && !json_is_array(merges) && !json_is_null(merges)) return bad(L, ATOMC_ERR_FORMAT, "model.merges is not an array");
    int max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= (1 << 24))
            return bad(L, ATOMC_ERR_FORMAT, "model.vocab has a non-integer or out-of-range id");
        if (json_integer_value(val) > max_id) max_id = (int)json_integer_value(val);
    }
    atomc_status st = tokenizer_reserve_ids(t, max_id + 1, L->err);
    if (!st) st = tok_strmap_init(&t->vocab, json_object_size(vocab), L->err);
    if (st) return st;
    json_object_foreach(vocab, key, val) {
        size_t n = strlen(key);
        int32_t id = (int32_t)json_integer_value(val);
        char *s = tokenizer_pool_strdup(t, key, n);
        if (!s) return bad(L, ATOMC_ERR_OUT_OF_MEMORY, "vocab");
        tok_strmap_put(&t->vocab, s, n, id);
        t->piece[id] = s;
        t->piece_len[id] = (uint32_t)n;
    }
    const char *pre = jstr(m, "continuing_subword_prefix"), *suf = jstr(m, "end_of_word_suffix");
    if (pre && *pre) {
        t->cont_prefix_len = strlen(pre);
        t->cont_prefix = tokenizer_pool_strdup(t, pre, t->cont_prefix_len);
    }
    if (suf && *suf) {
        t->end_suffix_len = strlen(suf);
        t->end_suffix = tokenizer_pool_strdup(t, suf, t->end_suffix_len);
    }
    size_t n_merges = json_is_array(merges) ? json_array_size(merges) : 0;
    st = tok_mergemap_init(&t->merges, n_merges, L->err);
    if (st) return st;
    struct tok_buf joined = {0};
    for (size_t i = 0; i < n_merges; i++) {
        json_t *mg = json_array_get(merges, i);
        const char *a, *b;
        size_t alen, blen;
        if (json_is_string(mg)) {
            a = json_string_value(mg);
            const char *sp = strchr(a, ' ');
            if (!sp) {
                tok_buf_free(&joined);
                return bad(L, ATOMC_ERR_FORMAT, "a merge is not \"left right\"");
            }
            alen = (size_t)(sp - a);
            b = sp + 1;
            blen = strlen(b);
        } else if (json_is_array(mg) && json_array_size(mg) == 2 && json_is_string(json_array_get(mg, 0)) &&
                   json_is_string(json_array_get(mg, 1))) {
            a = json_string_value(json_array_get(mg, 0));
            alen = json_string_length(json_array_get(mg, 0));
            b = json_string_value(json_array_get(mg, 1));
            blen = json_string_length(json_array_get(mg, 1));
        } else {
            tok_buf_free(&joined);
            return bad(L, ATOMC_ERR_FORMAT, "a merge is neither a string nor a pair of strings");
        }
        // HF: the merged token is a + b without b's continuing_subword_prefix.
        size_t skip = t->cont_prefix_len <= blen ? t->cont_prefix_len : 0;
        joined.len = 0;
        tok_buf_append(&joined, a, alen);
        tok_buf_append(&joined, b + skip, blen - skip);
        int32_t ia = tok_strmap_get(&t->vocab, a, alen), ib = tok_strmap_get(&t->vocab, b, blen);
        int32_t inew = joined.failed ? -1 : tok_strmap_get(&t->vocab, joined.p, joined.len);
        if (ia < 0 || ib < 0 || inew < 0) {
            error_set(L->err, ATOMC_ERR_FORMAT, "tokenizer: %s: merge %zu (\"%.*s\" + \"%.*s\") uses a token not in the vocab",
                      L->path, i, (int)alen, a, (int)blen, b);
            tok_buf_free(&joined);
            return ATOMC_ERR_FORMAT;
        }
        tok_mergemap_put(&t->merges, ia, ib, (int32_t)i, inew);
    }
    tok_buf_free(&joined);
    t->byte_fallback = jbool(m, "byte_fallback", false);
    t->fuse_unk = jbool(m, "fuse_unk", false);
    t->ignore_merges = jbool(m, "ignore_merges", false);
    const char *unk = jstr(m, "unk_token");
    if (unk) {
        t->unk_id = tok_strmap_get(&t->vocab, unk, strlen(unk));
        if (t->unk_id < 0) return bad(L, ATOMC_ERR_FORMAT, "model.unk_token is not in the vocab");
    }
    if (json_is_number(json_object_get(m, "dropout")) && json_number_value(json_object_get(m, "dropout")) > 0)
        return bad(L, ATOMC_ERR_UNSUPPORTED, "BPE dropout is not supported");
    return ATOMC_OK;
}

static atomc_status parse_added(struct json_loader *L, json_t *list) {
    json_t *item;
    size_t i;
    json_array_foreach(list, i, item) {
        json_t *id = json_object_get(item, "id"), *content = json_object_get(item, "content");
        if (!json_is_integer(id) || !json_is_string(content))
            return bad(L, ATOMC_ERR_FORMAT, "added_tokens entry without integer id and string content");
        bool special = jbool(item, "special", false);
        atomc_status st = tokenizer_add_token(L->t, (int32_t)json_integer_value(id), json_string_value(content),
                                              json_string_length(content), special, jbool(item, "lstrip", false),
                                              jbool(item, "rstrip", false), jbool(item, "normalized", !special),
                                              jbool(item, "single_word", false), L->err);
        if (st) return error_prefix(L->err, "%s: ", L->path);
    }
    return ATOMC_OK;
}

// bos_token / eos_token: a string or an AddedToken object {"content": ...}.
static const char *config_token(json_t *cfg, const char *key) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return jstr(v, "content");
    return NULL;
}

// cfg: the parsed tokenizer_config.json (may be NULL; the caller keeps ownership); json_path: where to look for
// chat_template.jinja (NULL: nowhere).
static atomc_status load_config(struct json_loader *L, json_t *cfg, const char *json_path) {
    struct tokenizer *t = L->t;
    const char *bos = config_token(cfg, "bos_token"), *eos = config_token(cfg, "eos_token");
    if (bos) {
        t->bos_text = tokenizer_pool_strdup(t, bos, strlen(bos));
        t->bos_id = tokenizer_token_id(t, bos);
    }
    if (eos) {
        t->eos_text = tokenizer_pool_strdup(t, eos, strlen(eos));
        t->eos_id = tokenizer_token_id(t, eos);
    }
    // chat_template: a string, or a list of {name, template} (pick "default").
    json_t *ct = json_object_get(cfg, "chat_template");
    const char *tmpl = NULL;
    if (json_is_string(ct)) tmpl = json_string_value(ct);
    else if (json_is_array(ct)) {
        json_t *item;
        size_t i;
        json_array_foreach(ct, i, item) {
            const char *name = jstr(item, "name");
            if (name && !strcmp(name, "default")) tmpl = jstr(item, "template");
        }
    }
    if (tmpl) t->chat_template = tokenizer_pool_strdup(t, tmpl, strlen(tmpl));
    else if (json_path) {
        // transformers >= 4.43 may store it beside the config as chat_template.jinja.
        const char *slash = strrchr(json_path, '/');
        size_t dir_len = slash ? (size_t)(slash - json_path) + 1 : 0;
        char path[4096];
        if (dir_len + 32 < sizeof path) {
            memcpy(path, json_path, dir_len);
            strcpy(path + dir_len, "chat_template.jinja");
            char *text;
            size_t len;
            if (file_exists(path) && file_read_all(path, &text, &len, NULL) == ATOMC_OK) {
                t->chat_template = tokenizer_pool_strdup(t, text, len);
                free(text);
            }
        }
    }
    const char *cls = jstr(cfg, "tokenizer_class");
    json_t *ab = json_object_get(cfg, "add_bos_token"), *ae = json_object_get(cfg, "add_eos_token");
    bool llama_like = cls && (strstr(cls, "LlamaTokenizer") || strstr(cls, "GemmaTokenizer"));
    if (llama_like && (json_is_boolean(ab) || json_is_boolean(ae))) {
        bool add_bos = json_is_true(ab), add_eos = json_is_true(ae);
        atomc_status st = ATOMC_OK;
        if ((add_bos && t->bos_id < 0) || (add_eos && t->eos_id < 0))
            st = bad(L, ATOMC_ERR_FORMAT, "add_bos_token/add_eos_token set but the token is not in the vocab");
        if (!st) {
            t->n_tmpl = 0;
            if (add_bos) st = tmpl_push(L, t->bos_id);
            if (!st) st = tmpl_push(L, -1);
            if (!st && add_eos) st = tmpl_push(L, t->eos_id);
        }
        if (st) return st;
    }
    return ATOMC_OK;
}

atomc_status tokenizer_apply_config(struct tokenizer *t, json_t *cfg, const char *json_path, const char *name,
                                    struct error *err) {
    struct json_loader L = {.t = t, .path = name, .err = err};
    return load_config(&L, cfg, json_path);
}

// Builds the tokenizer from parsed documents (root and cfg are released here).
static atomc_status load_from_json(json_t *root, json_t *cfg, const char *name, const char *json_path,
                                   struct tokenizer **out, struct error *err) {
    struct tokenizer *t = tokenizer_alloc();
    if (!t) {
        json_decref(root);
        json_decref(cfg);
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "tokenizer: %s", name);
    }
    struct json_loader L = {.t = t, .path = name, .err = err};
    atomc_status st = ATOMC_OK;
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) st = bad(&L, ATOMC_ERR_FORMAT, "no \"model\" object");
    if (!st) st = parse_model(&L, model);
    if (!st) st = parse_added(&L, json_object_get(root, "added_tokens"));
    if (!st) st = parse_normalizer(&L, json_object_get(root, "normalizer"));
    if (!st) st = parse_pretok(&L, json_object_get(root, "pre_tokenizer"));
    if (!st) st = parse_decoder(&L, json_object_get(root, "decoder"));
    bool has_seq = false;
    if (!st) st = parse_post(&L, json_object_get(root, "post_processor"), &has_seq);
    if (!st && !has_seq) st = tmpl_push(&L, -1);
    json_decref(root);
    if (!st) st = load_config(&L, cfg, json_path);
    json_decref(cfg);
    if (!st) st = tokenizer_finish(t, err);
    if (st) {
        tokenizer_free(t);
        return st;
    }
    *out = t;
    return ATOMC_OK;
}

atomc_status tokenizer_load_json(const char *json_path, const char *config_path, struct tokenizer **out,
                                 struct error *err) {
    *out = NULL;
    json_error_t jerr;
    // Parse from a mapping: jansson's json_load_file reads with getc, several times slower.
    struct mapped_file mf;
    atomc_status st0 = mapped_file_open(&mf, json_path, err);
    if (st0) {
        error_prefix(err, "tokenizer: ");
        return st0;
    }
    json_t *root = json_loadb((const char *)mf.data, mf.size, 0, &jerr);
    mapped_file_close(&mf);
    if (!root) return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: %s:%d: %s", json_path, jerr.line, jerr.text);
    json_t *cfg = NULL;
    if (config_path) {
        cfg = json_load_file(config_path, JSON_DECODE_INT_AS_REAL, &jerr);  // model_max_length may be 1e30
        if (!cfg) {
            json_decref(root);
            return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: %s:%d: %s", config_path, jerr.line, jerr.text);
        }
    }
    return load_from_json(root, cfg, json_path, json_path, out, err);
}

atomc_status tokenizer_load_json_buffer(const char *json, size_t len, const char *config, size_t config_len,
                                        struct tokenizer **out, struct error *err) {
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_loadb(json, len, 0, &jerr);
    if (!root) return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: tokenizer.json:%d: %s", jerr.line, jerr.text);
    json_t *cfg = NULL;
    if (config) {
        cfg = json_loadb(config, config_len, JSON_DECODE_INT_AS_REAL, &jerr);
        if (!cfg) {
            json_decref(root);
            return error_set(err, ATOMC_ERR_FORMAT, "tokenizer: tokenizer_config.json:%d: %s", jerr.line, jerr.text);
        }
    }
    return load_from_json(root, cfg, "tokenizer.json", NULL, out, err);
}
