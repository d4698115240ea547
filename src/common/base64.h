// Standard base64 (RFC 4648 alphabet, '=' padding), decoding only: tiktoken.model vocabularies,
// test fixtures.
#ifndef ATOMC_COMMON_BASE64_H
#define ATOMC_COMMON_BASE64_H

#include <stddef.h>

// Decodes n characters of s into out (room for 3 * n / 4 bytes). Strict: n a multiple of 4, only
// alphabet characters, '=' only as the last one or two. Returns the byte count, or -1.
long base64_decode(const char *s, size_t n, unsigned char *out);

#endif
