// Names of the weight quantisation schemes (core/weight.h), for messages.
#include "core/weight.h"

const char *weight_scheme_name(enum weight_scheme s) {
    switch (s) {
    case WEIGHT_SCHEME_NONE: return "none";
    case WEIGHT_SCHEME_PER_TENSOR: return "per-tensor";
    case WEIGHT_SCHEME_PER_CHANNEL: return "per-channel";
    case WEIGHT_SCHEME_BLOCK: return "block";
    case WEIGHT_SCHEME_GROUP: return "group";
    case WEIGHT_SCHEME_MX: return "mx";
    case WEIGHT_SCHEME_COUNT: break;
    }
    return "?";
}
