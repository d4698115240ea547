// Element types of tensors, with byte sizes and scalar conversions.
// Quantized types are GGUF's blocks: Q8_0, Q4_0, Q4_1 of 32 elements, the K-quants (Q4_K, Q5_K,
// Q6_K, Q8_K) of 256 (super-blocks of 8 or 16 scaled sub-blocks; layouts in dtype.c).
#ifndef ATOMC_CORE_DTYPE_H
#define ATOMC_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum dtype {
    DTYPE_F32 = 0,
    DTYPE_F16,
    DTYPE_BF16,
    DTYPE_FP8_E4M3,
    DTYPE_I32,
    DTYPE_I64,
    DTYPE_U8,
    DTYPE_Q8_0, // blocks of 32: f16 scale + 32 x int8
    DTYPE_Q4_0, // blocks of 32: f16 scale + 16 bytes of 4-bit values (offset 8)
    DTYPE_Q4_1, // blocks of 32: f16 scale + f16 min + 16 bytes of 4-bit values
    DTYPE_Q4_K, // blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales / mins, 128 bytes of 4-bit
    DTYPE_Q5_K, // blocks of 256: as Q4_K + 32 bytes of the 5th bits
    DTYPE_Q6_K, // blocks of 256: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, f16 d
    DTYPE_Q8_K, // blocks of 256: f32 d, 256 x int8, 16 x int16 sums of 16
    DTYPE_I8,   // int8 (compressed-tensors int-quantized weights; the loader repacks them)
    DTYPE_COUNT
};

const char *dtype_name(enum dtype t);
// Elements per block (1 for plain types, 32 for Q*_0 / Q4_1, 256 for K-quants) and bytes per block.
int dtype_block_elems(enum dtype t);
size_t dtype_block_bytes(enum dtype t);
// Bytes of n elements (n must be a multiple of the block size for Q types).
size_t dtype_row_bytes(enum dtype t, int64_t n);

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even; NaN stays NaN.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float fp8_e4m3_to_f32(uint8_t v);
uint8_t f32_to_fp8_e4m3(float f); // saturating to +-448

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the block's 12 scale bytes.
void dtype_kq_scale_min(const uint8_t *scales12, int j, uint8_t *scale, uint8_t *min);

// Converts n elements of src (any type above except I32/I64/U8) into f32.
void dtype_to_f32(enum dtype t, const void *src, float *dst, int64_t n);
// Converts n f32 into dst of type F32/F16/BF16/FP8_E4M3.
void dtype_from_f32(enum dtype t, const float *src, void *dst, int64_t n);

#endif
