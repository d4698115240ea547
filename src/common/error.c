#include "common/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

atomc_status error_set(struct error *err, atomc_status status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->status = status;
    }
    return status;
}

atomc_status error_prefix(struct error *err, const char *fmt, ...) {
    if (!err) return ATOMC_ERR_INTERNAL;
    char prefix[ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    size_t plen = strnlen(prefix, sizeof prefix - 1), mlen = strlen(err->msg);
    if (plen + mlen >= sizeof err->msg) mlen = sizeof err->msg - 1 - plen;
    memmove(err->msg + plen, err->msg, mlen);
    memcpy(err->msg, prefix, plen);
    err->msg[plen + mlen] = '\0';
    return err->status;
}

void error_clear(struct error *err) {
    if (err) {
        err->status = ATOMC_OK;
        err->msg[0] = '\0';
    }
}
