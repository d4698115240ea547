#include <stdio.h>

#include "cli/commands.h"

int cmd_version(int argc, char **argv) {
    (void)argc;
    (void)argv;
#ifdef ATOMC_CUDA
    printf("atomc 0.1.0 (backends: cpu, cuda sm_90a)\n");
#else
    printf("atomc 0.1.0 (backends: cpu)\n");
#endif
    return 0;
}
