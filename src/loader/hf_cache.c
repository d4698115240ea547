#include "loader/hf_cache.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static bool path_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static bool id_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
}

bool hf_cache_is_repo_id(const char *spec) {
    if (!spec || !*spec || spec[0] == '.' || spec[0] == '/' || strstr(spec, "..") || strstr(spec, "--")) return false;
    const char *slash = strchr(spec, '/');
    if (!slash || slash == spec || !slash[1] || strchr(slash + 1, '/') || slash[1] == '.') return false;
    for (const char *c = spec; *c; c++)
        if (c != slash && !id_char(*c)) return false;
    return true;
}

// The hub directory and a description of what chose it, for error messages.
static void hub_dir(const struct hf_cache_env *env, char *out, size_t n, char *why, size_t wn) {
    if (env->hf_hub_cache && *env->hf_hub_cache) {
        snprintf(out, n, "%s", env->hf_hub_cache);
        snprintf(why, wn, "HF_HUB_CACHE=%s", env->hf_hub_cache);
    } else if (env->hf_home && *env->hf_home) {
        snprintf(out, n, "%s/hub", env->hf_home);
        snprintf(why, wn, "HF_HOME=%s", env->hf_home);
    } else if (env->xdg_cache_home && *env->xdg_cache_home) {
        snprintf(out, n, "%s/huggingface/hub", env->xdg_cache_home);
        snprintf(why, wn, "XDG_CACHE_HOME=%s", env->xdg_cache_home);
    } else {
        snprintf(out, n, "%s/.cache/huggingface/hub", env->home && *env->home ? env->home : "~");
        snprintf(why, wn, "the default under HOME (HF_HUB_CACHE, HF_HOME and XDG_CACHE_HOME unset)");
    }
}

// What to open in a snapshot: the directory when it has config.json, else its one .gguf file.
// Returns the number of .gguf files seen when there is no config.json (0 or > 1: not usable).
static int snapshot_target(const char *dir, char *out, size_t n) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s/config.json", dir) < (int)sizeof p && path_exists(p)) {
        snprintf(out, n, "%s", dir);
        return 1;
    }
    DIR *d = opendir(dir);
    if (!d) return 0;
    int ggufs = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t l = strlen(e->d_name);
        if (l > 5 && !strcmp(e->d_name + l - 5, ".gguf") && ggufs++ == 0)
            if (snprintf(out, n, "%s/%s", dir, e->d_name) >= (int)n) ggufs = 2;
    }
    closedir(d);
    return ggufs;
}

// The snapshot named by refs/main, else the newest snapshot directory. false if none.
static bool pick_snapshot(const char *repo, char *out, size_t n) {
    char p[4096], rev[128] = "";
    if (snprintf(p, sizeof p, "%s/refs/main", repo) >= (int)sizeof p) return false;
    FILE *f = fopen(p, "r");
    if (f) {
        if (!fgets(rev, sizeof rev, f)) rev[0] = '\0';
        fclose(f);
        rev[strcspn(rev, "\r\n \t")] = '\0';
        if (rev[0] && !strchr(rev, '/')) {
            if (snprintf(out, n, "%s/snapshots/%s", repo, rev) < (int)n && path_exists(out)) return true;
        }
    }
    if (snprintf(p, sizeof p, "%s/snapshots", repo) >= (int)sizeof p) return false;
    DIR *d = opendir(p);
    if (!d) return false;
    time_t best = 0;
    bool found = false;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char c[4096];
        struct stat st;
        if (snprintf(c, sizeof c, "%s/%s", p, e->d_name) >= (int)sizeof c || stat(c, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
        if (!found || st.st_mtime > best) {
            best = st.st_mtime;
            snprintf(out, n, "%s", c);
            found = true;
        }
    }
    closedir(d);
    return found;
}

atomc_status hf_cache_resolve(const char *spec, const struct hf_cache_env *env, char *out, size_t out_len,
                              struct error *err) {
    if (!spec || !*spec) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "no model given");
    if (path_exists(spec) || !hf_cache_is_repo_id(spec)) {
        if (strlen(spec) >= out_len) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "model path too long");
        snprintf(out, out_len, "%s", spec);
        return ATOMC_OK;
    }
    char hub[2048], why[2300], repo[4096], snap[4096] = "";
    hub_dir(env, hub, sizeof hub, why, sizeof why);
    const char *slash = strchr(spec, '/');
    snprintf(repo, sizeof repo, "%s/models--%.*s--%s", hub, (int)(slash - spec), spec, slash + 1);
    if (!path_exists(repo))
        return error_set(err, ATOMC_ERR_NOT_FOUND,
                         "model '%s' is not a file or directory here, and not in the Hugging Face cache: looked for "
                         "%s (hub chosen by %s); atomc does not download models: fetch it first, e.g. "
                         "`huggingface-cli download %s`",
                         spec, repo, why, spec);
    if (!pick_snapshot(repo, snap, sizeof snap))
        return error_set(err, ATOMC_ERR_NOT_FOUND,
                         "model '%s': %s has no snapshot (no refs/main and nothing under snapshots/); the download "
                         "looks incomplete",
                         spec, repo);
    char target[4096];
    int found = snapshot_target(snap, target, sizeof target);
    if (found == 0)
        return error_set(err, ATOMC_ERR_NOT_FOUND,
                         "model '%s': the cached snapshot %s holds neither config.json nor a .gguf file", spec, snap);
    if (found > 1)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "model '%s': the cached snapshot %s holds %d .gguf files and no config.json: pass the "
                         "path of the one to load",
                         spec, snap, found);
    if (strlen(target) >= out_len) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "model path too long");
    snprintf(out, out_len, "%s", target);
    return ATOMC_OK;
}
