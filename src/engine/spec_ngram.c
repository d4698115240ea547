// Prompt lookup drafts (spec.h): the longest matching suffix, then what followed it.
#include "engine/spec.h"

#include "common/check.h"

int spec_ngram_propose(const int32_t *tokens, int n, int min_n, int max_n, int k, int32_t *out) {
    CHECK(min_n >= 1 && max_n >= min_n && k >= 0);
    if (k == 0 || n < min_n + 1) return 0;
    if (max_n > n - 1) max_n = n - 1;
    // For every earlier end position j (tokens[j] followed by at least one token), the length of
    // the common suffix of tokens[..j] and tokens[..n-1], capped at max_n; the longest wins, the
    // latest among equals (scanning from the end, the first to reach a length keeps it).
    int best_len = 0, best_end = -1;
    for (int j = n - 2; j >= 0; j--) {
        int len = 0;
        while (len < max_n && len <= j && tokens[j - len] == tokens[n - 1 - len])
            len++;
        if (len > best_len) {
            best_len = len;
            best_end = j;
            if (len == max_n) break;
        }
    }
    if (best_len < min_n) return 0;
    int m = 0;
    for (int p = best_end + 1; p < n && m < k; p++)
        out[m++] = tokens[p];
    return m;
}
