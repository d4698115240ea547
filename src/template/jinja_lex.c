// Jinja lexer with HF's whitespace settings (trim_blocks=True, lstrip_blocks=True).
//
// It follows jinja2.lexer's rules so that data text comes out byte-identical:
// - the source has \r\n / \r normalized to \n and one trailing newline dropped (done by
//   jinja_compile before lexing);
// - `{%-`, `{{-`, `{#-` strip all whitespace before the tag; `-%}`, `-}}`, `-#}` all
//   whitespace after it; `+` on either side disables the automatic rules;
// - trim_blocks: one "\n" directly after `%}` / `#}` is dropped;
// - lstrip_blocks: spaces before `{%` / `{#` are dropped when only whitespace separates
//   the tag from the start of its line (or the end of the previous tag, when that tag's
//   own match ended with a newline);
// - inside tags, `}}` / `%}` end the tag only while no bracket is open;
// - `{% raw %}...{% endraw %}` text is passed through verbatim.
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "template/jinja_internal.h"

struct lexer {
    struct jinja_template *t;
    const char *s;
    size_t n, pos;
    struct token *toks;
    size_t n_toks, cap;
    // line tracking (monotonic positions)
    size_t lc_pos;
    int lc_line;
    size_t lc_line_start;
    struct error *err;
    bool failed;
};

static void lex_linecol(struct lexer *L, size_t pos, int *line, int *col) {
    if (pos < L->lc_pos) { // rare: restart
        L->lc_pos = 0;
        L->lc_line = 1;
        L->lc_line_start = 0;
    }
    for (size_t i = L->lc_pos; i < pos && i < L->n; i++)
        if (L->s[i] == '\n') {
            L->lc_line++;
            L->lc_line_start = i + 1;
        }
    L->lc_pos = pos;
    *line = L->lc_line;
    *col = (int)(pos - L->lc_line_start) + 1;
}

static bool lex_fail(struct lexer *L, size_t pos, const char *fmt, const char *arg) {
    int line, col;
    lex_linecol(L, pos, &line, &col);
    char msg[256];
    snprintf(msg, sizeof msg, fmt, arg);
    error_set(L->err, ATOMC_ERR_FORMAT, "template syntax error at line %d, column %d: %s", line, col, msg);
    L->failed = true;
    return false;
}

static struct token *lex_push(struct lexer *L, enum tok_type type, size_t start, size_t len) {
    if (L->n_toks == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        struct token *p = realloc(L->toks, cap * sizeof *p);
        if (!p) {
            error_set(L->err, ATOMC_ERR_OUT_OF_MEMORY, "template lexer: out of memory");
            L->failed = true;
            return NULL;
        }
        L->toks = p;
        L->cap = cap;
    }
    struct token *k = &L->toks[L->n_toks++];
    memset(k, 0, sizeof *k);
    k->t = type;
    k->p = L->s + start;
    k->n = len;
    lex_linecol(L, start, &k->line, &k->col);
    return k;
}

// Python's \s (Unicode whitespace) at s[i]; returns its byte length or 0.
static size_t ws_len(const char *s, size_t n, size_t i) {
    size_t j = i;
    uint32_t cp = utf8_next(s, n, &j);
    return py_isspace(cp) ? j - i : 0;
}

static size_t skip_ws(const char *s, size_t n, size_t i) {
    size_t k;
    while (i < n && (k = ws_len(s, n, i)) > 0) i += k;
    return i;
}

// End of text after stripping trailing whitespace from [a, b).
static size_t rstrip_ws(const char *s, size_t a, size_t b) {
    while (b > a) {
        size_t p = utf8_prev(s, b);
        if (p < a) break;
        size_t j = p;
        if (!py_isspace(utf8_next(s, b, &j))) break;
        b = p;
    }
    return b;
}

// lstrip_blocks: [a, b) is the text before a block/comment tag.
static size_t lstrip_text(struct lexer *L, size_t a, size_t b, bool line_starting) {
    size_t l_pos = b;
    while (l_pos > a && L->s[l_pos - 1] != '\n') l_pos--;
    bool had_newline = l_pos > a;
    if (!had_newline && !line_starting) return b;
    if (l_pos == b) return b;
    size_t i = l_pos;
    while (i < b) {
        size_t k = ws_len(L->s, b, i);
        if (!k) return b;
        i += k;
    }
    return l_pos;
}

static void emit_data(struct lexer *L, size_t a, size_t b) {
    if (b <= a) return;
    struct token *k = lex_push(L, TK_DATA, a, b - a);
    if (k) {
        k->str = (char *)L->s + a;
        k->str_len = b - a;
    }
}

static bool starts(const struct lexer *L, size_t i, const char *lit) {
    size_t m = strlen(lit);
    return i + m <= L->n && !memcmp(L->s + i, lit, m);
}

static bool is_name_start(unsigned char c) { return isalpha(c) || c == '_'; }
static bool is_name_char(unsigned char c) { return isalnum(c) || c == '_'; }

// Matches `{%[-+]?\s*<word>\s*` at i; returns the position after, or 0.
static size_t match_block_word(struct lexer *L, size_t i, const char *word, char *sign) {
    if (!starts(L, i, "{%")) return 0;
    size_t j = i + 2;
    *sign = 0;
    if (j < L->n && (L->s[j] == '-' || L->s[j] == '+')) *sign = L->s[j++];
    j = skip_ws(L->s, L->n, j);
    size_t wl = strlen(word);
    if (!starts(L, j, word)) return 0;
    j += wl;
    j = skip_ws(L->s, L->n, j);
    return j;
}

// String literal body [a, b) -> decoded Python string (unicode-escape semantics).
static bool decode_string(struct lexer *L, size_t a, size_t b, struct token *k) {
    char *out = arena_alloc(&L->t->ar, (b - a) * 4 + 1);
    if (!out) return lex_fail(L, a, "%s", "out of memory");
    size_t o = 0, i = a;
    const char *s = L->s;
    while (i < b) {
        if (s[i] != '\\') {
            out[o++] = s[i++];
            continue;
        }
        if (i + 1 >= b) {
            out[o++] = '\\';
            i++;
            continue;
        }
        char c = s[i + 1];
        i += 2;
        uint32_t cp;
        int nhex = 0;
        switch (c) {
        case '\n': continue;
        case '\\': out[o++] = '\\'; continue;
        case '\'': out[o++] = '\''; continue;
        case '"': out[o++] = '"'; continue;
        case 'a': out[o++] = '\a'; continue;
        case 'b': out[o++] = '\b'; continue;
        case 'f': out[o++] = '\f'; continue;
        case 'n': out[o++] = '\n'; continue;
        case 'r': out[o++] = '\r'; continue;
        case 't': out[o++] = '\t'; continue;
        case 'v': out[o++] = '\v'; continue;
        case 'x': nhex = 2; break;
        case 'u': nhex = 4; break;
        case 'U': nhex = 8; break;
        case 'N': return lex_fail(L, i - 2, "%s", "\\N{...} escapes are not supported");
        default:
            if (c >= '0' && c <= '7') {
                cp = (uint32_t)(c - '0');
                for (int d = 0; d < 2 && i < b && s[i] >= '0' && s[i] <= '7'; d++) cp = cp * 8 + (uint32_t)(s[i++] - '0');
                goto put_cp;
            }
            if ((unsigned char)c >= 0x80) {
                // Jinja backslash-replaces non-ASCII before decoding: "\é" reads as "\" + "xe9".
                size_t j = i - 1;
                uint32_t u = utf8_next(s, b, &j);
                i = j;
                char tmp[16];
                int m = u < 0x100 ? snprintf(tmp, sizeof tmp, "x%02x", u)
                        : u < 0x10000 ? snprintf(tmp, sizeof tmp, "u%04x", u)
                                      : snprintf(tmp, sizeof tmp, "U%08x", u);
                out[o++] = '\\';
                memcpy(out + o, tmp, (size_t)m);
                o += (size_t)m;
                continue;
            }
            out[o++] = '\\';
            out[o++] = c;
            continue;
        }
        cp = 0;
        for (int d = 0; d < nhex; d++) {
            if (i >= b || !isxdigit((unsigned char)s[i])) return lex_fail(L, i, "%s", "truncated \\x/\\u/\\U escape");
            char h = s[i++];
            cp = cp * 16 + (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
        }
    put_cp:
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return lex_fail(L, i, "%s", "escape is not a valid Unicode scalar value");
        {
            struct sbuf tmp;
            sbuf_init(&tmp, 0);
            sbuf_put_utf8(&tmp, cp);
            memcpy(out + o, tmp.p, tmp.n);
            o += tmp.n;
            sbuf_free(&tmp);
        }
    }
    out[o] = '\0';
    k->str = out;
    k->str_len = o;
    return true;
}

static const char *const OPS2[] = {"//", "**", "==", "!=", ">=", "<="};
static const char OPS1[] = "+-/*%~[](){}><=.:|,;";

// Lexes one tag's contents starting at pos; `kind` is '{' (variable) or '%' (block).
static bool lex_tag(struct lexer *L, char kind, size_t tag_start, bool *line_starting) {
    char stack[256];
    int depth = 0;
    const char *s = L->s;
    size_t n = L->n;
    while (true) {
        size_t i = L->pos;
        if (depth == 0) {
            if (kind == '%') {
                if (starts(L, i, "+%}")) {
                    lex_push(L, TK_BLOCK_END, i, 3);
                    L->pos = i + 3;
                    *line_starting = false;
                    return !L->failed;
                }
                if (starts(L, i, "-%}")) {
                    lex_push(L, TK_BLOCK_END, i, 3);
                    L->pos = skip_ws(s, n, i + 3);
                    *line_starting = L->pos > i + 3 && s[L->pos - 1] == '\n';
                    return !L->failed;
                }
                if (starts(L, i, "%}")) {
                    lex_push(L, TK_BLOCK_END, i, 2);
                    L->pos = i + 2;
                    *line_starting = false;
                    if (L->pos < n && s[L->pos] == '\n') {
                        L->pos++;
                        *line_starting = true;
                    }
                    return !L->failed;
                }
            } else {
                if (starts(L, i, "-}}")) {
                    lex_push(L, TK_VAR_END, i, 3);
                    L->pos = skip_ws(s, n, i + 3);
                    *line_starting = L->pos > i + 3 && s[L->pos - 1] == '\n';
                    return !L->failed;
                }
                if (starts(L, i, "}}")) {
                    lex_push(L, TK_VAR_END, i, 2);
                    L->pos = i + 2;
                    *line_starting = false;
                    return !L->failed;
                }
            }
        }
        if (i >= n)
            return lex_fail(L, tag_start, "%s",
                            kind == '%' ? "unexpected end of template: missing '%}'" : "unexpected end of template: missing '}}'");
        size_t j = skip_ws(s, n, i);
        if (j > i) {
            L->pos = j;
            continue;
        }
        unsigned char c = (unsigned char)s[i];
        if (isdigit(c)) {
            // float: (\d+_)*\d+ ((\.(\d+_)*\d+)? e[+-]?(\d+_)*\d+ | \.(\d+_)*\d+), not right after '.'
            size_t k = i;
            while (k < n && (isdigit((unsigned char)s[k]) || (s[k] == '_' && k + 1 < n && isdigit((unsigned char)s[k + 1]))))
                k++;
            size_t int_end = k;
            bool is_float = false;
            if (!(i > 0 && s[i - 1] == '.')) {
                size_t m = k;
                bool frac = false;
                if (m + 1 < n && s[m] == '.' && isdigit((unsigned char)s[m + 1])) {
                    m++;
                    while (m < n && (isdigit((unsigned char)s[m]) || (s[m] == '_' && m + 1 < n && isdigit((unsigned char)s[m + 1]))))
                        m++;
                    frac = true;
                }
                size_t e = m;
                bool expo = false;
                if (e < n && (s[e] == 'e' || s[e] == 'E')) {
                    size_t q = e + 1;
                    if (q < n && (s[q] == '+' || s[q] == '-')) q++;
                    if (q < n && isdigit((unsigned char)s[q])) {
                        while (q < n && (isdigit((unsigned char)s[q]) || (s[q] == '_' && q + 1 < n && isdigit((unsigned char)s[q + 1]))))
                            q++;
                        e = q;
                        expo = true;
                    }
                }
                if (expo) {
                    k = e;
                    is_float = true;
                } else if (frac) {
                    k = m;
                    is_float = true;
                }
            }
            char buf[128];
            size_t bl = 0;
            for (size_t q = i; q < k && bl < sizeof buf - 1; q++)
                if (s[q] != '_') buf[bl++] = s[q];
            buf[bl] = '\0';
            if (!is_float) {
                // integers: 0x / 0o / 0b prefixes, else decimal (a leading 0 only for 0, 00, ...)
                if (c == '0' && int_end == i + 1 && i + 2 < n && strchr("xXoObB", s[i + 1])) {
                    int base = (s[i + 1] == 'x' || s[i + 1] == 'X') ? 16 : (s[i + 1] == 'o' || s[i + 1] == 'O') ? 8 : 2;
                    size_t q = i + 2;
                    bl = 0;
                    while (q < n && (isxdigit((unsigned char)s[q]) || s[q] == '_') && bl < sizeof buf - 1) {
                        if (s[q] != '_') buf[bl++] = s[q];
                        q++;
                    }
                    buf[bl] = '\0';
                    if (!bl) return lex_fail(L, i, "%s", "invalid integer literal");
                    char *endp;
                    errno = 0;
                    unsigned long long v = strtoull(buf, &endp, base);
                    if (*endp || errno || v > INT64_MAX) return lex_fail(L, i, "%s", "invalid or too large integer literal");
                    struct token *t = lex_push(L, TK_INT, i, q - i);
                    if (t) t->i = (int64_t)v;
                    L->pos = q;
                    continue;
                }
                if (c == '0') { // 0(_?0)*
                    k = i + 1;
                    while (k < n && (s[k] == '0' || (s[k] == '_' && k + 1 < n && s[k + 1] == '0'))) k++;
                }
                errno = 0;
                char *endp;
                unsigned long long v = strtoull(buf, &endp, 10);
                if (errno || v > INT64_MAX) return lex_fail(L, i, "%s", "integer literal too large");
                struct token *t = lex_push(L, TK_INT, i, k - i);
                if (t) t->i = (int64_t)v;
            } else {
                struct token *t = lex_push(L, TK_FLOAT, i, k - i);
                if (t) t->f = strtod(buf, NULL);
            }
            L->pos = k;
            continue;
        }
        if (is_name_start(c)) {
            size_t k = i + 1;
            while (k < n && is_name_char((unsigned char)s[k])) k++;
            struct token *t = lex_push(L, TK_NAME, i, k - i);
            if (!t) return false;
            char *nm = arena_alloc(&L->t->ar, k - i + 1);
            if (!nm) return lex_fail(L, i, "%s", "out of memory");
            memcpy(nm, s + i, k - i);
            nm[k - i] = '\0';
            t->str = nm;
            t->str_len = k - i;
            L->pos = k;
            continue;
        }
        if (c == '\'' || c == '"') {
            size_t k = i + 1;
            while (k < n && s[k] != (char)c) {
                if (s[k] == '\\' && k + 1 < n) k++;
                k++;
            }
            if (k >= n) return lex_fail(L, i, "unexpected char '%s' (unterminated string)", c == '"' ? "\"" : "'");
            struct token *t = lex_push(L, TK_STRING, i, k + 1 - i);
            if (!t || !decode_string(L, i + 1, k, t)) return false;
            L->pos = k + 1;
            continue;
        }
        size_t oplen = 0;
        for (size_t q = 0; q < sizeof OPS2 / sizeof OPS2[0]; q++)
            if (starts(L, i, OPS2[q])) oplen = 2;
        if (!oplen && c && strchr(OPS1, c)) oplen = 1;
        if (!oplen) {
            char ch[8] = {0};
            size_t q = i;
            utf8_next(s, n, &q);
            memcpy(ch, s + i, q - i < 7 ? q - i : 7);
            return lex_fail(L, i, "unexpected char '%s'", ch);
        }
        if (oplen == 1 && (c == '(' || c == '[' || c == '{')) {
            if (depth >= (int)sizeof stack) return lex_fail(L, i, "%s", "brackets nested too deeply");
            stack[depth++] = c == '(' ? ')' : c == '[' ? ']' : '}';
        } else if (oplen == 1 && (c == ')' || c == ']' || c == '}')) {
            char cs[2] = {(char)c, 0};
            if (depth == 0) return lex_fail(L, i, "unexpected '%s'", cs);
            if (stack[depth - 1] != (char)c) return lex_fail(L, i, "unexpected '%s' (unbalanced brackets)", cs);
            depth--;
        }
        lex_push(L, TK_OP, i, oplen);
        L->pos = i + oplen;
        if (L->failed) return false;
    }
}

atomc_status jinja_lex(struct jinja_template *t, struct token **toks, size_t *n_toks, struct error *err) {
    struct lexer L = {.t = t, .s = t->src, .n = t->src_len, .lc_line = 1, .err = err};
    bool line_starting = true;
    const char *s = L.s;
    size_t n = L.n;
    while (L.pos < n && !L.failed) {
        // next tag start
        size_t q = L.pos;
        const char *hit = NULL;
        while (q + 1 < n) {
            const char *p = memchr(s + q, '{', n - q - 1);
            if (!p) break;
            q = (size_t)(p - s);
            if (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#') {
                hit = p;
                break;
            }
            q++;
        }
        if (!hit) {
            emit_data(&L, L.pos, n);
            L.pos = n;
            break;
        }
        char kind = s[q + 1];
        char sign = (q + 2 < n && (s[q + 2] == '-' || s[q + 2] == '+')) ? s[q + 2] : 0;
        // raw block?  {%[-+]?\s*raw\s*(-%}\s*|%})
        size_t raw_end = 0;
        bool raw_strip_after = false;
        if (kind == '%') {
            char rs;
            size_t j = match_block_word(&L, q, "raw", &rs);
            if (j) {
                if (starts(&L, j, "-%}")) {
                    raw_end = j + 3;
                    raw_strip_after = true;
                } else if (starts(&L, j, "%}")) {
                    raw_end = j + 2;
                }
            }
        }
        size_t text_end = q;
        if (sign == '-') text_end = rstrip_ws(s, L.pos, q);
        else if (sign != '+' && kind != '{') text_end = lstrip_text(&L, L.pos, q, line_starting);
        emit_data(&L, L.pos, text_end);
        if (raw_end) {
            size_t i = raw_end;
            if (raw_strip_after) i = skip_ws(s, n, i);
            bool ls = s[i - 1] == '\n';
            // find {%[-+]?\s*endraw\s*(+%}|-%}\s*|%}\n?)
            size_t k = i, body_end = 0, after = 0;
            char esign = 0;
            while (k + 1 < n) {
                const char *p = memchr(s + k, '{', n - k - 1);
                if (!p) break;
                k = (size_t)(p - s);
                size_t j = match_block_word(&L, k, "endraw", &esign);
                if (j) {
                    if (starts(&L, j, "+%}")) after = j + 3;
                    else if (starts(&L, j, "-%}")) after = skip_ws(s, n, j + 3);
                    else if (starts(&L, j, "%}")) {
                        after = j + 2;
                        if (after < n && s[after] == '\n') after++;
                    }
                    if (after) {
                        body_end = k;
                        break;
                    }
                }
                k++;
            }
            if (!after) {
                lex_fail(&L, q, "%s", "missing end of raw directive");
                break;
            }
            size_t te = body_end;
            if (esign == '-') te = rstrip_ws(s, i, body_end);
            else if (esign != '+') te = lstrip_text(&L, i, body_end, ls);
            emit_data(&L, i, te);
            L.pos = after;
            line_starting = s[after - 1] == '\n';
            continue;
        }
        size_t body = q + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            // comment: ends at the first "#}" (a '-' or '+' right before it is its sign)
            size_t k = body;
            size_t end = 0;
            while (k + 1 < n) {
                const char *p = memchr(s + k, '#', n - k - 1);
                if (!p) break;
                k = (size_t)(p - s);
                if (s[k + 1] == '}') {
                    end = k;
                    break;
                }
                k++;
            }
            if (!end) {
                lex_fail(&L, q, "%s", "missing end of comment tag");
                break;
            }
            char esign = (end > body && (s[end - 1] == '-' || s[end - 1] == '+')) ? s[end - 1] : 0;
            size_t after = end + 2;
            if (esign == '-') after = skip_ws(s, n, after);
            else if (esign != '+' && after < n && s[after] == '\n') after++;
            line_starting = after > end + 2 && s[after - 1] == '\n';
            L.pos = after;
            continue;
        }
        lex_push(&L, kind == '{' ? TK_VAR_BEGIN : TK_BLOCK_BEGIN, q, body - q);
        L.pos = body;
        if (!lex_tag(&L, kind == '{' ? '{' : '%', q, &line_starting)) break;
    }
    if (!L.failed) lex_push(&L, TK_EOF, n, 0);
    if (L.failed) {
        free(L.toks);
        return err ? err->status : ATOMC_ERR_FORMAT;
    }
    *toks = L.toks;
    *n_toks = L.n_toks;
    return ATOMC_OK;
}
