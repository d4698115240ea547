// `atomc chat-template`: renders a conversation with a model's chat template and prints
// the prompt to stdout byte for byte (no trailing newline added).
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/timeutil.h"
#include "template/chat_template.h"

static void chat_template_usage(FILE *f) {
    fprintf(f,
            "usage: atomc chat-template --model PATH --messages FILE.json [options]\n"
            "  --model PATH             model directory, tokenizer_config.json or .gguf file\n"
            "  --messages FILE.json     JSON array of messages ({\"role\", \"content\", ...}); '-' = stdin\n"
            "  --tools FILE.json        JSON array of tool schemas\n"
            "  --add-generation-prompt  end with the assistant header\n"
            "  --continue-final-message continue the last message instead\n"
            "  --kwargs JSON            extra template variables, e.g. '{\"enable_thinking\": false}'\n"
            "  --chat-template FILE     use this template instead of the model's\n"
            "  --bos TEXT / --eos TEXT  override the BOS / EOS token text\n"
            "  --bench N                render N times more and report microseconds per render (stderr)\n");
}

static json_t *load_json_arg(const char *path, const char *what) {
    json_error_t je;
    json_t *j = !strcmp(path, "-") ? json_loadf(stdin, 0, &je) : json_load_file(path, 0, &je);
    if (!j) fprintf(stderr, "atomc chat-template: %s %s: invalid JSON at line %d: %s\n", what, path, je.line, je.text);
    return j;
}

int cmd_chat_template(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},          {"messages", required_argument, 0, 'M'},
        {"tools", required_argument, 0, 't'},          {"add-generation-prompt", no_argument, 0, 'g'},
        {"continue-final-message", no_argument, 0, 'c'}, {"kwargs", required_argument, 0, 'k'},
        {"chat-template", required_argument, 0, 'T'},  {"bos", required_argument, 0, 'b'},
        {"eos", required_argument, 0, 'e'},            {"bench", required_argument, 0, 'B'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *messages_path = NULL, *tools_path = NULL, *kwargs_text = NULL, *template_path = NULL;
    const char *bos = NULL, *eos = NULL;
    bool gen = false, cont = false;
    int bench = 0;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'M': messages_path = optarg; break;
        case 't': tools_path = optarg; break;
        case 'g': gen = true; break;
        case 'c': cont = true; break;
        case 'k': kwargs_text = optarg; break;
        case 'T': template_path = optarg; break;
        case 'b': bos = optarg; break;
        case 'e': eos = optarg; break;
        case 'B':
            if (!cli_parse_int(optarg, "--bench", 0, 1 << 30, &bench)) return 2;
            break;
        case 'h': chat_template_usage(stdout); return 0;
        default: chat_template_usage(stderr); return 2;
        }
    }
    if ((!model && !template_path) || !messages_path) {
        chat_template_usage(stderr);
        return 2;
    }
    int rc = 1;
    struct error err = {0};
    struct chat_template_source src = {0};
    struct chat_template *t = NULL;
    json_t *messages = NULL, *tools = NULL, *kwargs = NULL;
    char *out = NULL;
    messages = load_json_arg(messages_path, "messages");
    if (!messages) goto done;
    if (tools_path && !(tools = load_json_arg(tools_path, "tools"))) goto done;
    if (kwargs_text) {
        json_error_t je;
        kwargs = json_loads(kwargs_text, 0, &je);
        if (!kwargs || !json_is_object(kwargs)) {
            fprintf(stderr, "atomc chat-template: --kwargs must be a JSON object%s%s\n", kwargs ? "" : ": ",
                    kwargs ? "" : je.text);
            goto done;
        }
    }
    if (chat_template_source_load(model, template_path, tools != NULL, &src, &err) != ATOMC_OK ||
        chat_template_compile(src.template_src, &t, &err) != ATOMC_OK ||
        chat_template_render(t, messages, tools, gen, cont, kwargs, bos ? bos : src.bos_token,
                             eos ? eos : src.eos_token, &out, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc chat-template: %s\n", err.msg);
        goto done;
    }
    if (bench > 0) {
        // compiled once above; each iteration validates, converts the JSON and renders
        double t0 = time_now_s();
        for (int i = 0; i < bench; i++) {
            char *o = NULL;
            if (chat_template_render(t, messages, tools, gen, cont, kwargs, bos ? bos : src.bos_token,
                                     eos ? eos : src.eos_token, &o, &err) != ATOMC_OK) {
                fprintf(stderr, "atomc chat-template: %s\n", err.msg);
                goto done;
            }
            free(o);
        }
        double dt = time_now_s() - t0;
        fprintf(stderr, "bench: %d renders, %.2f us/render, %zu bytes of output each\n", bench, dt * 1e6 / (double)bench,
                strlen(out));
    }
    fwrite(out, 1, strlen(out), stdout);
    fflush(stdout);
    rc = 0;
done:
    free(out);
    chat_template_free(t);
    chat_template_source_free(&src);
    json_decref(messages);
    json_decref(tools);
    json_decref(kwargs);
    return rc;
}
