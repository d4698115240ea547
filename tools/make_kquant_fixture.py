#!/usr/bin/env python3
"""Writes tests/fixtures/loader/kquants.gguf: random K-quant blocks and their dequantisation by
gguf-py (the reference the C decoders in src/core/dtype.c are checked against, test_cpu_quant.c).

For each type T of Q4_K, Q5_K, Q6_K: tensor "T.q" (rows x 512 elements, raw blocks of random
bytes with sane f16 super-block scales) and "T.ref" (the same shape in F32, from
gguf.quants.dequantize). gguf-py has no Q8_K; its reference is written here from the format
(d * q, f32 d, int8 q; the int16 block sums are not used by dequantisation).

Usage: python3 tools/make_kquant_fixture.py [OUT]  (default tests/fixtures/loader/kquants.gguf)
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize

ROWS, COLS = 3, 512  # two super-blocks per row
BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210, T.Q8_K: 292}


def random_blocks(rng, qt, n):
    b = rng.integers(0, 256, size=(n, BLOCK_BYTES[qt]), dtype=np.uint8)
    f16 = lambda lo, hi: np.frombuffer(rng.uniform(lo, hi, size=n).astype(np.float16).tobytes(), np.uint8).reshape(n, 2)
    if qt in (T.Q4_K, T.Q5_K):
        b[:, 0:2] = f16(0.001, 0.02)   # d
        b[:, 2:4] = f16(0.001, 0.02)   # dmin
    elif qt == T.Q6_K:
        b[:, 208:210] = f16(0.001, 0.02)
    else:  # Q8_K: f32 d first
        b[:, 0:4] = np.frombuffer(rng.uniform(0.001, 0.02, size=n).astype(np.float32).tobytes(), np.uint8).reshape(n, 4)
    return b


def q8_k_reference(blocks):
    d = blocks[:, 0:4].copy().view(np.float32)  # (n, 1)
    q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
    return (d * q).astype(np.float32)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/loader/kquants.gguf"
    rng = np.random.default_rng(20261201)
    w = GGUFWriter(out, "llama")
    for qt in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K):
        n = ROWS * COLS // 256
        blocks = random_blocks(rng, qt, n)
        raw = blocks.reshape(ROWS, COLS // 256 * BLOCK_BYTES[qt])
        if qt == T.Q8_K:
            ref = q8_k_reference(blocks).reshape(ROWS, COLS)
        else:
            ref = dequantize(raw, qt).astype(np.float32).reshape(ROWS, COLS)
        assert np.all(np.isfinite(ref))
        w.add_tensor(f"{qt.name}.q", raw, raw_dtype=qt)
        w.add_tensor(f"{qt.name}.ref", ref)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", out)


if __name__ == "__main__":
    main()
