// `atomc bench serve`: see src/bench/bench_serve.h.
#include <stdio.h>

#include "bench/bench_serve.h"
#include "cli/commands.h"

int cmd_bench_serve(int argc, char **argv) {
    struct bench_serve_options o;
    bench_serve_options_init(&o);
    struct error err = {0};
    bool help = false;
    if (bench_serve_parse_args(&o, argc, argv, &help, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc bench serve: %s\n", err.msg);
        return 2;
    }
    if (help) {
        bench_serve_usage();
        return 0;
    }
    if (bench_serve_run(&o, &err) != ATOMC_OK) {
        fprintf(stderr, "atomc bench serve: %s\n", err.msg);
        return 1;
    }
    return 0;
}
