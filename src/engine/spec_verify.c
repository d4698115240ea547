// Verification of draft tokens (spec.h): the longest accepted prefix.
#include "engine/spec.h"

int spec_accepted_length(const int32_t *draft, int n_draft, const int32_t *target) {
    int m = 0;
    while (m < n_draft && target[m] == draft[m])
        m++;
    return m;
}
