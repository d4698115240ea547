#include "atomc.h"

const char *atomc_status_name(atomc_status s) {
    switch (s) {
    case ATOMC_OK: return "ok";
    case ATOMC_ERR_INVALID_ARGUMENT: return "invalid argument";
    case ATOMC_ERR_IO: return "i/o error";
    case ATOMC_ERR_FORMAT: return "bad format";
    case ATOMC_ERR_UNSUPPORTED: return "unsupported";
    case ATOMC_ERR_OUT_OF_MEMORY: return "out of memory";
    case ATOMC_ERR_TOO_LONG: return "too long";
    case ATOMC_ERR_BUSY: return "busy";
    case ATOMC_ERR_NOT_FOUND: return "not found";
    case ATOMC_ERR_BACKEND: return "backend error";
    case ATOMC_ERR_INTERNAL: return "internal error";
    }
    return "unknown";
}

const char *atomc_finish_reason_name(atomc_finish_reason r) {
    switch (r) {
    case ATOMC_FINISH_NONE: return "";
    case ATOMC_FINISH_STOP: return "stop";
    case ATOMC_FINISH_LENGTH: return "length";
    case ATOMC_FINISH_ABORT: return "abort";
    case ATOMC_FINISH_ERROR: return "error";
    }
    return "";
}
