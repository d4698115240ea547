// The extern "C" side of src/grammar/grammar.h over xgrammar's C++ API (TokenizerInfo,
// GrammarCompiler, CompiledGrammar, GrammarMatcher). Contract in grammar.h. Every call into
// xgrammar is wrapped in try/catch: xgrammar reports bad input (a schema it cannot convert, a
// regex or EBNF syntax error) by throwing, and no exception may cross into C.
//
// The compile cache is ours, not xgrammar's (its compiler cache is turned off): keyed by
// kind + '\0' + text, holding one reference per entry, bounded by entry count and by the
// compiled grammars' reported sizes (oldest entries dropped first). Failed compiles are not
// cached. Compiles run on the caller's thread outside the cache lock; two threads compiling
// the same new text both compile and the second result is dropped.
// The project's C headers, with C linkage (they carry no extern "C" of their own).
extern "C" {
#include "common/error.h"
}
#include "grammar/grammar.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>

namespace {

constexpr size_t DEFAULT_MAX_TEXT = 65536;
constexpr double DEFAULT_MAX_SECONDS = 10.0;
constexpr size_t DEFAULT_MAX_COMPILED = (size_t)256 << 20;
constexpr size_t CACHE_MAX_ENTRIES = 256;
constexpr size_t CACHE_MAX_BYTES = (size_t)1 << 30;

const char *kind_name(enum grammar_kind k) {
    switch (k) {
    case GRAMMAR_JSON_SCHEMA:
        return "json schema";
    case GRAMMAR_JSON_OBJECT:
        return "json object";
    case GRAMMAR_REGEX:
        return "regex";
    case GRAMMAR_CHOICE:
        return "choice";
    case GRAMMAR_EBNF:
        return "grammar";
    case GRAMMAR_LARK:
        return "lark grammar";
    case GRAMMAR_STRUCTURAL_TAG:
        return "structural tag";
    }
    return "grammar";
}

// First line of an exception message, at most ~300 bytes (xgrammar's messages can carry a
// whole grammar dump).
std::string short_what(const std::exception &ex) {
    std::string s = ex.what();
    size_t nl = s.find('\n');
    if (nl != std::string::npos) s.resize(nl);
    if (s.size() > 300) s = s.substr(0, 300) + "...";
    return s;
}

// A JSON string literal's contents (the choice list is JSON): returns false on bad syntax.
bool parse_json_string(const char *&p, const char *end, std::string *out) {
    if (p >= end || *p != '"') return false;
    p++;
    while (p < end && *p != '"') {
        unsigned char c = (unsigned char)*p;
        if (c < 0x20) return false;
        if (c != '\\') {
            out->push_back((char)c);
            p++;
            continue;
        }
        if (p + 1 >= end) return false;
        char e = p[1];
        p += 2;
        switch (e) {
        case '"':
            out->push_back('"');
            break;
        case '\\':
            out->push_back('\\');
            break;
        case '/':
            out->push_back('/');
            break;
        case 'b':
            out->push_back('\b');
            break;
        case 'f':
            out->push_back('\f');
            break;
        case 'n':
            out->push_back('\n');
            break;
        case 'r':
            out->push_back('\r');
            break;
        case 't':
            out->push_back('\t');
            break;
        case 'u': {
            auto hex4 = [&](unsigned *v) {
                if (end - p < 4) return false;
                *v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = p[i];
                    int d = h >= '0' && h <= '9'   ? h - '0'
                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                   : -1;
                    if (d < 0) return false;
                    *v = *v * 16 + (unsigned)d;
                }
                p += 4;
                return true;
            };
            unsigned cp;
            if (!hex4(&cp)) return false;
            if (cp >= 0xD800 && cp < 0xDC00) {
                unsigned lo;
                if (end - p < 6 || p[0] != '\\' || p[1] != 'u') return false;
                p += 2;
                if (!hex4(&lo) || lo < 0xDC00 || lo >= 0xE000) return false;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp < 0xE000) {
                return false;
            }
            if (cp < 0x80) {
                out->push_back((char)cp);
            } else if (cp < 0x800) {
                out->push_back((char)(0xC0 | (cp >> 6)));
                out->push_back((char)(0x80 | (cp & 0x3F)));
            } else if (cp < 0x10000) {
                out->push_back((char)(0xE0 | (cp >> 12)));
                out->push_back((char)(0x80 | ((cp >> 6) & 0x3F)));
                out->push_back((char)(0x80 | (cp & 0x3F)));
            } else {
                out->push_back((char)(0xF0 | (cp >> 18)));
                out->push_back((char)(0x80 | ((cp >> 12) & 0x3F)));
                out->push_back((char)(0x80 | ((cp >> 6) & 0x3F)));
                out->push_back((char)(0x80 | (cp & 0x3F)));
            }
            break;
        }
        default:
            return false;
        }
    }
    if (p >= end) return false;
    p++;
    return true;
}

// The choice list (a JSON array of non-empty strings) as EBNF: root ::= "a" | "b" | ...
// Returns an empty string with *why set on bad input.
std::string choice_to_ebnf(const char *text, size_t len, std::string *why) {
    const char *p = text, *end = text + len;
    auto ws = [&] {
        while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
            p++;
    };
    std::string ebnf = "root ::= ";
    int n = 0;
    ws();
    if (p >= end || *p != '[') {
        *why = "choice must be a JSON array of strings";
        return "";
    }
    p++;
    ws();
    if (p < end && *p == ']') {
        *why = "choice must list at least one string";
        return "";
    }
    for (;;) {
        ws();
        std::string s;
        if (!parse_json_string(p, end, &s)) {
            *why = "choice must be a JSON array of strings";
            return "";
        }
        if (s.empty()) {
            *why = "choice strings must not be empty";
            return "";
        }
        if (n++) ebnf += " | ";
        ebnf += '"';
        for (unsigned char c : s) {
            char buf[8];
            if (c == '"' || c == '\\') {
                ebnf += '\\';
                ebnf += (char)c;
            } else if (c < 0x20 || c == 0x7f) {
                snprintf(buf, sizeof buf, "\\u%04x", c);
                ebnf += buf;
            } else {
                ebnf += (char)c;
            }
        }
        ebnf += '"';
        ws();
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == ']') {
            p++;
            break;
        }
        *why = "choice must be a JSON array of strings";
        return "";
    }
    ws();
    if (p != end) {
        *why = "trailing characters after the choice array";
        return "";
    }
    return ebnf;
}

} // namespace

struct grammar_compiled {
    std::atomic<int> refs{1};
    xgrammar::CompiledGrammar cg;
    size_t bytes = 0;
    explicit grammar_compiled(xgrammar::CompiledGrammar c) : cg(std::move(c)) {}
};

struct grammar_vocab {
    xgrammar::TokenizerInfo info;
    xgrammar::GrammarCompiler compiler;
    int vocab_size;
    grammar_limits limits;
    std::mutex mu; // the cache
    std::unordered_map<std::string, grammar_compiled *> cache;
    std::deque<std::string> order; // insertion order, for eviction
    size_t cache_bytes = 0;
    int64_t hits = 0, misses = 0;
    grammar_vocab(xgrammar::TokenizerInfo ti, int vs, const grammar_limits &lim)
        : info(ti), compiler(ti, 2, false, -1), vocab_size(vs), limits(lim) {}
};

struct grammar_matcher {
    xgrammar::GrammarMatcher m;
    grammar_compiled *g;
    int words;
    explicit grammar_matcher(xgrammar::GrammarMatcher mm, grammar_compiled *gg, int w)
        : m(std::move(mm)), g(gg), words(w) {}
};

extern "C" {

int grammar_bitmask_words(int vocab_size) {
    return (vocab_size + 31) / 32;
}

atomc_status grammar_vocab_create(const char *const *tokens, const size_t *lens, const bool *special, int n_tokens,
                                  int vocab_size, const int32_t *stop_ids, int n_stop,
                                  const struct grammar_limits *limits, struct grammar_vocab **out, struct error *err) {
    *out = nullptr;
    if (n_tokens <= 0 || vocab_size < n_tokens)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "grammar vocabulary: %d tokens for a vocabulary of %d",
                         n_tokens, vocab_size);
    grammar_limits lim = limits ? *limits : grammar_limits{};
    if (!lim.max_text_bytes) lim.max_text_bytes = DEFAULT_MAX_TEXT;
    if (!(lim.max_compile_seconds > 0)) lim.max_compile_seconds = DEFAULT_MAX_SECONDS;
    if (!lim.max_compiled_bytes) lim.max_compiled_bytes = DEFAULT_MAX_COMPILED;
    try {
        std::vector<std::string> vocab((size_t)n_tokens);
        for (int i = 0; i < n_tokens; i++)
            if (tokens[i] && !(special && special[i])) vocab[(size_t)i].assign(tokens[i], lens[i]);
        std::vector<int32_t> stops;
        for (int i = 0; i < n_stop; i++)
            if (stop_ids[i] >= 0 && stop_ids[i] < n_tokens) stops.push_back(stop_ids[i]);
        if (stops.empty())
            return error_set(err, ATOMC_ERR_UNSUPPORTED,
                             "structured output needs an end-of-sequence token and the tokenizer has none");
        xgrammar::TokenizerInfo ti(vocab, xgrammar::VocabType::RAW, vocab_size, stops, false);
        *out = new grammar_vocab(ti, vocab_size, lim);
    } catch (const std::exception &ex) {
        return error_set(err, ATOMC_ERR_INTERNAL, "grammar vocabulary: %s", short_what(ex).c_str());
    }
    return ATOMC_OK;
}

void grammar_vocab_free(struct grammar_vocab *v) {
    if (!v) return;
    for (auto &kv : v->cache)
        grammar_compiled_release(kv.second);
    delete v;
}

int grammar_vocab_size(const struct grammar_vocab *v) {
    return v->vocab_size;
}

void grammar_vocab_cache_stats(struct grammar_vocab *v, int64_t *hits, int64_t *misses, int *entries) {
    std::lock_guard<std::mutex> lk(v->mu);
    if (hits) *hits = v->hits;
    if (misses) *misses = v->misses;
    if (entries) *entries = (int)v->cache.size();
}

void grammar_compiled_retain(struct grammar_compiled *g) {
    g->refs.fetch_add(1);
}

void grammar_compiled_release(struct grammar_compiled *g) {
    if (g && g->refs.fetch_sub(1) == 1) delete g;
}

atomc_status grammar_compile(struct grammar_vocab *v, enum grammar_kind kind, const char *text, size_t len,
                             struct grammar_compiled **out, struct error *err) {
    *out = nullptr;
    if (!text) len = 0;
    if (kind != GRAMMAR_JSON_OBJECT && len == 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%s: empty", kind_name(kind));
    if (len > v->limits.max_text_bytes)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%s: %zu bytes, more than the limit of %zu", kind_name(kind),
                         len, v->limits.max_text_bytes);
    std::string key(1, (char)kind);
    key.push_back('\0');
    if (kind != GRAMMAR_JSON_OBJECT) key.append(text, len);
    {
        std::lock_guard<std::mutex> lk(v->mu);
        auto it = v->cache.find(key);
        if (it != v->cache.end()) {
            v->hits++;
            grammar_compiled_retain(it->second);
            *out = it->second;
            return ATOMC_OK;
        }
        v->misses++;
    }
    auto t0 = std::chrono::steady_clock::now();
    grammar_compiled *g = nullptr;
    try {
        std::string src = kind == GRAMMAR_JSON_OBJECT ? std::string() : std::string(text, len);
        switch (kind) {
        case GRAMMAR_JSON_SCHEMA:
            // Compact separators and no free whitespace: the output is the JSON itself, and a
            // model sampled at temperature 1 cannot wander into unbounded runs of spaces.
            g = new grammar_compiled(v->compiler.CompileJSONSchema(
                src, false, std::nullopt, std::make_pair(std::string(", "), std::string(": ")), true));
            break;
        case GRAMMAR_JSON_OBJECT:
            g = new grammar_compiled(v->compiler.CompileJSONSchema("{\"type\": \"object\"}", false, std::nullopt,
                                                                   std::make_pair(std::string(", "), std::string(": ")),
                                                                   false));
            break;
        case GRAMMAR_REGEX:
            g = new grammar_compiled(v->compiler.CompileRegex(src));
            break;
        case GRAMMAR_CHOICE: {
            std::string why;
            std::string ebnf = choice_to_ebnf(text, len, &why);
            if (ebnf.empty()) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "choice: %s", why.c_str());
            g = new grammar_compiled(v->compiler.CompileGrammar(ebnf, "root"));
            break;
        }
        case GRAMMAR_EBNF:
            g = new grammar_compiled(v->compiler.CompileGrammar(src, "root"));
            break;
        case GRAMMAR_LARK:
            g = new grammar_compiled(v->compiler.CompileLark(src));
            break;
        case GRAMMAR_STRUCTURAL_TAG:
            g = new grammar_compiled(v->compiler.CompileStructuralTag(src));
            break;
        default:
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown grammar kind %d", (int)kind);
        }
        g->bytes = g->cg.MemorySizeBytes();
    } catch (const std::exception &ex) {
        delete g;
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "invalid %s: %s", kind_name(kind), short_what(ex).c_str());
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (secs > v->limits.max_compile_seconds) {
        grammar_compiled_release(g);
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%s took %.1f s to compile, more than the limit of %.1f s",
                         kind_name(kind), secs, v->limits.max_compile_seconds);
    }
    if (g->bytes > v->limits.max_compiled_bytes) {
        size_t b = g->bytes;
        grammar_compiled_release(g);
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%s compiles to %zu bytes, more than the limit of %zu",
                         kind_name(kind), b, v->limits.max_compiled_bytes);
    }
    std::lock_guard<std::mutex> lk(v->mu);
    auto it = v->cache.find(key);
    if (it != v->cache.end()) { // another thread compiled it meanwhile
        grammar_compiled_release(g);
        grammar_compiled_retain(it->second);
        *out = it->second;
        return ATOMC_OK;
    }
    while (!v->order.empty() && (v->cache.size() >= CACHE_MAX_ENTRIES || v->cache_bytes + g->bytes > CACHE_MAX_BYTES)) {
        auto old = v->cache.find(v->order.front());
        v->order.pop_front();
        if (old == v->cache.end()) continue;
        v->cache_bytes -= old->second->bytes;
        grammar_compiled_release(old->second);
        v->cache.erase(old);
    }
    v->cache.emplace(key, g);
    v->order.push_back(key);
    v->cache_bytes += g->bytes;
    grammar_compiled_retain(g); // the caller's reference; the cache keeps the first
    *out = g;
    return ATOMC_OK;
}

atomc_status grammar_matcher_create(struct grammar_compiled *g, int max_rollback, struct grammar_matcher **out,
                                    struct error *err) {
    *out = nullptr;
    try {
        xgrammar::GrammarMatcher m(g->cg, std::nullopt, false, max_rollback > 0 ? max_rollback : 0);
        int words = grammar_bitmask_words(g->cg.GetTokenizerInfo().GetVocabSize());
        *out = new grammar_matcher(std::move(m), g, words);
    } catch (const std::exception &ex) {
        return error_set(err, ATOMC_ERR_INTERNAL, "grammar matcher: %s", short_what(ex).c_str());
    }
    grammar_compiled_retain(g);
    return ATOMC_OK;
}

void grammar_matcher_free(struct grammar_matcher *m) {
    if (!m) return;
    grammar_compiled *g = m->g;
    delete m;
    grammar_compiled_release(g);
}

bool grammar_matcher_accept(struct grammar_matcher *m, int32_t token) {
    try {
        return m->m.AcceptToken(token);
    } catch (const std::exception &) {
        return false;
    }
}

bool grammar_matcher_fill_mask(struct grammar_matcher *m, uint32_t *mask) {
    int64_t shape[1] = {m->words};
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = mask;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = DLDataType{kDLInt, 32, 1};
    t.shape = shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    try {
        return m->m.FillNextTokenBitmask(&t, 0);
    } catch (const std::exception &) {
        // Cannot happen for a live matcher; allow only the stop tokens so the request ends.
        memset(mask, 0, (size_t)m->words * 4);
        for (int32_t id : m->g->cg.GetTokenizerInfo().GetStopTokenIds())
            mask[id >> 5] |= 1u << (id & 31);
        return true;
    }
}

bool grammar_matcher_is_terminated(const struct grammar_matcher *m) {
    return m->m.IsTerminated();
}

bool grammar_matcher_can_end(const struct grammar_matcher *m) {
    return m->m.IsCompleted();
}

void grammar_matcher_rollback(struct grammar_matcher *m, int n_tokens) {
    try {
        m->m.Rollback(n_tokens);
    } catch (const std::exception &) {
    }
}

} // extern "C"
