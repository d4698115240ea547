#include "core/dtype.h"

#include <math.h>

#include "common/check.h"

const char *dtype_name(enum dtype t) {
    static const char *names[DTYPE_COUNT] = {"F32", "F16", "BF16", "F8_E4M3", "I32", "I64", "U8", "Q8_0", "Q4_0", "Q4_1"};
    return (unsigned)t < DTYPE_COUNT ? names[t] : "?";
}

int dtype_block_elems(enum dtype t) {
    return (t == DTYPE_Q8_0 || t == DTYPE_Q4_0 || t == DTYPE_Q4_1) ? 32 : 1;
}

size_t dtype_block_bytes(enum dtype t) {
    switch (t) {
    case DTYPE_F32: case DTYPE_I32: return 4;
    case DTYPE_F16: case DTYPE_BF16: return 2;
    case DTYPE_FP8_E4M3: case DTYPE_U8: return 1;
    case DTYPE_I64: return 8;
    case DTYPE_Q8_0: return 2 + 32;
    case DTYPE_Q4_0: return 2 + 16;
    case DTYPE_Q4_1: return 2 + 2 + 16;
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
