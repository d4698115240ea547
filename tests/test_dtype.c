// Scalar conversions of core/dtype against known bit patterns and round trips.
#include "core/dtype.h"
#include "test.h"

TEST(bf16_round_trip_and_rounding) {
    ASSERT_EQ(f32_to_bf16(1.0f), 0x3f80);
    ASSERT_NEAR(bf16_to_f32(0x3f80), 1.0, 0);
    // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
    ASSERT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
    ASSERT_EQ(f32_to_bf16(1.01171875f), 0x3f82); // halfway, rounds up to even
    ASSERT_TRUE(isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(f16_known_values) {
    ASSERT_EQ(f32_to_f16(1.0f), 0x3c00);
    ASSERT_EQ(f32_to_f16(-2.0f), 0xc000);
    ASSERT_EQ(f32_to_f16(65504.0f), 0x7bff);
    ASSERT_EQ(f32_to_f16(1e6f), 0x7c00);             // overflow -> inf
    ASSERT_EQ(f32_to_f16(5.960464477539063e-08f), 1); // smallest subnormal
    ASSERT_NEAR(f16_to_f32(0x0001), 5.960464477539063e-08, 0);
    for (int h = 0; h < 0x7c00; h += 7) ASSERT_EQ(f32_to_f16(f16_to_f32((uint16_t)h)), h);
}

TEST(fp8_e4m3_round_trip) {
    for (int v = 0; v < 256; v++) {
        if ((v & 0x7f) == 0x7f) continue; // NaN
        float f = fp8_e4m3_to_f32((uint8_t)v);
        ASSERT_EQ(f32_to_fp8_e4m3(f), (v == 0x80) ? 0x80 : v);
    }
    ASSERT_NEAR(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1000.0f)), 448.0, 0);
}

TEST(q4_1_block_dequant) {
    unsigned char blk[20] = {0};
    uint16_t d = f32_to_f16(0.5f), m = f32_to_f16(-1.0f);
    memcpy(blk, &d, 2);
    memcpy(blk + 2, &m, 2);
    for (int j = 0; j < 16; j++) blk[4 + j] = (unsigned char)(j | ((15 - j) << 4));
    float out[32];
    dtype_to_f32(DTYPE_Q4_1, blk, out, 32);
    for (int j = 0; j < 16; j++) {
        ASSERT_NEAR(out[j], 0.5 * j - 1.0, 1e-6);
        ASSERT_NEAR(out[16 + j], 0.5 * (15 - j) - 1.0, 1e-6);
    }
}

int main(int argc, char **argv) { return test_main(argc, argv); }
