// A Jinja2-subset template interpreter for chat templates (HF transformers' settings:
// trim_blocks=True, lstrip_blocks=True, loopcontrols, keep_trailing_newline=False; its
// tojson, raise_exception and strftime_now globals; the immutable sandbox's rules).
//
// Contract:
// - jinja_compile() lexes and parses the whole source once into an AST owned by the
//   returned template; syntax errors are ATOMC_ERR_FORMAT with "line L, column C: ..."
//   in the message. A compiled template is immutable and may be rendered from several
//   threads at once (each render has its own arena and scopes).
// - jinja_render() evaluates against variables given as a jansson object (keys become
//   top-level names; JSON values map to Python's: null->None, objects keep insertion
//   order). All values live in one per-render arena freed before returning.
// - Rendering is bounded: output bytes, arena bytes, evaluation steps and call/nesting
//   depth all have limits (struct jinja_limits); exceeding one is a clear error
//   (ATOMC_ERR_TOO_LONG for size/steps, ATOMC_ERR_INVALID_ARGUMENT for template errors),
//   never a crash or an unbounded loop. Template-raised errors (raise_exception) are
//   ATOMC_ERR_INVALID_ARGUMENT with the template's message.
// - Output strings match Python's str() for None/bools/ints/floats/lists/dicts/tuples
//   and json.dumps(ensure_ascii=False, ...) for tojson, byte for byte.
#ifndef ATOMC_TEMPLATE_JINJA_H
#define ATOMC_TEMPLATE_JINJA_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/error.h"

struct jinja_template;

struct jinja_limits {
    size_t max_output_bytes; // rendered text (default 16 MiB)
    size_t max_memory_bytes; // per-render arena (default 256 MiB)
    uint64_t max_steps;      // evaluated expression/statement nodes (default 50M)
    int max_depth;           // macro-call / expression nesting depth (default 256)
};

void jinja_limits_init(struct jinja_limits *l);

// Compiles `len` bytes of template source (need not be NUL-terminated).
atomc_status jinja_compile(const char *src, size_t len, struct jinja_template **out, struct error *err);
void jinja_template_free(struct jinja_template *t);

struct jinja_render_options {
    const struct jinja_limits *limits; // NULL = defaults
    time_t now;                         // strftime_now's clock; 0 = time(NULL)
};

// Renders with the variables of `vars` (a JSON object, or NULL for none). On success
// *out is a malloc'ed NUL-terminated string (free with free()) of *out_len bytes.
atomc_status jinja_render(const struct jinja_template *t, const json_t *vars, const struct jinja_render_options *opt,
                          char **out, size_t *out_len, struct error *err);

#endif
