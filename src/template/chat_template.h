// Chat templates: turning an OpenAI-style message list into the prompt text a model was
// trained on, with the model's own Jinja template (src/template/jinja.h), exactly as HF
// transformers' apply_chat_template(tokenize=False) renders it.
//
// Contract:
// - chat_template_compile() parses once; the result is immutable and may be rendered
//   concurrently from several threads.
// - chat_template_render() validates the inputs first (clear ATOMC_ERR_INVALID_ARGUMENT
//   messages suited to an HTTP 400: "messages[2].content[0]: ..."), then renders with
//   the variables HF passes: messages, tools (None when absent), documents (None),
//   add_generation_prompt, bos_token / eos_token (when given), and every key of kwargs
//   (chat_template_kwargs, e.g. enable_thinking). Messages are passed as given (no
//   None-valued keys dropped), except that, as transformers does, a message's reasoning
//   sent as "reasoning_content", "thinking" or "reasoning" is visible under both
//   "reasoning_content" and "thinking". Template errors (raise_exception, undefined values, limits)
//   also come back as ATOMC_ERR_INVALID_ARGUMENT / ATOMC_ERR_TOO_LONG with the message.
// - continue_final_message follows HF: the final message's content is tagged, rendered,
//   and the prompt cut where that content ends (so the model continues it); it cannot be
//   combined with add_generation_prompt.
// - No double BOS: templates print bos_token themselves when the model wants one, so the
//   rendered prompt must be tokenized WITHOUT adding special tokens (HF's
//   apply_chat_template and vLLM both use add_special_tokens=False here).
//   chat_template_starts_with_bos() tells whether the text already begins with the BOS
//   text (for diagnostics, or for callers that must decide per prompt).
#ifndef ATOMC_TEMPLATE_CHAT_TEMPLATE_H
#define ATOMC_TEMPLATE_CHAT_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>

#include "common/error.h"
#include "template/jinja.h"

struct chat_template;

atomc_status chat_template_compile(const char *src, struct chat_template **out, struct error *err);
void chat_template_free(struct chat_template *t);

// The template source text (as given to compile).
const char *chat_template_source(const struct chat_template *t);

atomc_status chat_template_render(const struct chat_template *t, const json_t *messages, const json_t *tools,
                                  bool add_generation_prompt, bool continue_final_message, const json_t *kwargs,
                                  const char *bos_token, const char *eos_token, char **out, struct error *err);

// Same with explicit limits / clock (tests, benchmarks); opt may be NULL.
atomc_status chat_template_render_ex(const struct chat_template *t, const json_t *messages, const json_t *tools,
                                     bool add_generation_prompt, bool continue_final_message, const json_t *kwargs,
                                     const char *bos_token, const char *eos_token,
                                     const struct jinja_render_options *opt, char **out, struct error *err);

// Renders an OpenAI-style /v1/chat/completions (or /apply-template) request body:
// "messages" (required), "tools", "add_generation_prompt" (default true, as vLLM),
// "continue_final_message" (default false), "chat_template_kwargs" (object), "documents"
// (array, for RAG templates; None otherwise). Wrong types
// are ATOMC_ERR_INVALID_ARGUMENT naming the field (HTTP 400).
atomc_status chat_template_render_request(const struct chat_template *t, const json_t *request, const char *bos_token,
                                          const char *eos_token, char **out, struct error *err);

// Checks an OpenAI-style messages array (also done by render).
atomc_status chat_template_validate_messages(const json_t *messages, struct error *err);

// True when `rendered` already begins with bos_token's text (non-empty): adding the BOS
// again while tokenizing would double it.
bool chat_template_starts_with_bos(const char *rendered, const char *bos_token);

// Where a model keeps its template and special tokens.
struct chat_template_source {
    char *template_src; // malloc'ed; NULL if the model has none
    char *bos_token;    // malloc'ed text of the BOS token, or NULL
    char *eos_token;    // malloc'ed text of the EOS token, or NULL
};

// Reads the template and BOS/EOS text from `model_path`: a directory holding
// tokenizer_config.json (and maybe chat_template.jinja, which wins) or a single .gguf, that
// file itself, or a .gguf file (tokenizer.chat_template, or tokenizer.chat_template.tool_use
// when `want_tools`; BOS/EOS ids looked up in tokenizer.ggml.tokens). tokenizer_config.json's
// chat_template may be a string or a list of {name, template}: "default" is used, or
// "tool_use" when `want_tools` and it exists. If override_file is non-NULL its contents
// replace the template (BOS/EOS still come from the model when model_path is given;
// model_path may be NULL then).
atomc_status chat_template_source_load(const char *model_path, const char *override_file, bool want_tools,
                                       struct chat_template_source *out, struct error *err);
void chat_template_source_free(struct chat_template_source *s);

#endif
