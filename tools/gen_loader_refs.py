#!/usr/bin/env python3
"""Writes the loader's reference fixtures (tests/fixtures/loader/), made with the reference
Python implementations so the C loader is checked against them, not against itself:

  ref.safetensors / ref_safetensors.json  tensors written by the `safetensors` package
                                          (F32/F16/BF16/I32/I64/U8 and a scalar) + values
  ref.gguf / ref_gguf.json                a GGUF written by the `gguf` package's GGUFWriter:
                                          every metadata value type, nested arrays, a
                                          non-default alignment, F32/F16/BF16/Q8_0/Q4_0/Q4_1
                                          tensors (quantized by gguf.quants) with their
                                          dequantized values, and a Q4_K tensor (unsupported)
  tiny_llama.gguf / tiny_llama_refs.json  a 2-layer LLaMA GGUF written with llama.cpp's
                                          conventions (q/k rows permuted as its converter
                                          does; q in Q8_0, k in F16) and, as the reference,
                                          the q/k/v weights HF transformers serves when it
                                          loads that GGUF (gguf_file=)
  tiny_qwen3.gguf / tiny_qwen3_refs.json  the same for Qwen3 (no permutation, q/k norms, tied)
  tiny_llama31_rope.gguf (+ _refs.json)    llama3 rope_scaling as llama.cpp stores it (rope_freqs.weight)
  tiny_moe.gguf                           stacked expert tensors with coordinate-encoding values
  tiny_qwen3_hf/ (+ tiny_qwen3_hf_refs.json) transformers save_pretrained, bf16, sharded + index
  ../configs/transformers_parsed.json      AutoConfig's effective reading of every config fixture
  smollm2_refs.json                       from the real SmolLM2-135M-Instruct GGUF
                                          ($ATOMC_SMOLLM2): metadata read by gguf.GGUFReader,
                                          dequantized token_embd rows, and q_proj/k_proj
                                          values as HF transformers' own GGUF loader serves
                                          them (after undoing llama.cpp's Q/K permutation)

Run: python3 tools/gen_loader_refs.py   (needs numpy, torch, safetensors, gguf, transformers)
"""
import json
import os
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "loader")


class F32List(list):
    """float32 values, written with their shortest round-tripping repr."""


class F32Encoder(json.JSONEncoder):
    def iterencode(self, o, _one_shot=False):
        if isinstance(o, F32List):
            yield "[" + ",".join(str(np.float32(x)) for x in o) + "]"
        elif isinstance(o, dict):
            yield "{" + ",".join(json.dumps(k) + ":" + "".join(self.iterencode(v)) for k, v in o.items()) + "}"
        else:
            yield from super().iterencode(o, _one_shot)


def vals(a):
    return [float(x) for x in np.asarray(a, dtype=np.float64).reshape(-1)]


def gen_safetensors():
    import torch
    from safetensors.torch import save_file

    t = {
        "model.embed_tokens.weight": (torch.arange(24, dtype=torch.float32).reshape(4, 6) * 0.25 - 1.5),
        "model.norm.weight": (torch.arange(6, dtype=torch.float32) / 8 + 0.5).to(torch.float16),
        "lm_head.weight": (torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3 - 2).to(torch.bfloat16),
        "ids32": torch.tensor([[1, -2, 3], [2147483647, -2147483648, 0]], dtype=torch.int32),
        "ids64": torch.tensor([5, -6, 1 << 40], dtype=torch.int64),
        "bytes": torch.tensor([0, 7, 255], dtype=torch.uint8),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "f64": torch.tensor([1.0, 2.0], dtype=torch.float64),
        "x.3d": (torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) - 5),
    }
    save_file(t, os.path.join(OUT, "ref.safetensors"), metadata={"format": "pt", "note": "atomc loader fixture"})
    os.chmod(os.path.join(OUT, "ref.safetensors"), 0o644)
    ref = {}
    for k, v in t.items():
        ref[k] = {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
                  "values": [float(x) for x in v.to(torch.float64).reshape(-1).tolist()]}
    with open(os.path.join(OUT, "ref_safetensors.json"), "w") as f:
        json.dump(ref, f, indent=1)


def gen_gguf():
    import gguf
    from gguf import GGMLQuantizationType as Q, GGUFValueType as V

    path = os.path.join(OUT, "ref.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)  # writes general.alignment and aligns the data to it
    w.add_key_value("t.u8", 200, V.UINT8)
    w.add_key_value("t.i8", -100, V.INT8)
    w.add_key_value("t.u16", 60000, V.UINT16)
    w.add_key_value("t.i16", -30000, V.INT16)
    w.add_key_value("t.u32", 4000000000, V.UINT32)
    w.add_key_value("t.i32", -2000000000, V.INT32)
    w.add_key_value("t.f32", 0.15625, V.FLOAT32)
    w.add_key_value("t.bool", True, V.BOOL)
    w.add_key_value("t.str", "héllo wörld", V.STRING)
    w.add_key_value("t.u64", 1 << 40, V.UINT64)
    w.add_key_value("t.i64", -(1 << 40), V.INT64)
    w.add_key_value("t.f64", 2.5e-300, V.FLOAT64)
    w.add_key_value("t.small_u64", 7, V.UINT64)
    w.add_array("t.arr_i32", [1, -2, 3, 2147483647])
    w.add_key_value("t.arr_f32", [0.5, -1.25, 3.0], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.arr_u8", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_array("t.arr_str", ["a", "", "ünï", "<|end|>"])
    w.add_key_value("t.nested", [[1, 2], [3], [4, 5, 6]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("t.arr_bool", [True, False], V.ARRAY, sub_type=V.BOOL)

    rng = np.random.default_rng(1234)
    tensors = {}
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    tensors["t.f32"] = (f32, None)
    f16 = rng.standard_normal((2, 32)).astype(np.float16)
    tensors["t.f16"] = (f16, None)
    for name, qt, shape in [("t.bf16", Q.BF16, (4, 32)), ("t.q8_0", Q.Q8_0, (4, 64)), ("t.q4_0", Q.Q4_0, (4, 64)),
                            ("t.q4_1", Q.Q4_1, (4, 64)), ("t.vec", Q.F32, (96,))]:
        x = rng.standard_normal(shape).astype(np.float32)
        tensors[name] = (gguf.quants.quantize(x, qt) if qt != Q.F32 else x, qt)
    ref = {"tensors": {}}
    for name, (data, qt) in tensors.items():
        if qt is None or qt == Q.F32:
            w.add_tensor(name, data)
            deq = data.astype(np.float32)
        else:
            w.add_tensor(name, data, raw_dtype=qt)
            deq = gguf.quants.dequantize(data, qt)
        ref["tensors"][name] = {"shape": list(deq.shape), "values": vals(deq)}
    # A K-quant tensor: listed and size-checked, but unsupported by atomc.
    q4k = rng.integers(0, 255, size=(2, 144), dtype=np.uint8)
    w.add_tensor("t.q4_k", q4k, raw_dtype=Q.Q4_K)  # byte shape (2, 144) = 2 x 256 elements
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # Read it back with the reference reader: offsets and alignment as it sees them.
    r = gguf.GGUFReader(path)
    ref["data_offset"] = int(r.data_offset)
    ref["alignment"] = int(r.alignment)
    ref["tensor_offsets"] = {t.name: int(t.data_offset - r.data_offset) for t in r.tensors}
    with open(os.path.join(OUT, "ref_gguf.json"), "w") as f:
        json.dump(ref, f, indent=1)


def llama_cpp_permute(w, n_head):
    # What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows of LLaMA models.
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def gen_tiny_gguf():
    import gguf
    from gguf import GGMLQuantizationType as Q
    path = os.path.join(OUT, "tiny_llama.gguf")
    hidden, heads, kv_heads, ff, layers, vocab = 64, 4, 2, 96, 2, 40
    hd = hidden // heads
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    f32 = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)
    w.add_tensor("token_embd.weight", f32(vocab, hidden))
    w.add_tensor("output_norm.weight", f32(hidden))
    w.add_tensor("output.weight", f32(vocab, hidden))
    for l in range(layers):
        q = llama_cpp_permute(f32(hidden, hidden), heads)
        k = llama_cpp_permute(f32(kv_heads * hd, hidden), kv_heads)
        w.add_tensor(f"blk.{l}.attn_q.weight", gguf.quants.quantize(q, Q.Q8_0), raw_dtype=Q.Q8_0)
        w.add_tensor(f"blk.{l}.attn_k.weight", k.astype(np.float16))
        w.add_tensor(f"blk.{l}.attn_v.weight", f32(kv_heads * hd, hidden))
        w.add_tensor(f"blk.{l}.attn_output.weight", f32(hidden, hidden))
        w.add_tensor(f"blk.{l}.attn_norm.weight", f32(hidden))
        w.add_tensor(f"blk.{l}.ffn_norm.weight", f32(hidden))
        w.add_tensor(f"blk.{l}.ffn_gate.weight", gguf.quants.quantize(f32(ff, hidden), Q.Q4_0), raw_dtype=Q.Q4_0)
        w.add_tensor(f"blk.{l}.ffn_up.weight", gguf.quants.quantize(f32(ff, hidden), Q.Q4_1), raw_dtype=Q.Q4_1)
        w.add_tensor(f"blk.{l}.ffn_down.weight", f32(hidden, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file="tiny_llama.gguf", dtype=torch.float32)
    sd = model.state_dict()
    ref = {"config": {"hidden_size": model.config.hidden_size, "num_attention_heads": model.config.num_attention_heads,
                      "num_key_value_heads": model.config.num_key_value_heads,
                      "intermediate_size": model.config.intermediate_size,
                      "num_hidden_layers": model.config.num_hidden_layers, "vocab_size": model.config.vocab_size,
                      "rope_theta": float(model.config.rope_parameters["rope_theta"]),
                      "rms_norm_eps": model.config.rms_norm_eps,
                      "max_position_embeddings": model.config.max_position_embeddings,
                      "tie_word_embeddings": bool(model.config.tie_word_embeddings)},
           "tensors": {}}
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight",
                 "model.norm.weight"]:
        t = sd[name].float().numpy()
        # Full q/k of layer 0 (the permutation is the point); the first rows elsewhere.
        n_rows = t.shape[0] if (".0.self_attn.q_proj" in name or ".0.self_attn.k_proj" in name) else min(8, t.shape[0])
        ref["tensors"][name] = {"shape": list(t.shape), "n_rows": n_rows, "values": F32List(t[:n_rows].reshape(-1))}
    with open(os.path.join(OUT, "tiny_llama_refs.json"), "w") as f:
        f.write(F32Encoder(indent=None).encode(ref))


def gen_tiny_qwen3_gguf():
    """Qwen3 GGUF: no q/k permutation in llama.cpp's converter; per-head q/k norms."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    path = os.path.join(OUT, "tiny_qwen3.gguf")
    # head_dim 128 != hidden / heads, as in real Qwen3 (transformers' GGUF loader assumes
    # Qwen3Config's default 128; llama.cpp writes it as attention.key_length).
    hidden, heads, kv_heads, ff, layers, vocab = 64, 4, 2, 96, 1, 40
    hd = 128
    rng = np.random.default_rng(11)
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(3)
    f32 = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)
    w.add_tensor("token_embd.weight", f32(vocab, hidden))
    w.add_tensor("output_norm.weight", f32(hidden))
    for l in range(layers):  # no output.weight: tied embeddings
        w.add_tensor(f"blk.{l}.attn_q.weight", gguf.quants.quantize(f32(heads * hd, hidden), Q.Q8_0), raw_dtype=Q.Q8_0)
        w.add_tensor(f"blk.{l}.attn_k.weight", f32(kv_heads * hd, hidden).astype(np.float16))
        w.add_tensor(f"blk.{l}.attn_v.weight", gguf.quants.quantize(f32(kv_heads * hd, hidden), Q.Q4_0),
                     raw_dtype=Q.Q4_0)
        w.add_tensor(f"blk.{l}.attn_output.weight", f32(hidden, heads * hd).astype(np.float16))
        w.add_tensor(f"blk.{l}.attn_q_norm.weight", f32(hd))
        w.add_tensor(f"blk.{l}.attn_k_norm.weight", f32(hd))
        w.add_tensor(f"blk.{l}.attn_norm.weight", f32(hidden))
        w.add_tensor(f"blk.{l}.ffn_norm.weight", f32(hidden))
        w.add_tensor(f"blk.{l}.ffn_gate.weight", f32(ff, hidden).astype(np.float16))
        w.add_tensor(f"blk.{l}.ffn_up.weight", f32(ff, hidden).astype(np.float16))
        w.add_tensor(f"blk.{l}.ffn_down.weight", f32(hidden, ff).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file="tiny_qwen3.gguf", dtype=torch.float32)
    sd = model.state_dict()
    cfg = model.config
    ref = {"config": {"architecture": type(model).__name__, "hidden_size": cfg.hidden_size,
                      "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                      "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_hidden_layers,
                      "vocab_size": cfg.vocab_size, "rope_theta": float(cfg.rope_parameters["rope_theta"]),
                      "tie_word_embeddings": bool(cfg.tie_word_embeddings)},
           "tensors": {}}
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.k_norm.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]:
        t = sd[name].float().numpy()
        n_rows = min(8, t.shape[0])  # 8 rows suffice: a wrong (llama) un-permutation moves row 1
        ref["tensors"][name] = {"shape": list(t.shape), "n_rows": n_rows, "values": F32List(t[:n_rows].reshape(-1))}
    with open(os.path.join(OUT, "tiny_qwen3_refs.json"), "w") as f:
        f.write(F32Encoder(indent=None).encode(ref))


def llama_cpp_rope_freqs(theta, dim, factor, low, high, old_ctx):
    # llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): HF's llama3
    # rope_scaling becomes a rope_freqs.weight tensor of per-frequency divisors.
    import math
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gen_tiny_llama3_rope_gguf():
    """A LLaMA GGUF as llama.cpp writes Llama-3.1 (rope scaling only as rope_freqs.weight)."""
    import gguf
    path = os.path.join(OUT, "tiny_llama31_rope.gguf")
    hidden, heads, vocab, theta = 128, 2, 8, 500000.0
    hd = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(131072)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(256)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rf = llama_cpp_rope_freqs(theta, hd, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                              scaling["original_max_position_embeddings"])
    w.add_tensor("rope_freqs.weight", rf)
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(os.path.join(OUT, "tiny_llama31_rope_refs.json"), "w") as f:
        json.dump({"rope_theta": theta, "head_dim": hd, "rope_scaling": scaling,
                   "rope_freqs": [float(x) for x in rf]}, f, indent=1)


def gen_tiny_moe_gguf():
    """qwen3moe GGUF with llama.cpp's stacked expert tensors (n_expert, rows, cols) whose values
    encode their own coordinates: value = expert * 1000 + row + col / 1000 (+ 0.5 for up,
    + 0.25 for down), so per-expert views can be checked exactly (transformers' GGUF loader
    cannot be the reference here: it ignores qwen3moe.expert_feed_forward_length)."""
    import gguf
    path = os.path.join(OUT, "tiny_moe.gguf")
    hidden, heads, kv, ff, vocab, E, K, hd = 32, 2, 1, 16, 8, 4, 2, 16
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(64)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(ff)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))

    def coords(e, r, c, extra):
        return (np.arange(e)[:, None, None] * 1000 + np.arange(r)[None, :, None]
                + np.arange(c)[None, None, :] / 1000 + extra).astype(np.float32)
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((E, hidden), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", coords(E, ff, hidden, 0.0))
    w.add_tensor("blk.0.ffn_up_exps.weight", coords(E, ff, hidden, 0.5))
    w.add_tensor("blk.0.ffn_down_exps.weight", coords(E, hidden, ff, 0.25))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gen_tiny_hf_sharded():
    """A tiny random Qwen3 saved by transformers' save_pretrained in bf16, sharded (index +
    several model-0000x-of-0000y.safetensors) plus generation_config.json; references are the
    state dict's values (first 8 and the float64 sum of each tensor)."""
    import shutil
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config
    out = os.path.join(OUT, "tiny_qwen3_hf")
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(5)
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="20KB")
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 5], do_sample=False).save_pretrained(out)
    for fn in os.listdir(out):
        os.chmod(os.path.join(out, fn), 0o644)
    ref = {}
    for k, v in model.state_dict().items():
        f = v.float()
        ref[k] = {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
                  "first": [float(x) for x in f.reshape(-1)[:8]], "sum": float(f.double().sum())}
    with open(os.path.join(OUT, "tiny_qwen3_hf_refs.json"), "w") as fh:
        json.dump(ref, fh, indent=0)


def gen_config_refs():
    """How HF transformers itself reads each tests/fixtures/configs/*.json (AutoConfig):
    the effective values atomc's config parser must reproduce."""
    import glob
    import shutil
    import tempfile
    from transformers import AutoConfig
    cdir = os.path.join(OUT, "..", "configs")
    ref = {}
    for f in sorted(glob.glob(os.path.join(cdir, "*.json"))):
        name = os.path.basename(f)
        if name.startswith("transformers_parsed"):
            continue
        d = tempfile.mkdtemp()
        shutil.copy(f, os.path.join(d, "config.json"))
        c = AutoConfig.from_pretrained(d)
        shutil.rmtree(d)
        g = lambda k, default=None: getattr(c, k, default)
        rp = dict(g("rope_parameters") or {})
        if rp and all(isinstance(v, dict) for v in rp.values()):
            rp = rp.get("full_attention", next(iter(rp.values())))
        head_dim = g("head_dim") or c.hidden_size // c.num_attention_heads
        prf = rp.get("partial_rotary_factor", g("partial_rotary_factor", 1.0)) or 1.0
        experts = g("num_experts") or g("num_local_experts") or g("n_routed_experts") or 0
        eos = g("eos_token_id")
        lt = g("layer_types")
        sw = g("sliding_window") or 0
        r = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": g("num_key_value_heads") or c.num_attention_heads, "head_dim": head_dim,
             "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
             "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": bool(c.tie_word_embeddings),
             "rope_theta": float(rp.get("rope_theta", g("rope_theta", 10000.0))),
             "rope_type": rp.get("rope_type", "default"), "rope_factor": float(rp.get("factor", 1.0)),
             "rotary_dim": int(head_dim * prf),
             "bos_token_id": g("bos_token_id") if g("bos_token_id") is not None else -1,
             "eos_token_ids": (eos if isinstance(eos, list) else [eos]) if eos is not None else [],
             # Effective per-layer attention: sliding only where the layer says so and a window is set.
             "sliding_window": sw,
             "layer_types": [t if (t != "sliding_attention" or sw) else "full_attention" for t in lt]
             if lt else ["sliding_attention" if sw else "full_attention"] * c.num_hidden_layers,
             "num_experts": experts, "num_experts_per_tok": g("num_experts_per_tok") or 0 if experts else 0}
        for k in ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                  "beta_slow", "mscale", "mscale_all_dim"]:
            if k in rp:
                r[k] = float(rp[k])
        for k in ["moe_intermediate_size", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
                  "n_group", "topk_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "shared_expert_intermediate_size", "decoder_sparse_step"]:
            if g(k) is not None:
                r[k] = g(k)
        ref[name] = r
    with open(os.path.join(cdir, "transformers_parsed.json"), "w") as fh:
        json.dump(ref, fh, indent=1)


def gen_smollm2():
    import gguf
    path = os.environ.get("ATOMC_SMOLLM2", "/root/.cache/atomc/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        print(f"skipping SmolLM2 refs: {path} not found", file=sys.stderr)
        return
    r = gguf.GGUFReader(path)

    def field(k):
        f = r.fields[k]
        return f.contents()

    ref = {"metadata": {}}
    for k in ["general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
              "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
              "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.rope.dimension_count",
              "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token"]:
        ref["metadata"][k] = field(k)
    toks = field("tokenizer.ggml.tokens")
    ref["n_tokens"] = len(toks)
    ref["tokens"] = {str(i): toks[i] for i in [0, 1, 2, 17, 100, 1000, 49151]}
    types = field("tokenizer.ggml.token_type")
    ref["token_types"] = {str(i): int(types[i]) for i in [0, 1, 2, 17, 100, 49151]}
    merges = field("tokenizer.ggml.merges")
    ref["n_merges"] = len(merges)
    ref["merges"] = {str(i): merges[i] for i in [0, 1, 1000, len(merges) - 1]}
    tmpl = field("tokenizer.chat_template")
    ref["chat_template_len"] = len(tmpl.encode())
    ref["chat_template_head"] = tmpl[:60]
    ref["n_tensors"] = len(r.tensors)

    tens = {t.name: t for t in r.tensors}
    emb = tens["token_embd.weight"]
    deq = gguf.quants.dequantize(emb.data, emb.tensor_type)  # (vocab, hidden)
    ref["token_embd"] = {"type": emb.tensor_type.name, "shape": list(deq.shape),
                         "rows": {str(i): vals(deq[i]) for i in [0, 1, 2, 1000, 49151]}}
    # Raw (GGUF-order, permuted) q/k of layer 0, dequantized by the reference package.
    rows_q = [0, 1, 31, 32, 33, 63, 64, 100, 575]
    rows_k = [0, 1, 31, 32, 63, 64, 130, 191]
    cols = [0, 1, 5, 100, 575]
    raw = {}
    for nm in ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight"]:
        t = tens[nm]
        raw[nm] = gguf.quants.dequantize(t.data, t.tensor_type)
    ref["gguf_raw"] = {
        "blk.0.attn_q.weight": {str(rw): [float(raw["blk.0.attn_q.weight"][rw, c]) for c in cols] for rw in rows_q},
        "blk.0.attn_k.weight": {str(rw): [float(raw["blk.0.attn_k.weight"][rw, c]) for c in cols] for rw in rows_k},
    }

    # HF transformers' own GGUF loader (it undoes llama.cpp's permutation of q/k).
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    sd = model.state_dict()
    hf = {}
    for name, rows in [("model.layers.0.self_attn.q_proj.weight", rows_q),
                       ("model.layers.0.self_attn.k_proj.weight", rows_k),
                       ("model.layers.0.self_attn.v_proj.weight", rows_k),
                       ("model.layers.0.mlp.down_proj.weight", [0, 1, 300, 575]),
                       ("model.layers.29.self_attn.q_proj.weight", rows_q)]:
        w = sd[name].float().numpy()
        hf[name] = {"shape": list(w.shape), "cols": cols,
                    "rows": {str(rw): [float(w[rw, c]) for c in cols] for rw in rows}}
    hf["model.embed_tokens.weight"] = {"rows": {str(i): vals(sd["model.embed_tokens.weight"][i].float().numpy())[:16]
                                                for i in [0, 1000]}}
    hf["model.norm.weight"] = {"values": vals(sd["model.norm.weight"].float().numpy())[:16]}
    ref["hf"] = hf
    ref["cols"] = cols
    ref["hf_tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
    with open(os.path.join(OUT, "smollm2_refs.json"), "w") as f:
        json.dump(ref, f, indent=1)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    gen_safetensors()
    gen_gguf()
    gen_tiny_gguf()
    gen_tiny_qwen3_gguf()
    gen_tiny_llama3_rope_gguf()
    gen_tiny_moe_gguf()
    gen_tiny_hf_sharded()
    gen_config_refs()
    if "--no-smollm2" not in sys.argv:
        gen_smollm2()
    print("wrote", os.path.normpath(OUT))
