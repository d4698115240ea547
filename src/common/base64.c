#include "common/base64.h"

#include <stdint.h>

static int b64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

long base64_decode(const char *s, size_t n, unsigned char *out) {
    if (n % 4) return -1;
    long len = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1;
                v[k] = b64_value(c);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[len++] = (unsigned char)(w >> 16);
        if (pad < 2) out[len++] = (unsigned char)(w >> 8);
        if (pad < 1) out[len++] = (unsigned char)w;
    }
    return len;
}
