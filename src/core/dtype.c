#include "core/dtype.h"

#include <math.h>

#include "common/check.h"

const char *dtype_name(enum dtype t) {
    static const char *names[DTYPE_COUNT] = {"F32", "F16", "BF16", "F8_E4M3", "I32", "I64", "U8", "Q8_0", "Q4_0", "Q4_1",
                                                 "Q4_K", "Q5_K", "Q6_K", "Q8_K", "I8"};
    return (unsigned)t < DTYPE_COUNT ? names[t] : "?";
}

int dtype_block_elems(enum dtype t) {
    if (t == DTYPE_Q8_0 || t == DTYPE_Q4_0 || t == DTYPE_Q4_1) return 32;
    if (t == DTYPE_Q4_K || t == DTYPE_Q5_K || t == DTYPE_Q6_K || t == DTYPE_Q8_K) return 256;
    return 1;
}

size_t dtype_block_bytes(enum dtype t) {
    switch (t) {
    case DTYPE_F32: case DTYPE_I32: return 4;
    case DTYPE_F16: case DTYPE_BF16: return 2;
    case DTYPE_FP8_E4M3: case DTYPE_U8: case DTYPE_I8: return 1;
    case DTYPE_I64: return 8;
    case DTYPE_Q8_0: return 2 + 32;
    case DTYPE_Q4_0: return 2 + 16;
    case DTYPE_Q4_1: return 2 + 2 + 16;
    case DTYPE_Q4_K: return 2 + 2 + 12 + 128;
    case DTYPE_Q5_K: return 2 + 2 + 12 + 32 + 128;
    case DTYPE_Q6_K: return 128 + 64 + 16 + 2;
    case DTYPE_Q8_K: return 4 + 256 + 32;
    default: CHECK_MSG(0, "bad dtype %d", (int)t);
    }
    return 0;
}

size_t dtype_row_bytes(enum dtype t, int64_t n) {
    int be = dtype_block_elems(t);
    CHECK(n % be == 0);
    return (size_t)(n / be) * dtype_block_bytes(t);
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { // subnormal: normalise
            int e = -1;
            do { e++; mant <<= 1; } while ((mant & 0x400) == 0);
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    int32_t exp = (int32_t)((u >> 23) & 0xff);
    uint32_t mant = u & 0x7fffff;
    if (exp == 255) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    int32_t e = exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return (uint16_t)half;
}

float fp8_e4m3_to_f32(uint8_t v) {
    uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, mant = v & 7;
    float r;
    if (exp == 0xf && mant == 7) return NAN;
    if (exp == 0) r = ldexpf((float)mant / 8.0f, -6);
    else r = ldexpf(1.0f + (float)mant / 8.0f, (int)exp - 7);
    return sign ? -r : r;
}

uint8_t f32_to_fp8_e4m3(float f) {
    if (isnan(f)) return 0x7f;
    uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.0f) return sign | 0x7e;
    if (a < ldexpf(1.0f, -10)) return sign; // below half the smallest subnormal (2^-9)
    int e;
    frexpf(a, &e); // a = m * 2^e, m in [0.5,1)
    int exp = e - 1 + 7; // biased exponent of 1.xxx form
    if (exp <= 0) {      // subnormal: value = mant/8 * 2^-6
        int m = (int)lrintf(a / ldexpf(1.0f, -9));
        if (m >= 8) return sign | (1 << 3);
        return sign | (uint8_t)m;
    }
    float scaled = a / ldexpf(1.0f, e - 1); // in [1,2)
    int m = (int)lrintf((scaled - 1.0f) * 8.0f);
    if (m == 8) { m = 0; exp++; }
    if (exp > 15 || (exp == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)(exp << 3) | (uint8_t)m;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes:
// j < 4: low 6 bits of bytes j and j + 4; j >= 4: 4 bits of byte j + 4 plus the top 2 bits of
// bytes j - 4 (scale) and j (min).
void dtype_kq_scale_min(const uint8_t *sc, int j, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (uint8_t)((sc[j + 4] & 0xf) | ((sc[j - 4] >> 6) << 4));
        *min = (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
    }
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// K-quant super-blocks of 256 (ggml's layouts; the arithmetic order is ggml's and gguf-py's:
// sub-block scale d * sc first, then times the quant, minus dmin * m).
static void dequant_q4_k(const uint8_t *b, float *y) {
    float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int g = 0; g < 4; g++) { // 64 elements: low nibbles of 32 bytes, then high nibbles
        uint8_t s0, m0, s1, m1;
        dtype_kq_scale_min(sc, 2 * g, &s0, &m0);
        dtype_kq_scale_min(sc, 2 * g + 1, &s1, &m1);
        float d1 = d * (float)s0, n1 = dmin * (float)m0, d2 = d * (float)s1, n2 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) y[g * 64 + l] = d1 * (float)(q[g * 32 + l] & 0xf) - n1;
        for (int l = 0; l < 32; l++) y[g * 64 + 32 + l] = d2 * (float)(q[g * 32 + l] >> 4) - n2;
    }
}

static void dequant_q5_k(const uint8_t *b, float *y) {
    float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *q = b + 48;
    for (int g = 0; g < 4; g++) {
        uint8_t s0, m0, s1, m1;
        dtype_kq_scale_min(sc, 2 * g, &s0, &m0);
        dtype_kq_scale_min(sc, 2 * g + 1, &s1, &m1);
        float d1 = d * (float)s0, n1 = dmin * (float)m0, d2 = d * (float)s1, n2 = dmin * (float)m1;
        uint8_t u1 = (uint8_t)(1u << (2 * g)), u2 = (uint8_t)(2u << (2 * g));
        for (int l = 0; l < 32; l++)
            y[g * 64 + l] = d1 * (float)((q[g * 32 + l] & 0xf) + (qh[l] & u1 ? 16 : 0)) - n1;
        for (int l = 0; l < 32; l++)
            y[g * 64 + 32 + l] = d2 * (float)((q[g * 32 + l] >> 4) + (qh[l] & u2 ? 16 : 0)) - n2;
    }
}

static void dequant_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16_at(b + 208);
    for (int n = 0; n < 2; n++) { // 128 elements per half
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

static void dequant_q8_k(const uint8_t *b, float *y) {
    float d;
    memcpy(&d, b, 4);
    for (int l = 0; l < 256; l++) y[l] = d * (float)(int8_t)b[4 + l];
}

void dtype_to_f32(enum dtype t, const void *src, float *dst, int64_t n) {
    const uint8_t *s = src;
    switch (t) {
    case DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return;
    case DTYPE_F16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, s + 2 * i, 2); dst[i] = f16_to_f32(h); } return;
    case DTYPE_BF16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, s + 2 * i, 2); dst[i] = bf16_to_f32(h); } return;
    case DTYPE_FP8_E4M3: for (int64_t i = 0; i < n; i++) dst[i] = fp8_e4m3_to_f32(s[i]); return;
    case DTYPE_Q8_0:
        CHECK(n % 32 == 0);
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = s + b * 34;
            uint16_t h; memcpy(&h, blk, 2);
            float d = f16_to_f32(h);
            for (int j = 0; j < 32; j++) dst[b * 32 + j] = d * (float)(int8_t)blk[2 + j];
        }
        return;
    case DTYPE_Q4_0:
        CHECK(n % 32 == 0);
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = s + b * 18;
            uint16_t h; memcpy(&h, blk, 2);
            float d = f16_to_f32(h);
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + j] = d * (float)((blk[2 + j] & 0xf) - 8);
                dst[b * 32 + j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
            }
        }
        return;
    case DTYPE_Q4_1:
        CHECK(n % 32 == 0);
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = s + b * 20;
            uint16_t h, hm; memcpy(&h, blk, 2); memcpy(&hm, blk + 2, 2);
            float d = f16_to_f32(h), m = f16_to_f32(hm);
            for (int j = 0; j < 16; j++) {
                dst[b * 32 + j] = d * (float)(blk[4 + j] & 0xf) + m;
                dst[b * 32 + j + 16] = d * (float)(blk[4 + j] >> 4) + m;
            }
        }
        return;
    case DTYPE_Q4_K:
    case DTYPE_Q5_K:
    case DTYPE_Q6_K:
    case DTYPE_Q8_K: {
        CHECK(n % 256 == 0);
        size_t bb = dtype_block_bytes(t);
        void (*f)(const uint8_t *, float *) = t == DTYPE_Q4_K   ? dequant_q4_k
                                              : t == DTYPE_Q5_K ? dequant_q5_k
                                              : t == DTYPE_Q6_K ? dequant_q6_k
                                                                : dequant_q8_k;
        for (int64_t b = 0; b < n / 256; b++) f(s + b * bb, dst + b * 256);
        return;
    }
    default: CHECK_MSG(0, "dtype_to_f32: unsupported %s", dtype_name(t));
    }
}

void dtype_from_f32(enum dtype t, const float *src, void *dst, int64_t n) {
    uint8_t *d = dst;
    switch (t) {
    case DTYPE_F32: memcpy(dst, src, (size_t)n * 4); return;
    case DTYPE_F16: for (int64_t i = 0; i < n; i++) { uint16_t h = f32_to_f16(src[i]); memcpy(d + 2 * i, &h, 2); } return;
    case DTYPE_BF16: for (int64_t i = 0; i < n; i++) { uint16_t h = f32_to_bf16(src[i]); memcpy(d + 2 * i, &h, 2); } return;
    case DTYPE_FP8_E4M3: for (int64_t i = 0; i < n; i++) d[i] = f32_to_fp8_e4m3(src[i]); return;
    default: CHECK_MSG(0, "dtype_from_f32: unsupported %s", dtype_name(t));
    }
}
