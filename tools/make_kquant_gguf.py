#!/usr/bin/env python3
"""Re-quantises a GGUF model (SmolLM2-135M-Instruct's Q4_1 file) into K-quants with gguf-py, for
the CPU backend's K-quant tests and benchmarks. gguf-py dequantises every source tensor; the
K-quantiser here is a plain one (per-sub-block min / max scales rounded to the format's 6-bit /
int8 scale codes, no llama.cpp-style search), which is enough to make valid blocks whose values
are near the source weights.

  --mix q4_k_m  ffn_down in Q4_K, Q6_K in every third layer (llama.cpp's Q4_K_M spends its extra
                bits on ffn_down / attn_v), the rest as in the source file
  --mix q6_k    every tensor with whole 256-element rows in Q6_K, the rest as in the source
  --mix f32     every tensor dequantised to F32 (the reference for the other two)

K-quant rows must be whole super-blocks of 256: SmolLM2's hidden size is 576, so only ffn_down
(1536 columns) can be K-quantised; llama.cpp falls back to other types for such tensors too.

Usage: python3 tools/make_kquant_gguf.py SRC.gguf OUT.gguf --mix q4_k_m|q6_k|f32
"""
import argparse
import re

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def _f16_bytes(a):
    return np.ascontiguousarray(a.astype(np.float16)).view(np.uint8).reshape(a.shape[0], 2)


def quantize_q4_k(x):
    """x: (n_blocks, 256) float32 -> (n_blocks, 144) uint8."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    mn = np.minimum(sub.min(axis=2), 0.0)  # offsets are <= 0: x = d*sc*q - dmin*m
    mx = sub.max(axis=2)
    scale = (mx - mn) / 15.0
    d = scale.max(axis=1) / 63.0
    dmin = (-mn).max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-mn, dmin16[:, None], out=np.zeros_like(mn), where=dmin16[:, None] > 0)), 0, 63)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    step = (d16[:, None] * sc)[:, :, None]
    off = (dmin16[:, None] * m)[:, :, None]
    q = np.clip(np.rint(np.divide(sub + off, step, out=np.zeros_like(sub), where=step > 0)), 0, 15).astype(np.uint8)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = np.zeros((n, 4, 32), np.uint8)
    for g in range(4):
        qs[:, g, :] = q[:, 2 * g, :] | (q[:, 2 * g + 1, :] << 4)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs.reshape(n, 128)], axis=1)


def quantize_q6_k(x):
    """x: (n_blocks, 256) float32 -> (n_blocks, 210) uint8."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=2)
    scale = amax / 31.0
    d = scale.max(axis=1) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), -128, 127)
    step = (d16[:, None] * sc)[:, :, None]
    q = np.clip(np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = np.zeros((n, 2, 64), np.uint8)
    qh = np.zeros((n, 2, 32), np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0:32] & 0xF) | ((q[:, :, 64:96] & 0xF) << 4)
    ql[:, :, 32:64] = (q[:, :, 32:64] & 0xF) | ((q[:, :, 96:128] & 0xF) << 4)
    qh[:, :, :] = ((q[:, :, 0:32] >> 4) | ((q[:, :, 32:64] >> 4) << 2) | ((q[:, :, 64:96] >> 4) << 4)
                   | ((q[:, :, 96:128] >> 4) << 6))
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)],
                          axis=1)


QUANTIZERS = {T.Q4_K: (quantize_q4_k, 144), T.Q6_K: (quantize_q6_k, 210)}


def target_type(name, cols, mix):
    if mix == "f32":
        return T.F32
    if cols % 256 != 0 or not name.endswith(".weight") or "norm" in name:
        return None  # keep the source type
    if mix == "q6_k":
        return T.Q6_K
    m = re.match(r"blk\.(\d+)\.ffn_down\.weight", name)
    if m:
        return T.Q6_K if int(m.group(1)) % 3 == 0 else T.Q4_K
    return None


def copy_metadata(r, w):
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--mix", choices=["q4_k_m", "q6_k", "f32"], required=True)
    a = ap.parse_args()
    r = GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(a.out, arch)
    copy_metadata(r, w)
    counts = {}
    for t in r.tensors:
        shape = [int(v) for v in reversed(t.shape.tolist())]  # numpy order: (rows, cols)
        cols = shape[-1]
        tt = target_type(t.name, cols, a.mix)
        if tt is None:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
            continue
        x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if tt == T.F32:
            w.add_tensor(t.name, x)
        else:
            fn, bb = QUANTIZERS[tt]
            blocks = fn(x.reshape(-1, 256))
            raw = blocks.reshape(shape[0], cols // 256 * bb)
            back = dequantize(raw, tt).reshape(shape)
            rel = np.sqrt(np.mean((back - x) ** 2) / max(np.mean(x ** 2), 1e-30))
            assert rel < (0.15 if tt == T.Q4_K else 0.05), f"{t.name}: {tt.name} relative RMS error {rel:.3f}"
            w.add_tensor(t.name, raw, raw_dtype=tt)
        counts[tt.name] = counts.get(tt.name, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", a.out, counts)


if __name__ == "__main__":
    main()
