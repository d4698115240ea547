// Structured output: grammars compiled against a tokenizer's vocabulary and matched token by
// token. A C interface over xgrammar (Apache-2.0, built from its sdist by scripts/setup.sh
// into build/third_party; see docs/ARCHITECTURE.md "Structured output"); the C++ lives only in
// xgr_shim.cc, nothing C++ crosses this header and every xgrammar exception becomes an
// atomc_status with its message.
//
// Objects:
//   grammar_vocab     the vocabulary as xgrammar sees it (the decoded bytes of every token id,
//                     "" for special tokens, which a grammar never allows; stop ids end a
//                     grammar that may terminate) plus a compiler and a compile cache keyed by
//                     (kind, text). Thread-safe: requests compile from any thread.
//   grammar_compiled  one compiled grammar, reference counted (the cache holds one reference,
//                     every matcher another), immutable, shared by any number of matchers.
//   grammar_matcher   one request's parse state: accept a token, fill the next-token bitmask,
//                     terminated?, rollback. Not thread-safe: one owner at a time.
//
// Bitmasks are grammar_bitmask_words(vocab_size) uint32 words per row, bit (id & 31) of word
// (id >> 5) set = token id allowed (xgrammar's and vLLM's layout). Ids at or past the
// tokenizer's vocabulary (a model's padded rows) are never allowed.
#ifndef ATOMC_GRAMMAR_GRAMMAR_H
#define ATOMC_GRAMMAR_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

#ifdef __cplusplus
extern "C" {
#endif

enum grammar_kind {
    GRAMMAR_JSON_SCHEMA = 1, // text: a JSON Schema document
    GRAMMAR_JSON_OBJECT,     // any JSON object (text ignored)
    GRAMMAR_REGEX,           // text: a regular expression the whole output must match
    GRAMMAR_CHOICE,          // text: a JSON array of strings; the output is exactly one of them
    GRAMMAR_EBNF,            // text: GBNF-style EBNF with a rule named "root"
    GRAMMAR_LARK,            // text: a Lark grammar with a rule named "start"
    GRAMMAR_STRUCTURAL_TAG,  // text: xgrammar's structural-tag JSON
};

// Bounds that refuse a grammar instead of compiling it (0 = the default in brackets).
struct grammar_limits {
    size_t max_text_bytes;      // [65536] source text
    double max_compile_seconds; // [10] longer compiles are refused (and not cached)
    size_t max_compiled_bytes;  // [256 MiB] compiled grammar size (its token-mask cache)
};

// Builds the vocabulary: tokens[i] / lens[i] are token i's decoded bytes (NULL or special =
// never allowed), for i < n_tokens; vocab_size >= n_tokens is the model's logits width (the
// ids past n_tokens are never allowed). stop_ids end a grammar (EOS ids).
struct grammar_vocab;
atomc_status grammar_vocab_create(const char *const *tokens, const size_t *lens, const bool *special, int n_tokens,
                                  int vocab_size, const int32_t *stop_ids, int n_stop,
                                  const struct grammar_limits *limits, struct grammar_vocab **out, struct error *err);
void grammar_vocab_free(struct grammar_vocab *v);
int grammar_vocab_size(const struct grammar_vocab *v);
int grammar_bitmask_words(int vocab_size);
// Cache statistics (for tests and metrics).
void grammar_vocab_cache_stats(struct grammar_vocab *v, int64_t *hits, int64_t *misses, int *entries);

// Compiles (kind, text) or returns the cached result; *out holds one reference. An invalid
// schema / regex / grammar, or one beyond the limits, is ATOMC_ERR_INVALID_ARGUMENT with a
// message naming the problem.
struct grammar_compiled;
atomc_status grammar_compile(struct grammar_vocab *v, enum grammar_kind kind, const char *text, size_t len,
                             struct grammar_compiled **out, struct error *err);
void grammar_compiled_retain(struct grammar_compiled *g);
void grammar_compiled_release(struct grammar_compiled *g);

// A fresh matcher at the grammar's start. max_rollback: tokens Rollback may undo (0 = none).
struct grammar_matcher;
atomc_status grammar_matcher_create(struct grammar_compiled *g, int max_rollback, struct grammar_matcher **out,
                                    struct error *err);
void grammar_matcher_free(struct grammar_matcher *m);
// Advances by one token; false (state unchanged) if the grammar does not allow it. A stop id
// is accepted only where the grammar may end; the matcher is then terminated.
bool grammar_matcher_accept(struct grammar_matcher *m, int32_t token);
// Writes the allowed next tokens into mask (grammar_bitmask_words(vocab_size) words). Returns
// false when every token is allowed (nothing to apply); the mask is still filled.
bool grammar_matcher_fill_mask(struct grammar_matcher *m, uint32_t *mask);
// The grammar accepted a stop token (or cannot continue): nothing more may be generated.
bool grammar_matcher_is_terminated(const struct grammar_matcher *m);
// The text so far is a complete match (a stop token would be accepted now).
bool grammar_matcher_can_end(const struct grammar_matcher *m);
void grammar_matcher_rollback(struct grammar_matcher *m, int n_tokens);

#ifdef __cplusplus
}
#endif

#endif
