// `atomc generate`: one prompt through the engine, text streamed to stdout as it is
// generated (or, with --json, one JSON object with ids, text, finish reason, per-token top
// logprobs, usage and timing). `atomc chat`: an interactive multi-turn REPL on the model's
// chat template, streaming each answer.
//
// Sampling defaults follow vLLM (temperature 1, top_p 1, top_k off) overridden by the model's
// generation_config.json (unless --generation-config vllm), overridden by the flags.
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomc.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/check.h"

#if __has_include("template/chat_template.h")
#include "template/chat_template.h"
#define HAVE_CHAT_TEMPLATE 1
#endif

struct gen_state {
    atomc_engine *e;
    bool json, stream;
    int32_t *ids;
    int n_ids, cap;
    char *text;
    size_t text_len, text_cap;
    json_t *logprobs; // array, with --logprobs
    atomc_finish_reason reason;
    char stop_str[256];
    int32_t stop_token;
    int prompt_tokens, cached_tokens, num_preemptions;
    double t_arrival, t_first, t_last, t_finish;
    char error[512];
    bool done;
};

static json_t *token_text_json(atomc_engine *e, int32_t id) {
    char *s = NULL;
    if (atomc_engine_detokenize(e, &id, 1, false, &s) != ATOMC_OK || !s) return json_null();
    json_t *j = json_stringn(s, strlen(s));
    atomc_free(s);
    return j ? j : json_null(); // a lone partial UTF-8 byte is not valid JSON text
}

static void on_output(void *user, const atomc_output *o) {
    struct gen_state *g = user;
    for (int i = 0; i < o->n_new_tokens; i++) {
        if (g->n_ids == g->cap) {
            g->cap = g->cap ? g->cap * 2 : 64;
            g->ids = xrealloc(g->ids, (size_t)g->cap * sizeof *g->ids);
        }
        g->ids[g->n_ids++] = o->new_tokens[i];
        if (g->logprobs && o->logprobs) {
            const atomc_token_logprobs *lp = &o->logprobs[i];
            json_t *top = json_array();
            for (int k = 0; k < lp->n_top; k++)
                json_array_append_new(top, json_pack("{s:i,s:o,s:f}", "id", lp->top[k].token, "token",
                                                     token_text_json(g->e, lp->top[k].token), "logprob",
                                                     (double)lp->top[k].logprob));
            json_array_append_new(g->logprobs, json_pack("{s:i,s:o,s:f,s:o}", "id", lp->token, "token",
                                                         token_text_json(g->e, lp->token), "logprob",
                                                         (double)lp->logprob, "top_logprobs", top));
        }
    }
    if (o->text_len) {
        if (g->text_len + o->text_len + 1 > g->text_cap) {
            g->text_cap = (g->text_len + o->text_len + 1) * 2;
            g->text = xrealloc(g->text, g->text_cap);
        }
        memcpy(g->text + g->text_len, o->text, o->text_len);
        g->text_len += o->text_len;
        g->text[g->text_len] = '\0';
        if (g->stream) {
            fwrite(o->text, 1, o->text_len, stdout);
            fflush(stdout);
        }
    }
    g->prompt_tokens = o->prompt_tokens;
    g->cached_tokens = o->cached_tokens;
    g->t_arrival = o->arrival_time;
    g->t_first = o->first_token_time;
    g->t_last = o->last_token_time;
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        g->reason = o->finish_reason;
        g->stop_token = o->stop_token;
        snprintf(g->stop_str, sizeof g->stop_str, "%s", o->stop_str ? o->stop_str : "");
        snprintf(g->error, sizeof g->error, "%s", o->error ? o->error : "");
        g->t_finish = o->finish_time;
        g->num_preemptions = o->num_preemptions;
        g->done = true;
    }
}

static void usage_generate(FILE *f) {
    fprintf(f,
            "usage: atomc generate --model PATH (--prompt TEXT | --prompt-ids 1,2,3) [options]\n"
            "  --chat                 wrap the prompt as a user message in the model's chat template\n"
            "  --system TEXT          system message (with --chat)\n"
            "  --max-tokens N         tokens to generate (default 128; -1 = up to the context)\n"
            "  --min-tokens N         no EOS / stop before N tokens\n"
            "  --temperature T --top-p P --top-k K --min-p M --seed S\n"
            "  --repetition-penalty R --presence-penalty P --frequency-penalty F\n"
            "  --stop S               stop string (repeatable)   --stop-token-id ID (repeatable)\n"
            "  --include-stop-str-in-output   --ignore-eos   --no-skip-special-tokens\n"
            "  --logprobs K           per-token logprob and top-K alternatives (with --json)\n"
            "  --no-add-special-tokens  do not add BOS when tokenizing --prompt\n"
            "  --json                 print one JSON object instead of streaming text\n"
            "%s",
            CLI_ENGINE_OPTIONS_HELP);
}

static void usage_chat(FILE *f) {
    fprintf(f,
            "usage: atomc chat --model PATH [--system TEXT] [--max-tokens N] [sampling options] [engine options]\n"
            "  Interactive multi-turn chat on the model's chat template; answers stream as they are\n"
            "  generated. Commands: /reset clears the history, /exit (or end of input) quits.\n"
            "%s",
            CLI_ENGINE_OPTIONS_HELP);
}

// Renders messages with the model's chat template (generation prompt added).
static int render_chat(const char *model_path, json_t *messages, char **prompt, bool *has_bos) {
#ifdef HAVE_CHAT_TEMPLATE
    struct error err = {0};
    struct chat_template_source src;
    memset(&src, 0, sizeof src);
    if (chat_template_source_load(model_path, NULL, false, &src, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc: %s\n", err.msg);
        return 1;
    }
    if (!src.template_src) {
        fprintf(stderr, "atomc: the model %s has no chat template; use a plain --prompt\n", model_path);
        chat_template_source_free(&src);
        return 1;
    }
    struct chat_template *t = NULL;
    atomc_status st = chat_template_compile(src.template_src, &t, &err);
    if (st == ATOMC_OK)
        st = chat_template_render(t, messages, NULL, true, false, NULL, src.bos_token, src.eos_token, prompt, &err);
    if (st == ATOMC_OK) *has_bos = chat_template_starts_with_bos(*prompt, src.bos_token);
    chat_template_free(t);
    chat_template_source_free(&src);
    if (st != ATOMC_OK) {
        fprintf(stderr, "atomc: chat template: %s\n", err.msg);
        return 1;
    }
    return 0;
#else
    (void)model_path;
    (void)messages;
    (void)prompt;
    (void)has_bos;
    fprintf(stderr, "atomc: --chat is not yet available in this build (chat templates have not landed)\n");
    return 2;
#endif
}

static int run_request(atomc_engine *e, const atomc_request *r, struct gen_state *g) {
    char err[1024];
    uint64_t id;
    atomc_status st = atomc_engine_add_request(e, r, &id, err, sizeof err);
    if (st != ATOMC_OK) {
        fprintf(stderr, "atomc: %s\n", err);
        return 1;
    }
    while (!g->done) atomc_engine_step(e);
    return 0;
}

enum {
    G_PROMPT = 1000, G_PROMPT_IDS, G_CHAT, G_SYSTEM, G_MAX_TOKENS, G_MIN_TOKENS, G_TEMP, G_TOP_P, G_TOP_K, G_MIN_P,
    G_SEED, G_REP, G_PRES, G_FREQ, G_STOP, G_STOP_ID, G_INCLUDE_STOP, G_IGNORE_EOS, G_NO_SKIP, G_LOGPROBS,
    G_NO_ADD_SPECIAL, G_JSON, G_HELP,
};

struct gen_args {
    const char *prompt, *prompt_ids, *system;
    bool chat, json, help, no_add_special;
    atomc_sampling_params p;
    bool set_temp, set_top_p, set_top_k, set_min_p, set_rep, set_max;
    const char *stops[64];
    int32_t stop_ids[64];
};

// Parses sampling flags shared by generate and chat; returns 1 if handled, 0 if not ours, -1 on error.
static int parse_gen_flag(struct gen_args *a, int c, const char *arg) {
    switch (c) {
    case G_PROMPT: a->prompt = arg; return 1;
    case G_PROMPT_IDS: a->prompt_ids = arg; return 1;
    case G_CHAT: a->chat = true; return 1;
    case G_SYSTEM: a->system = arg; return 1;
    case G_MAX_TOKENS:
        a->set_max = true;
        return cli_parse_int(arg, "--max-tokens", -1, INT_MAX, &a->p.max_tokens) && a->p.max_tokens != 0 ? 1 : -1;
    case G_MIN_TOKENS: return cli_parse_int(arg, "--min-tokens", 0, INT_MAX, &a->p.min_tokens) ? 1 : -1;
    case G_TEMP: a->set_temp = true; return cli_parse_float(arg, "--temperature", &a->p.temperature) ? 1 : -1;
    case G_TOP_P: a->set_top_p = true; return cli_parse_float(arg, "--top-p", &a->p.top_p) ? 1 : -1;
    case G_TOP_K: a->set_top_k = true; return cli_parse_int(arg, "--top-k", -1, INT_MAX, &a->p.top_k) ? 1 : -1;
    case G_MIN_P: a->set_min_p = true; return cli_parse_float(arg, "--min-p", &a->p.min_p) ? 1 : -1;
    case G_REP: a->set_rep = true; return cli_parse_float(arg, "--repetition-penalty", &a->p.repetition_penalty) ? 1 : -1;
    case G_PRES: return cli_parse_float(arg, "--presence-penalty", &a->p.presence_penalty) ? 1 : -1;
    case G_FREQ: return cli_parse_float(arg, "--frequency-penalty", &a->p.frequency_penalty) ? 1 : -1;
    case G_SEED: a->p.has_seed = true; return cli_parse_u64(arg, "--seed", &a->p.seed) ? 1 : -1;
    case G_STOP:
        if (a->p.n_stop >= 64) {
            fprintf(stderr, "atomc: at most 64 --stop strings\n");
            return -1;
        }
        a->stops[a->p.n_stop++] = arg;
        return 1;
    case G_STOP_ID: {
        int v;
        if (a->p.n_stop_token_ids >= 64 || !cli_parse_int(arg, "--stop-token-id", 0, INT_MAX, &v)) return -1;
        a->stop_ids[a->p.n_stop_token_ids++] = v;
        return 1;
    }
    case G_INCLUDE_STOP: a->p.include_stop_str_in_output = true; return 1;
    case G_IGNORE_EOS: a->p.ignore_eos = true; return 1;
    case G_NO_SKIP: a->p.skip_special_tokens = false; return 1;
    case G_LOGPROBS: return cli_parse_int(arg, "--logprobs", 0, 20, &a->p.logprobs) ? 1 : -1;
    case G_NO_ADD_SPECIAL: a->no_add_special = true; return 1;
    case G_JSON: a->json = true; return 1;
    case G_HELP: a->help = true; return 1;
    }
    return 0;
}

#define GEN_LONG_OPTIONS                                                                                         \
    {"prompt", required_argument, 0, G_PROMPT}, {"prompt-ids", required_argument, 0, G_PROMPT_IDS},              \
        {"chat", no_argument, 0, G_CHAT}, {"system", required_argument, 0, G_SYSTEM},                            \
        {"max-tokens", required_argument, 0, G_MAX_TOKENS}, {"min-tokens", required_argument, 0, G_MIN_TOKENS},  \
        {"temperature", required_argument, 0, G_TEMP}, {"top-p", required_argument, 0, G_TOP_P},                 \
        {"top-k", required_argument, 0, G_TOP_K}, {"min-p", required_argument, 0, G_MIN_P},                      \
        {"seed", required_argument, 0, G_SEED}, {"repetition-penalty", required_argument, 0, G_REP},             \
        {"presence-penalty", required_argument, 0, G_PRES}, {"frequency-penalty", required_argument, 0, G_FREQ}, \
        {"stop", required_argument, 0, G_STOP}, {"stop-token-id", required_argument, 0, G_STOP_ID},              \
        {"include-stop-str-in-output", no_argument, 0, G_INCLUDE_STOP},                                          \
        {"ignore-eos", no_argument, 0, G_IGNORE_EOS}, {"no-skip-special-tokens", no_argument, 0, G_NO_SKIP},     \
        {"logprobs", required_argument, 0, G_LOGPROBS},                                                          \
        {"no-add-special-tokens", no_argument, 0, G_NO_ADD_SPECIAL}, {"json", no_argument, 0, G_JSON},           \
        {"help", no_argument, 0, G_HELP}, CLI_ENGINE_LONG_OPTIONS

// Parses argv into a and the engine options; returns 0, or the exit status on error.
static int parse_args(int argc, char **argv, struct gen_args *a, struct cli_engine_args *ea) {
    static const struct option opts[] = {GEN_LONG_OPTIONS, {0, 0, 0, 0}};
    memset(a, 0, sizeof *a);
    atomc_sampling_params_init(&a->p);
    a->p.max_tokens = 128;
    cli_engine_args_init(ea);
    optind = 1;
    opterr = 1;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == '?') return 2;
        int r = parse_gen_flag(a, c, optarg);
        if (r < 0) return 2;
        if (r == 0) {
            r = cli_engine_parse_flag(ea, c, optarg);
            if (r <= 0) return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "atomc: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    a->p.stop = a->stops;
    a->p.stop_token_ids = a->stop_ids;
    return 0;
}

// The model's sampling defaults, where a flag did not set them.
static void apply_generation_defaults(atomc_engine *e, struct gen_args *a) {
    atomc_model_info info;
    atomc_engine_get_model_info(e, &info);
    if (!info.has_generation_defaults) return;
    if (!a->set_temp && info.default_temperature >= 0) a->p.temperature = info.default_temperature;
    if (!a->set_top_p && info.default_top_p > 0) a->p.top_p = info.default_top_p;
    if (!a->set_top_k && info.default_top_k >= 0) a->p.top_k = info.default_top_k;
    if (!a->set_min_p && info.default_min_p >= 0) a->p.min_p = info.default_min_p;
    if (!a->set_rep && info.default_repetition_penalty > 0) a->p.repetition_penalty = info.default_repetition_penalty;
    if (!a->set_max && info.default_max_tokens > 0) a->p.max_tokens = info.default_max_tokens;
}

static void print_json(const struct gen_state *g, const int32_t *prompt_ids, int n_prompt) {
    json_t *pids = json_array();
    for (int i = 0; i < n_prompt; i++) json_array_append_new(pids, json_integer(prompt_ids[i]));
    json_t *ids = json_array();
    for (int i = 0; i < g->n_ids; i++) json_array_append_new(ids, json_integer(g->ids[i]));
    double gen_s = g->t_finish - g->t_first;
    json_t *o = json_pack(
        "{s:o,s:o,s:s%,s:s,s:i,s:i,s:i,s:{s:f,s:f,s:f,s:i}}", "prompt_ids", pids, "ids", ids, "text",
        g->text ? g->text : "", g->text_len, "finish_reason", atomc_finish_reason_name(g->reason), "prompt_tokens",
        g->prompt_tokens, "completion_tokens", g->n_ids, "cached_tokens", g->cached_tokens, "timing", "ttft_s",
        g->t_first - g->t_arrival, "e2e_s", g->t_finish - g->t_arrival, "decode_tokens_per_s",
        g->n_ids > 1 && gen_s > 0 ? (g->n_ids - 1) / gen_s : 0.0, "num_preemptions", g->num_preemptions);
    if (!o) { // invalid UTF-8 in text cannot happen (the detokenizer emits whole characters)
        fprintf(stderr, "atomc: could not build the JSON output\n");
        return;
    }
    if (g->stop_str[0]) json_object_set_new(o, "stop_reason", json_string(g->stop_str));
    else if (g->stop_token >= 0) json_object_set_new(o, "stop_reason", json_integer(g->stop_token));
    else json_object_set_new(o, "stop_reason", json_null());
    if (g->logprobs) json_object_set(o, "logprobs", g->logprobs);
    char *s = json_dumps(o, JSON_ENSURE_ASCII);
    if (s) {
        puts(s);
        free(s);
    }
    json_decref(o);
}

int cmd_generate(int argc, char **argv) {
    struct gen_args a;
    struct cli_engine_args ea;
    int rc = parse_args(argc, argv, &a, &ea);
    if (rc) {
        usage_generate(stderr);
        return rc;
    }
    if (a.help) {
        usage_generate(stdout);
        return 0;
    }
    if (!ea.o.model_path) {
        fprintf(stderr, "atomc generate: --model is required\n");
        return 2;
    }
    if (!!a.prompt == !!a.prompt_ids) {
        fprintf(stderr, "atomc generate: give exactly one of --prompt and --prompt-ids\n");
        return 2;
    }
    if (a.chat && !a.prompt) {
        fprintf(stderr, "atomc generate: --chat needs --prompt text\n");
        return 2;
    }
    int32_t *pids = NULL;
    int n_pids = 0;
    if (a.prompt_ids && (n_pids = cli_parse_token_ids(a.prompt_ids, &pids)) <= 0) {
        fprintf(stderr, "atomc generate: --prompt-ids expects comma-separated integers, got '%s'\n", a.prompt_ids);
        free(pids);
        return 2;
    }
    char *chat_prompt = NULL;
    bool has_bos = false;
    if (a.chat) {
        json_t *msgs = json_array();
        if (a.system) json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content", a.system));
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", a.prompt));
        rc = render_chat(ea.o.model_path, msgs, &chat_prompt, &has_bos);
        json_decref(msgs);
        if (rc) return rc;
    }

    atomc_engine *e = NULL;
    char err[1024];
    if (atomc_engine_create(&ea.o, &e, err, sizeof err) != ATOMC_OK) {
        fprintf(stderr, "atomc generate: %s\n", err);
        free(pids);
        free(chat_prompt);
        return 1;
    }
    if (ea.o.generation_config == NULL || strcmp(ea.o.generation_config, "vllm")) apply_generation_defaults(e, &a);

    struct gen_state g;
    memset(&g, 0, sizeof g);
    g.e = e;
    g.json = a.json;
    g.stream = !a.json;
    g.stop_token = -1;
    if (a.json && a.p.logprobs >= 0) g.logprobs = json_array();
    atomc_request r;
    atomc_request_init(&r);
    r.params = a.p;
    r.on_output = on_output;
    r.user = &g;
    if (pids) {
        r.prompt_ids = pids;
        r.n_prompt_ids = n_pids;
    } else {
        r.prompt = chat_prompt ? chat_prompt : a.prompt;
        r.add_special_tokens = chat_prompt ? !has_bos : !a.no_add_special;
    }
    // For --json, report the prompt ids actually used.
    int32_t *used = pids;
    int n_used = n_pids;
    if (!pids && a.json)
        atomc_engine_tokenize(e, r.prompt, strlen(r.prompt), r.add_special_tokens, &used, &n_used);
    rc = cli_profile_start(e, &ea) ? run_request(e, &r, &g) : 1;
    cli_profile_stop(e, &ea);
    if (!rc) {
        if (a.json) {
            print_json(&g, used, n_used);
        } else {
            if (g.text_len && g.text[g.text_len - 1] != '\n') putchar('\n');
            fflush(stdout);
            double gen_s = g.t_finish - g.t_first;
            fprintf(stderr,
                    "[%d prompt tokens (%d cached), %d generated, finish: %s; TTFT %.1f ms, %.2f tokens/s decode]\n",
                    g.prompt_tokens, g.cached_tokens, g.n_ids, atomc_finish_reason_name(g.reason),
                    (g.t_first - g.t_arrival) * 1e3, g.n_ids > 1 && gen_s > 0 ? (g.n_ids - 1) / gen_s : 0.0);
            atomc_stats st;
            atomc_engine_get_stats(e, &st);
            if (st.num_speculative_tokens > 0)
                fprintf(stderr, "[%s k=%d: %llu of %llu draft tokens accepted, mean acceptance length %.2f]\n",
                        ea.o.speculative_method, st.num_speculative_tokens,
                        (unsigned long long)st.spec_num_accepted_tokens, (unsigned long long)st.spec_num_draft_tokens,
                        st.spec_num_drafts ? 1.0 + (double)st.spec_num_accepted_tokens / st.spec_num_drafts : 1.0);
        }
        if (g.reason == ATOMC_FINISH_ERROR) {
            fprintf(stderr, "atomc generate: %s\n", g.error);
            rc = 1;
        }
    }
    if (used != pids) atomc_free(used);
    json_decref(g.logprobs);
    free(g.ids);
    free(g.text);
    free(pids);
    free(chat_prompt);
    atomc_engine_free(e);
    return rc;
}

// --- atomc chat -------------------------------------------------------------------------------

#ifdef HAVE_CHAT_TEMPLATE
static char *read_line(FILE *f) {
    size_t cap = 256, n = 0;
    char *s = xmalloc(cap);
    int c;
    while ((c = fgetc(f)) != EOF && c != '\n') {
        if (n + 1 == cap) s = xrealloc(s, cap *= 2);
        s[n++] = (char)c;
    }
    if (c == EOF && n == 0) {
        free(s);
        return NULL;
    }
    s[n] = '\0';
    return s;
}
#endif

int cmd_chat(int argc, char **argv) {
    struct gen_args a;
    struct cli_engine_args ea;
    int rc = parse_args(argc, argv, &a, &ea);
    if (rc) {
        usage_chat(stderr);
        return rc;
    }
    if (a.help) {
        usage_chat(stdout);
        return 0;
    }
    if (!ea.o.model_path) {
        fprintf(stderr, "atomc chat: --model is required\n");
        return 2;
    }
#ifndef HAVE_CHAT_TEMPLATE
    fprintf(stderr, "atomc chat: not yet available in this build (chat templates have not landed)\n");
    return 2;
#else
    atomc_engine *e = NULL;
    char err[1024];
    if (atomc_engine_create(&ea.o, &e, err, sizeof err) != ATOMC_OK) {
        fprintf(stderr, "atomc chat: %s\n", err);
        return 1;
    }
    if (!a.set_max) a.p.max_tokens = -1; // answers run to EOS (or the context) unless limited
    if (ea.o.generation_config == NULL || strcmp(ea.o.generation_config, "vllm")) apply_generation_defaults(e, &a);
    json_t *history = json_array();
    if (a.system) json_array_append_new(history, json_pack("{s:s,s:s}", "role", "system", "content", a.system));
    bool tty = isatty_stdin();
    for (;;) {
        if (tty) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        char *line = read_line(stdin);
        if (!line || !strcmp(line, "/exit") || !strcmp(line, "/quit")) {
            free(line);
            break;
        }
        if (!strcmp(line, "/reset")) {
            json_array_clear(history);
            if (a.system) json_array_append_new(history, json_pack("{s:s,s:s}", "role", "system", "content", a.system));
            free(line);
            continue;
        }
        if (!line[0]) {
            free(line);
            continue;
        }
        json_array_append_new(history, json_pack("{s:s,s:s}", "role", "user", "content", line));
        free(line);
        char *prompt = NULL;
        bool has_bos = false;
        if (render_chat(ea.o.model_path, history, &prompt, &has_bos)) {
            json_array_remove(history, json_array_size(history) - 1);
            continue;
        }
        struct gen_state g;
        memset(&g, 0, sizeof g);
        g.e = e;
        g.stream = true;
        g.stop_token = -1;
        atomc_request r;
        atomc_request_init(&r);
        r.params = a.p;
        r.prompt = prompt;
        r.add_special_tokens = !has_bos;
        r.on_output = on_output;
        r.user = &g;
        if (run_request(e, &r, &g) == 0) {
            putchar('\n');
            fflush(stdout);
            json_array_append_new(history, json_pack("{s:s,s:s%}", "role", "assistant", "content",
                                                     g.text ? g.text : "", g.text_len));
        } else {
            json_array_remove(history, json_array_size(history) - 1);
        }
        free(g.ids);
        free(g.text);
        free(prompt);
    }
    json_decref(history);
    atomc_engine_free(e);
    return 0;
#endif
}
