// `atomc detokenize`: token ids -> text.
//   atomc detokenize --model PATH [--ids 1,2,3 | (ids on stdin)] [--skip-special]
// Ids are separated by commas, spaces or newlines. The text is written as is (no newline added).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "tokenizer/tokenizer.h"

static int usage(void) {
    fprintf(stderr, "usage: atomc detokenize --model PATH [--ids 1,2,3 | stdin] [--skip-special]\n");
    return 2;
}

int cmd_detokenize(int argc, char **argv) {
    const char *model = NULL, *ids_arg = NULL;
    bool skip = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(a, "--ids") && i + 1 < argc) ids_arg = argv[++i];
        else if (!strcmp(a, "--skip-special")) skip = true;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else {
            fprintf(stderr, "atomc detokenize: unknown or incomplete option '%s'\n", a);
            return usage();
        }
    }
    if (!model) {
        fprintf(stderr, "atomc detokenize: --model is required\n");
        return usage();
    }
    char *owned = NULL;
    if (!ids_arg) {
        size_t len;
        owned = cli_read_stream(stdin, &len);
        if (!owned) return 1;
        ids_arg = owned;
    }
    int32_t *ids;
    int n = cli_parse_token_ids(ids_arg, &ids);
    free(owned);
    if (n < 0) return 1;
    struct error err = {0};
    struct tokenizer *tok;
    if (tokenizer_load(model, &tok, &err)) {
        fprintf(stderr, "atomc detokenize: %s\n", err.msg);
        free(ids);
        return 1;
    }
    char *text;
    int rc = 0;
    if (tokenizer_decode(tok, ids, n, skip, &text, &err)) {
        fprintf(stderr, "atomc detokenize: %s\n", err.msg);
        rc = 1;
    } else {
        fwrite(text, 1, strlen(text), stdout);
        free(text);
    }
    free(ids);
    tokenizer_free(tok);
    return rc;
}
