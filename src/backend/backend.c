#include "backend/backend.h"

#include <string.h>

#include "common/log.h"

const char *backend_resolve_device(const char *name) {
    if (!name) return "cpu";
    if (strcmp(name, "auto")) return name;
#ifdef ATOMC_CUDA
    char why[256] = "";
    if (backend_cuda_usable(why, sizeof why)) {
        LOG_INFO("device auto: cuda (%s)", why);
        return "cuda";
    }
    LOG_INFO("device auto: cpu (no usable GPU: %s)", why);
#else
    LOG_INFO("device auto: cpu (this atomc was built without CUDA)");
#endif
    return "cpu";
}

atomc_status backend_create(const char *name, const struct backend_options *o, struct backend **out,
                            struct error *err) {
    *out = NULL;
    name = backend_resolve_device(name);
    if (!name || !strcmp(name, "cpu")) return backend_cpu_create(o, out, err);
    if (!strcmp(name, "cuda")) {
#ifdef ATOMC_CUDA
        return backend_cuda_create(o, out, err);
#else
        return error_set(err, ATOMC_ERR_UNSUPPORTED, "this atomc was built without CUDA (rebuild with make CUDA=1)");
#endif
    }
    return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown device '%s' (expected cpu or cuda)", name);
}

void backend_destroy(struct backend *b) {
    if (b) b->ops->destroy(b);
}
