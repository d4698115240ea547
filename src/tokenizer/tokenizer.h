// Tokenizers loaded from HF tokenizer.json (+ tokenizer_config.json) or from GGUF metadata:
// byte-level BPE with Split-regex pre-tokenizers (Llama-3, Qwen3, DeepSeek-V3, GPT-OSS,
// SmolLM2) and SentencePiece-style BPE with byte fallback (Llama-2). Encoding matches HF
// `tokenizers` id for id. A loaded tokenizer is immutable and safe to use from many threads.
#ifndef ATOMC_TOKENIZER_TOKENIZER_H
#define ATOMC_TOKENIZER_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

struct tokenizer;
struct gguf_file;

// path: a model directory (tokenizer.json + tokenizer_config.json), a tokenizer.json file,
// or a .gguf file (tokenizer from its metadata).
atomc_status tokenizer_load(const char *path, struct tokenizer **out, struct error *err);
atomc_status tokenizer_load_gguf(const struct gguf_file *g, struct tokenizer **out, struct error *err);
// From in-memory tokenizer.json (+ optional tokenizer_config.json) text (tests, fuzzing, embedding).
atomc_status tokenizer_load_json_buffer(const char *json, size_t len, const char *config, size_t config_len,
                                        struct tokenizer **out, struct error *err);
void tokenizer_free(struct tokenizer *t);

// Encodes UTF-8 text. Invalid UTF-8 is first replaced by U+FFFD, one per maximal invalid subpart
// (what Python's bytes.decode("utf-8", errors="replace") gives, the string HF would be handed).
// add_special_tokens applies the post-processor template (BOS/EOS), with tokenizer_config.json's
// add_bos_token/add_eos_token for Llama/Gemma tokenizer classes as transformers does. *ids is
// malloc'd (never NULL on success, even for 0 ids). A character with no token, no unk and no byte
// fallback gives ATOMC_ERR_INVALID_ARGUMENT.
atomc_status tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool add_special_tokens,
                              int32_t **ids, int *n_ids, struct error *err);
// Decodes ids to UTF-8 (*out malloc'd). Invalid ids give ATOMC_ERR_INVALID_ARGUMENT.
atomc_status tokenizer_decode(const struct tokenizer *t, const int32_t *ids, int n_ids, bool skip_special_tokens,
                              char **out, struct error *err);
// The same, also giving the byte length (decoded text may contain NUL bytes). out_len may be NULL.
atomc_status tokenizer_decode_n(const struct tokenizer *t, const int32_t *ids, int n_ids, bool skip_special_tokens,
                                char **out, size_t *out_len, struct error *err);

int tokenizer_vocab_size(const struct tokenizer *t);  // including added tokens
const char *tokenizer_token_text(const struct tokenizer *t, int32_t id); // raw vocab piece, NULL if invalid
bool tokenizer_is_special(const struct tokenizer *t, int32_t id);
int32_t tokenizer_token_id(const struct tokenizer *t, const char *piece); // -1 if absent
int32_t tokenizer_bos_id(const struct tokenizer *t);  // -1 if none
int32_t tokenizer_eos_id(const struct tokenizer *t);  // -1 if none
const char *tokenizer_bos_text(const struct tokenizer *t);
const char *tokenizer_eos_text(const struct tokenizer *t);
bool tokenizer_adds_bos(const struct tokenizer *t);
const char *tokenizer_chat_template(const struct tokenizer *t); // from tokenizer_config.json / GGUF; NULL if none

// The text of one token as it appears in decoded output (byte-level pieces mapped back to bytes;
// may be a partial UTF-8 sequence). *len receives the byte count.
const char *tokenizer_token_bytes(const struct tokenizer *t, int32_t id, size_t *len);

// Incremental detokenization for streaming: feed the ids of a sequence as they are generated;
// each call returns the newly completed text. Never emits a broken UTF-8 sequence, never
// repeats or drops text: the concatenation of all deltas equals tokenizer_decode of all ids
// (once the final flush is done).
struct detokenizer {
    const struct tokenizer *tok;
    bool skip_special_tokens;
    int prefix_offset;   // implementation state (token offsets into the id sequence)
    int read_offset;
    char *pending;       // bytes decoded but not yet emitted (incomplete UTF-8)
    size_t pending_len, pending_cap;
};
void detokenizer_init(struct detokenizer *d, const struct tokenizer *t, bool skip_special_tokens);
// ids: all output ids so far (n_ids), of which the last n_new are new. Sets *out / *out_len to
// the text delta (malloc'd, NUL-terminated, caller frees; *out may be NULL with *out_len 0 when
// nothing is ready). final=true flushes what is held.
atomc_status detokenizer_step(struct detokenizer *d, const int32_t *ids, int n_ids, int n_new, bool final,
                              char **out, size_t *out_len);
void detokenizer_free(struct detokenizer *d);

#endif
