// Internal representation shared by the tokenizer's source files (not a public interface).
//
// A tokenizer is the HF `tokenizers` pipeline, flattened into arrays:
//   added-token split (raw trie) -> normalizers -> added-token split (normalized trie)
//   -> pre-tokenizers -> BPE model per word -> post-processor template
// and for decoding: id -> piece -> decoder chain. Everything is built once at load time and is
// read-only afterwards (thread-safe encode/decode); per-call scratch lives on the caller's stack
// or in buffers owned by the call.
#ifndef ATOMC_TOKENIZER_TOKENIZER_INTERNAL_H
#define ATOMC_TOKENIZER_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tokenizer.h"

// ---- growable byte buffer. Appends never fail loudly: on allocation failure `failed` is set and
// later appends are ignored; callers check `failed` once at the end of an operation.
struct tok_buf {
    char *p;
    size_t len, cap;
    bool failed;
};
void tok_buf_append(struct tok_buf *b, const void *data, size_t n);
void tok_buf_putc(struct tok_buf *b, char c);
void tok_buf_free(struct tok_buf *b);

// ---- a list of byte-string pieces backed by one text buffer (offsets, so the buffer may grow).
struct tok_piece {
    size_t off, len;  // into the list's text buffer
    int32_t id;       // >= 0: already a token (an added token); -1: text still to be processed
    bool at_start;    // piece begins at offset 0 of the original input (Metaspace prepend_scheme "first")
};
struct tok_pieces {
    struct tok_piece *v;
    int n, cap;
    struct tok_buf text;
    bool failed;
};
void tok_pieces_push(struct tok_pieces *p, const char *s, size_t len, int32_t id, bool at_start);
void tok_pieces_clear(struct tok_pieces *p);
void tok_pieces_free(struct tok_pieces *p);

// ---- UTF-8 helpers.
// Length of the valid UTF-8 sequence at s (1..4), or 0 if the bytes at s do not start one.
int tok_utf8_valid_len(const unsigned char *s, size_t n);
// Number of bytes of the maximal invalid subpart at s (what one U+FFFD replaces, as in Python's
// errors="replace" and Rust's from_utf8_lossy). Only call where tok_utf8_valid_len returned 0.
int tok_utf8_invalid_len(const unsigned char *s, size_t n);
bool tok_utf8_is_valid(const char *s, size_t n);
// Appends s to out with every maximal invalid subpart replaced by U+FFFD.
void tok_utf8_append_lossy(struct tok_buf *out, const char *s, size_t n);
// Decodes one code point (input must be valid UTF-8); returns its byte length.
int tok_utf8_decode(const char *s, size_t n, int32_t *cp);
int tok_utf8_encode(int32_t cp, char out[4]);

// ---- hash maps (keys hashed with xxhash's XXH3).
struct tok_strmap_slot {
    const char *key;  // NULL = empty; points into the tokenizer's string pool
    uint32_t len;
    int32_t value;
};
struct tok_strmap {
    struct tok_strmap_slot *slots;
    size_t mask;  // capacity - 1 (power of two)
    size_t count;
};
atomc_status tok_strmap_init(struct tok_strmap *m, size_t expected, struct error *err);
// Inserts or overwrites. key must stay alive as long as the map.
void tok_strmap_put(struct tok_strmap *m, const char *key, size_t len, int32_t value);
int32_t tok_strmap_get(const struct tok_strmap *m, const char *key, size_t len);  // -1 if absent
void tok_strmap_free(struct tok_strmap *m);

struct tok_merge_slot {
    uint64_t key;  // (left id << 32) | right id; UINT64_MAX = empty
    int32_t rank;
    int32_t new_id;
};
struct tok_mergemap {
    struct tok_merge_slot *slots;
    size_t mask, count;
};
atomc_status tok_mergemap_init(struct tok_mergemap *m, size_t expected, struct error *err);
// Keeps the first (lowest-rank) entry when a pair is inserted twice, as HF does for duplicate merges.
void tok_mergemap_put(struct tok_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t new_id);
const struct tok_merge_slot *tok_mergemap_get(const struct tok_mergemap *m, int32_t a, int32_t b);
void tok_mergemap_free(struct tok_mergemap *m);

// ---- pipeline components.
enum tok_norm_type {
    TOK_NORM_NFC,
    TOK_NORM_NFD,
    TOK_NORM_NFKC,
    TOK_NORM_NFKD,
    TOK_NORM_PREPEND,
    TOK_NORM_REPLACE,
    TOK_NORM_LOWERCASE,
    TOK_NORM_STRIP,
};
struct tok_normalizer {
    enum tok_norm_type type;
    char *str;  // Prepend text / Replace literal pattern
    size_t str_len;
    char *content;  // Replace replacement
    size_t content_len;
    pcre2_code *re;  // Replace with a Regex pattern
    bool left, right;  // Strip
};

enum tok_split_behavior {
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_MERGED_WITH_PREVIOUS,
    TOK_SPLIT_MERGED_WITH_NEXT,
    TOK_SPLIT_CONTIGUOUS,
};
enum tok_pretok_type {
    TOK_PRETOK_SPLIT,
    TOK_PRETOK_BYTE_LEVEL,
    TOK_PRETOK_DIGITS,
    TOK_PRETOK_METASPACE,
    TOK_PRETOK_WHITESPACE_SPLIT,
};
enum tok_prepend_scheme { TOK_PREPEND_ALWAYS, TOK_PREPEND_FIRST, TOK_PREPEND_NEVER };
struct tok_pretok {
    enum tok_pretok_type type;
    pcre2_code *re;  // Split with a Regex pattern; ByteLevel with use_regex (the GPT-2 pattern)
    char *literal;   // Split with a String pattern
    size_t literal_len;
    enum tok_split_behavior behavior;
    bool invert;
    bool add_prefix_space, use_regex;  // ByteLevel
    bool individual_digits;            // Digits
    char replacement[8];               // Metaspace (UTF-8 of the replacement char)
    size_t replacement_len;
    enum tok_prepend_scheme prepend_scheme;
    bool split;
};

enum tok_decoder_type {
    TOK_DEC_BYTE_LEVEL,
    TOK_DEC_METASPACE,
    TOK_DEC_REPLACE,
    TOK_DEC_BYTE_FALLBACK,
    TOK_DEC_FUSE,
    TOK_DEC_STRIP,
};
struct tok_decoder {
    enum tok_decoder_type type;
    char *pattern, *content;  // Replace (literal pattern); Strip uses content (one char)
    size_t pattern_len, content_len;
    int start, stop;          // Strip
    char replacement[8];      // Metaspace
    size_t replacement_len;
    enum tok_prepend_scheme prepend_scheme;
};

struct tok_added {
    int32_t id;
    char *content;
    size_t len;
    bool special, lstrip, rstrip, normalized, single_word;
};

// Byte trie over added-token contents for leftmost-longest matching.
struct tok_trie_node {
    int32_t first_child, next_sibling;
    int32_t added;  // index into tokenizer.added, -1 if no token ends here
    unsigned char byte;
};
struct tok_trie {
    struct tok_trie_node *nodes;  // nodes[0] = root
    int n, cap;
};

// Word cache (as HF's BPE cache): direct-mapped, keyed by the XXH3 hash of a pre-tokenized word;
// short words with few ids only. Guarded by tokenizer.cache_lock (encode is called from many threads).
#define TOK_CACHE_WORD 22
#define TOK_CACHE_IDS 7
#define TOK_CACHE_ENTRIES 16384
struct tok_cache_entry {
    uint64_t hash;
    uint8_t len, n_ids;
    char word[TOK_CACHE_WORD];
    int32_t ids[TOK_CACHE_IDS];
};

struct tokenizer {
    // id -> piece (added-token content where the id is an added token, else the model's token).
    int vocab_size;
    const char **piece;   // (vocab_size) NULL for holes
    uint32_t *piece_len;  // (vocab_size)
    uint8_t *flags;       // (vocab_size) TOK_FLAG_*
    // id -> bytes as they appear in decoded output (tokenizer_token_bytes).
    const char **out_bytes;
    uint32_t *out_len;

    // BPE model.
    struct tok_strmap vocab;   // model vocab piece -> id
    struct tok_strmap added_map;  // added content -> id
    struct tok_mergemap merges;
    int32_t unk_id;  // -1 if none
    bool byte_fallback, fuse_unk, ignore_merges;
    char *cont_prefix, *end_suffix;  // NULL or non-empty
    size_t cont_prefix_len, end_suffix_len;
    int32_t byte_token[256];  // byte fallback ids of "<0xXX>", -1 where absent

    // Byte-level mapping (GPT-2 bytes_to_unicode).
    char byte_char[256][3];  // UTF-8 of the char for each byte
    uint8_t byte_char_len[256];
    int16_t char_byte[512];  // code point (< 512) -> byte, -1 if not a byte char

    struct tok_normalizer *norms;
    int n_norms;
    struct tok_pretok *pretoks;
    int n_pretoks;
    struct tok_decoder *decoders;
    int n_decoders;
    bool has_decoder;  // false: pieces are joined with " " (HF default)

    struct tok_added *added;
    int n_added;
    struct tok_trie trie_raw, trie_norm;

    // Post-processor, single sequence: ids with -1 standing for the input sequence.
    int32_t *tmpl;
    int n_tmpl;

    int32_t bos_id, eos_id;
    char *bos_text, *eos_text;
    char *chat_template;

    // The only state that changes after loading (a cache; results never depend on it).
    pthread_mutex_t cache_lock;
    struct tok_cache_entry *cache;  // (TOK_CACHE_ENTRIES), NULL = no caching

    // Owned storage.
    char **pool_blocks;  // string storage blocks
    int n_pool_blocks;
    size_t pool_used, pool_cap;
};

enum { TOK_FLAG_SPECIAL = 1, TOK_FLAG_ADDED = 2, TOK_FLAG_BYTE = 4 };

// ---- construction helpers (tokenizer_build.c).
struct tokenizer *tokenizer_alloc(void);
// Copies n bytes into the tokenizer's string pool (NUL-terminated); NULL on allocation failure.
char *tokenizer_pool_strdup(struct tokenizer *t, const char *s, size_t n);
// Sizes the id tables for ids < vocab_size.
atomc_status tokenizer_reserve_ids(struct tokenizer *t, int vocab_size, struct error *err);
// Registers an added token (content copied). Sets its piece and flags.
atomc_status tokenizer_add_token(struct tokenizer *t, int32_t id, const char *content, size_t len, bool special,
                                 bool lstrip, bool rstrip, bool normalized, bool single_word, struct error *err);
// Compiles a regex (UTF + UCP, JIT where available).
atomc_status tokenizer_compile_regex(const char *pattern, size_t len, pcre2_code **out, struct error *err);
// Fills byte_char / char_byte (GPT-2 bytes_to_unicode). Idempotent.
void tokenizer_init_byte_tables(struct tokenizer *t);
// After vocab, merges and added tokens are in place: byte tables, tries, output bytes.
atomc_status tokenizer_finish(struct tokenizer *t, struct error *err);
// GPT-2's pre-tokenization pattern (ByteLevel use_regex=true).
extern const char tokenizer_gpt2_pattern[];
// Appends a pre-tokenizer (Split isolated with regex; ByteLevel, using regex as its split when
// given; Metaspace with U+2581) / a decoder of the given type. For the builders without a
// tokenizer.json (GGUF, tiktoken). push_decoder returns NULL when out of memory.
atomc_status tokenizer_push_pretok(struct tokenizer *t, enum tok_pretok_type type, const char *regex, struct error *err);
struct tok_decoder *tokenizer_push_decoder(struct tokenizer *t, enum tok_decoder_type type);
// The Split patterns of well-known byte-level tokenizers (tokenizer_gguf.c).
extern const char tokenizer_llama3_pattern[];
// tokenizer_config.json's bos/eos tokens, chat template (or chat_template.jinja beside json_path)
// and add_bos/add_eos rules, applied to a tokenizer whose vocabulary and added tokens are loaded
// (tokenizer_json.c; the tiktoken loader uses it too). cfg may be NULL; name is for messages.
atomc_status tokenizer_apply_config(struct tokenizer *t, json_t *cfg, const char *json_path, const char *name,
                                    struct error *err);

// ---- loaders (tokenizer_json.c, tokenizer_gguf.c).
atomc_status tokenizer_load_json(const char *json_path, const char *config_path, struct tokenizer **out,
                                 struct error *err);
atomc_status tokenizer_load_gguf_path(const char *path, struct tokenizer **out, struct error *err);
// A directory with tiktoken.model (+ tokenizer_config.json): tokenizer_tiktoken.c.
atomc_status tokenizer_load_tiktoken(const char *dir, struct tokenizer **out, struct error *err);

// ---- pipeline stages (tokenizer_encode.c, tokenizer_decode.c).
// Runs the normalizers over s, appending the result to out.
void tokenizer_normalize_text(const struct tokenizer *t, const char *s, size_t n, struct tok_buf *out);
// Appends the decoder chain's output for the given pieces to out (HF `decoder.decode`).
void tokenizer_decode_pieces(const struct tokenizer *t, struct tok_pieces *tokens, struct tok_buf *out);
// The same chain for one piece in the middle of a text: no start-of-text rules (Strip,
// Metaspace's first-token prefix) and no UTF-8 repair; gives tokenizer_token_bytes.
void tokenizer_decode_raw(const struct tokenizer *t, struct tok_pieces *tokens, struct tok_buf *out);

#endif
