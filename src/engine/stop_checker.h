// Stop strings on the detokenized output of one sequence.
//
// The checker accumulates the sequence's output text. After each delta it looks for the
// earliest occurrence of any stop string that ends inside the new text (so matches across
// token boundaries are found, and each byte is searched O(max stop length) times). On a
// match the text is cut before the stop string (or after it with include_stop_str_in_output).
// While streaming, the longest tail of the text that is a proper prefix of some stop string is
// held back, so text that may turn out to belong to a stop string is never emitted.
#ifndef ATOMC_ENGINE_STOP_CHECKER_H
#define ATOMC_ENGINE_STOP_CHECKER_H

#include <stdbool.h>
#include <stddef.h>

struct stop_checker {
    const char *const *stops; // (n_stops) not owned
    int n_stops;
    size_t max_stop_len;
    bool include_stop;
    char *text; // (len) output text so far, NUL-terminated
    size_t len, cap;
    size_t emitted; // bytes of text handed out by stop_checker_take
    int matched;    // index of the stop string matched, -1 if none
};

void stop_checker_init(struct stop_checker *sc, const char *const *stops, int n_stops, bool include_stop);
void stop_checker_free(struct stop_checker *sc);

// Appends a text delta. If check is true, searches for stop strings ending in the new text;
// returns the index of the string matched (text then truncated) or -1.
int stop_checker_append(struct stop_checker *sc, const char *delta, size_t len, bool check);

// The text that may be emitted now: from the last emitted byte to the end, minus the held-back
// tail (nothing held back when final). Marks it emitted.
void stop_checker_take(struct stop_checker *sc, bool final, const char **out, size_t *len);

#endif
