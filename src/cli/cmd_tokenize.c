// `atomc tokenize`: text -> token ids with a model's tokenizer.
//   atomc tokenize --model PATH [--text T | --file F | (stdin)] [--json] [--no-special]
//   atomc tokenize --model PATH --bench [--docs] [--file F | --text T | stdin] [--seconds S]
//   atomc tokenize --model PATH --jsonl [--no-special] < lines   (one JSON string per input line ->
//                  one JSON array of ids per output line; a line that is not a JSON string or does not
//                  encode gives {"error": "..."} on its line; many texts with one tokenizer load)
// PATH is a model directory, a tokenizer.json or a .gguf. Text is taken byte for byte (a trailing
// newline read from stdin is part of it). Output: ids separated by spaces, or with --json an object
// {"ids": [...], "tokens": [...]} (tokens: the vocabulary pieces). --bench reports single-thread
// encode throughput in MB/s over repeated encodes of the input (--docs: the input is cut after
// every blank line ("\n\n") and each piece is encoded on its own, like many short prompts).
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/mapped_file.h"
#include "common/timeutil.h"
#include "tokenizer/tokenizer.h"

static int usage(void) {
    fprintf(stderr, "usage: atomc tokenize --model PATH [--text T | --file F | stdin] [--json] [--no-special]\n"
                    "                      [--bench [--seconds S]] [--jsonl]\n");
    return 2;
}

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL, *file = NULL;
    bool json = false, special = true, bench = false, docs = false, jsonl = false;
    double seconds = 3.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(a, "--text") && i + 1 < argc) text = argv[++i];
        else if (!strcmp(a, "--file") && i + 1 < argc) file = argv[++i];
        else if (!strcmp(a, "--seconds") && i + 1 < argc) {
            if (!cli_parse_double(argv[++i], "--seconds", &seconds)) return 2;
        } else if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "--no-special")) special = false;
        else if (!strcmp(a, "--bench")) bench = true;
        else if (!strcmp(a, "--docs")) docs = true;
        else if (!strcmp(a, "--jsonl")) jsonl = true;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else {
            fprintf(stderr, "atomc tokenize: unknown or incomplete option '%s'\n", a);
            return usage();
        }
    }
    if (!model) {
        fprintf(stderr, "atomc tokenize: --model is required\n");
        return usage();
    }
    struct error err = {0};
    char *owned = NULL;
    size_t len = 0;
    if (text) {
        len = strlen(text);
    } else if (file) {
        if (file_read_all(file, &owned, &len, &err)) {
            fprintf(stderr, "atomc tokenize: %s\n", err.msg);
            return 1;
        }
        text = owned;
    } else {
        owned = cli_read_stream(stdin, &len);
        if (!owned) {
            fprintf(stderr, "atomc tokenize: out of memory reading stdin\n");
            return 1;
        }
        text = owned;
    }
    struct tokenizer *tok;
    double t0 = time_now_s();
    if (tokenizer_load(model, &tok, &err)) {
        fprintf(stderr, "atomc tokenize: %s\n", err.msg);
        free(owned);
        return 1;
    }
    double load_s = time_now_s() - t0;
    if (jsonl) {
        int rc = 0;
        for (const char *p = text, *end = text + len; p < end;) {
            const char *nl = memchr(p, '\n', (size_t)(end - p));
            size_t ll = nl ? (size_t)(nl - p) : (size_t)(end - p);
            json_error_t je;
            json_t *line = json_loadb(p, ll, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            json_t *outj;
            int32_t *lids = NULL;
            int ln = 0;
            if (!json_is_string(line)) {
                outj = json_pack("{s:s}", "error", line ? "not a JSON string" : je.text);
            } else if (tokenizer_encode(tok, json_string_value(line), json_string_length(line), special, &lids, &ln, &err)) {
                outj = json_pack("{s:s}", "error", err.msg);
            } else {
                outj = json_array();
                for (int k = 0; k < ln; k++) json_array_append_new(outj, json_integer(lids[k]));
            }
            free(lids);
            json_decref(line);
            char *s = json_dumps(outj, JSON_COMPACT);
            json_decref(outj);
            if (!s) rc = 1;
            else printf("%s\n", s);
            free(s);
            p = nl ? nl + 1 : end;
        }
        tokenizer_free(tok);
        free(owned);
        return rc;
    }
    int32_t *ids;
    int n;
    if (tokenizer_encode(tok, text, len, special, &ids, &n, &err)) {
        fprintf(stderr, "atomc tokenize: %s\n", err.msg);
        tokenizer_free(tok);
        free(owned);
        return 1;
    }
    int rc = 0;
    if (bench) {
        // CPU time of this thread: stable on a shared machine, and what single-thread throughput means.
        long iters = 0;
        double start = thread_cpu_s(), el = 0;
        do {
            size_t pos = 0;
            int total = 0;
            while (pos < len) {
                size_t end = len;
                if (docs) {
                    const char *nn = memmem(text + pos, len - pos, "\n\n", 2);
                    if (nn) end = (size_t)(nn - text) + 2;
                }
                free(ids);
                if (tokenizer_encode(tok, text + pos, end - pos, special, &ids, &n, &err)) {
                    fprintf(stderr, "atomc tokenize: %s\n", err.msg);
                    rc = 1;
                    ids = NULL;
                    break;
                }
                total += n;
                pos = end;
            }
            if (rc) break;
            n = total;
            iters++;
            el = thread_cpu_s() - start;
        } while (el < seconds);
        if (!rc)
            printf("load %.3f s; %ld%s encodes of %zu bytes -> %d tokens; %.2f MB/s; %.0f tokens/s (thread CPU time)\n", load_s, iters,
                   docs ? " x docs" : "", len, n,
                   (double)len * iters / el / 1e6, (double)n * iters / el);
    } else if (json) {
        json_t *o = json_object(), *ja = json_array(), *jt = json_array();
        for (int i = 0; i < n; i++) {
            json_array_append_new(ja, json_integer(ids[i]));
            const char *p = tokenizer_token_text(tok, ids[i]);
            json_t *s = json_string(p ? p : "");
            json_array_append_new(jt, s ? s : json_string("\xEF\xBF\xBD"));
        }
        json_object_set_new(o, "ids", ja);
        json_object_set_new(o, "tokens", jt);
        char *s = json_dumps(o, JSON_COMPACT);
        if (s) printf("%s\n", s);
        else rc = 1;
        free(s);
        json_decref(o);
    } else {
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
    }
    free(ids);
    tokenizer_free(tok);
    free(owned);
    return rc;
}
