// Stop-string matching: see stop_checker.h.
#include "engine/stop_checker.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"

void stop_checker_init(struct stop_checker *sc, const char *const *stops, int n_stops, bool include_stop) {
    memset(sc, 0, sizeof *sc);
    sc->stops = stops;
    sc->n_stops = n_stops;
    sc->include_stop = include_stop;
    sc->matched = -1;
    for (int i = 0; i < n_stops; i++) {
        size_t l = strlen(stops[i]);
        if (l > sc->max_stop_len) sc->max_stop_len = l;
    }
}

void stop_checker_free(struct stop_checker *sc) {
    free(sc->text);
    sc->text = NULL;
    sc->len = sc->cap = sc->emitted = 0;
}

int stop_checker_append(struct stop_checker *sc, const char *delta, size_t len, bool check) {
    CHECK(sc->matched < 0);
    if (sc->len + len + 1 > sc->cap) {
        size_t cap = sc->cap ? sc->cap : 64;
        while (cap < sc->len + len + 1) cap *= 2;
        sc->text = xrealloc(sc->text, cap);
        sc->cap = cap;
    }
    size_t old = sc->len;
    memcpy(sc->text + sc->len, delta, len);
    sc->len += len;
    sc->text[sc->len] = '\0';
    if (!check || len == 0 || sc->n_stops == 0) return -1;

    // A match must end in the new bytes, so it starts at most max_stop_len - 1 bytes earlier.
    size_t from = old + 1 > sc->max_stop_len ? old + 1 - sc->max_stop_len : 0;
    size_t best_pos = (size_t)-1;
    int best = -1;
    for (int i = 0; i < sc->n_stops; i++) {
        size_t sl = strlen(sc->stops[i]);
        if (sl == 0) continue;
        const char *hit = memmem(sc->text + from, sc->len - from, sc->stops[i], sl);
        if (hit && (size_t)(hit - sc->text) < best_pos) {
            best_pos = (size_t)(hit - sc->text);
            best = i;
        }
    }
    if (best < 0) return -1;
    size_t cut = best_pos + (sc->include_stop ? strlen(sc->stops[best]) : 0);
    if (cut < sc->emitted) cut = sc->emitted; // never take back text already handed out
    sc->len = cut;
    sc->text[cut] = '\0';
    sc->matched = best;
    return best;
}

// Length of the longest tail of text[emitted..len) that is a proper prefix of a stop string.
static size_t held_back(const struct stop_checker *sc) {
    size_t avail = sc->len - sc->emitted;
    size_t k = sc->max_stop_len ? sc->max_stop_len - 1 : 0;
    if (k > avail) k = avail;
    for (; k > 0; k--) {
        const char *tail = sc->text + sc->len - k;
        for (int i = 0; i < sc->n_stops; i++)
            if (strlen(sc->stops[i]) > k && !memcmp(sc->stops[i], tail, k)) return k;
    }
    return 0;
}

void stop_checker_take(struct stop_checker *sc, bool final, const char **out, size_t *len) {
    size_t end = sc->len;
    if (!final && sc->matched < 0) end -= held_back(sc);
    *out = sc->text ? sc->text + sc->emitted : "";
    *len = end > sc->emitted ? end - sc->emitted : 0;
    if (end > sc->emitted) sc->emitted = end;
}
