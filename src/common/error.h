// Errors caused by input, files, memory or load: a status code plus a message.
// Programmer bugs assert instead (see DESIGN.md section 7). Functions that can fail
// take `struct error *err` (may be NULL) and return an atomc_status; on failure the
// message names the file / tensor / field that caused it.
#ifndef ATOMC_COMMON_ERROR_H
#define ATOMC_COMMON_ERROR_H

#include <stddef.h>

#include "atomc.h"

#define ERROR_MSG_MAX 512

struct error {
    atomc_status status;
    char msg[ERROR_MSG_MAX];
};

// Records status and a printf-style message in err (if non-NULL); returns status so
// callers can write `return error_set(err, ATOMC_ERR_FORMAT, "...")`.
atomc_status error_set(struct error *err, atomc_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Prepends context ("loading model.safetensors: ") to an existing message.
atomc_status error_prefix(struct error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

void error_clear(struct error *err);

#endif
