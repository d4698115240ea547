#!/usr/bin/env python3
"""Writes tests/fixtures/tiny_eagle3: a tiny EAGLE-3 draft head for the tiny Llama target
tests/fixtures/models/llama_gqa (tools/make_tiny_models.py; used unchanged), in the published
EAGLE-3 checkpoint layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: architectures
["LlamaForCausalLMEagle3"], one decoder layer `midlayer.*`, `fc`, `norm`, `lm_head` over a draft
vocabulary, `d2t` / `t2d`, no embed_tokens: the target's serve), plus eagle3_refs.json with the
draft forward computed from HF transformers' Llama modules (LlamaRMSNorm, LlamaRotaryEmbedding,
LlamaAttention with its q/k/v projections widened to 2 hidden inputs, LlamaMLP), fp32 over the
bf16-stored weights:

    g_p     = [a_{i0}(p) ; a_{i1}(p) ; a_{i2}(p)]   a_i = the target's residual stream entering
              layer i (HF hidden_states[i]; vLLM's aux layer ids, default (2, L // 2, L - 3))
    hid     = fc(g_p)                               (chained steps: the previous step's pre-norm output)
    x       = [input_layernorm(embed(t_{p+1})) ; hidden_norm(hid)]
    h       = hid + o_proj(attention(x))            (causal over the draft layer's own positions)
    out     = h + mlp(post_attention_layernorm(h))  (pre-norm: fed to the next chained step)
    logits  = lm_head(norm(out))  over the draft vocabulary; draft = argmax d, target id d + d2t[d]

The head's weights are random, then fitted for a few hundred Adam steps to the target's own
greedy continuations of the test prompts, over two chained steps (a depth-2 "training-time test":
the second step fed the first one's pre-norm out, as the chain feeds it), so the engine tests see
first and second drafts accepted (wrong aux rows, positions, token shifts or chain inputs would
destroy the acceptance). The draft vocabulary is the
DRAFT_V target ids most frequent in those continuations (sorted, so d2t is a non-trivial
monotone offset table). The draft layer has its own rope_theta (the target's differs), which the
draft must use.

The script also checks that the reference responds to each feature the C test relies on: other
aux layer ids, no hidden_norm, the target's rope_theta and norm_before_residual each move the
logits by far more than the test's tolerance.

It also writes tests/fixtures/tiny_eagle3_speculators: the same head in RedHat's speculators
layout (architectures ["Eagle3Speculator"], the Llama part in transformer_layer_config, explicit
aux layer ids (1, 0, 2), layers.0.*, its own embed_tokens and an fc bias) with its own references.

Run (CPU, seconds):  python3 tools/make_tiny_eagle3.py [--out tests/fixtures/tiny_eagle3]
"""
import argparse
import copy
import json
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "..", "tests", "fixtures", "models", "llama_gqa")
PROMPTS = [[5, 77, 13, 200, 41], [9, 9, 120, 3, 250, 61, 17, 88, 30], list(range(40, 57)),
           [1, 100, 7, 220, 4, 4, 4, 150, 93, 12, 12, 60, 201, 33, 180, 2, 71, 71, 5, 140, 99, 8, 18, 255]]
K = 3
DRAFT_V = 64
DRAFT_ROPE_THETA = 50000.0
TRAIN_STEPS = 300
FIT_NEW = 40


class Eagle3(torch.nn.Module):
    """The EAGLE-3 head from HF's Llama modules; attribute names are the checkpoint's."""

    def __init__(self, cfg, target_hidden, draft_v, norm_before_residual=False, use_hidden_norm=True, fc_bias=False,
                 embed_tokens=None):
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.norm_before_residual = norm_before_residual
        self.use_hidden_norm = use_hidden_norm
        self.embed_tokens = embed_tokens  # None: the target's embeddings serve
        self.fc = torch.nn.Linear(3 * target_hidden, H, bias=fc_bias)
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx=0)
        hd, nh, nk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.self_attn.q_proj = torch.nn.Linear(2 * H, nh * hd, bias=False)
        self.self_attn.k_proj = torch.nn.Linear(2 * H, nk * hd, bias=False)
        self.self_attn.v_proj = torch.nn.Linear(2 * H, nk * hd, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(H, draft_v, bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds, hid, pos=None, mask=None):
        """embeds (B, T, H) of t_{p+1}, hid (B, T, H) -> (pre-norm out, draft logits); causal over
        positions 0..T-1 unless pos (B, T) and an additive mask (T, T) are given."""
        B, T, _ = hid.shape
        if pos is None:
            pos = torch.arange(T).view(1, -1).expand(B, -1)
            mask = torch.full((T, T), float("-inf")).triu(1)
        mask = mask.view(1, 1, T, T).expand(B, 1, T, T)
        hn = self.hidden_norm(hid) if self.use_hidden_norm else hid
        residual = hn if self.norm_before_residual else hid
        x = torch.cat([self.input_layernorm(embeds), hn], dim=-1)
        a, _ = self.self_attn(x, position_embeddings=self.rotary(x, pos), attention_mask=mask)
        h = residual + a
        out = h + self.mlp(self.post_attention_layernorm(h))
        return out, self.lm_head(self.norm(out))


def aux_states(model, seq, layer_ids):
    """(B, T, 3 H): the target's residual stream entering each aux layer, concatenated in order."""
    hs = model(seq, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layer_ids], dim=-1)


def bf16_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def train(model, head, gen, data, t2d, layer_ids):
    """Adam on the draft loss of two chained steps at once (a depth-2 "training-time test"): the
    first step at positions p = 0..T-1 (token t_{p+1}, fc of the aux states at p, predicting
    t_{p+2}); the second at positions q = 1..T-1 fed as the chain feeds it (token t_{q+1}, the first
    step's pre-norm out at q - 1, predicting t_{q+2}), attending to the first step's entries at
    positions < q and to itself, as a chained draft reads the head's cache."""
    emb = model.model.embed_tokens
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)

    def chain_loss(s, g):
        T = s.shape[1] - 2
        e1, h1, tgt1 = emb(s[:, 1:-1]), head.fc(g[:, :-2]), t2d[s[:, 2:]]
        out1, lg1 = head(e1, h1)
        # Second step: positions 1..T-1, inputs (t_{q+1}, out1[q-1]) appended after the first step.
        e2, h2, tgt2 = e1[:, 1:], out1[:, :-1], tgt1[:, 1:]
        pos = torch.cat([torch.arange(T), torch.arange(1, T)]).view(1, -1)
        mask = torch.full((2 * T - 1, 2 * T - 1), float("-inf"))
        mask[:T, :T] = torch.full((T, T), float("-inf")).triu(1)
        for q in range(1, T):
            mask[T + q - 1, :q] = 0
            mask[T + q - 1, T + q - 1] = 0
        _, lg = head(torch.cat([e1, e2], 1), torch.cat([h1, h2], 1), pos, mask)
        V = lg.shape[-1]
        tgt = torch.cat([tgt1, tgt2], 1)
        return torch.nn.functional.cross_entropy(lg.reshape(-1, V), tgt.reshape(-1), ignore_index=-1)

    for step in range(TRAIN_STEPS):
        loss = 0
        for i in torch.randint(0, len(data), (8,), generator=gen).tolist():
            s, g = data[i]
            loss = loss + chain_loss(s, g) / 8
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"  step {step}: loss {float(loss):.3f}", flush=True)
    print(f"EAGLE-3 fit: loss {float(loss):.3f}")


def embedder(model, head):
    return head.embed_tokens if head.embed_tokens is not None else model.model.embed_tokens


def draft_logits(model, head, ids, t_n, layer_ids):
    """Logits at every prompt position (input t_{p+1}, predicting t_{p+2}) and the pre-norm outs."""
    emb = embedder(model, head)
    g = aux_states(model, torch.tensor([ids]), layer_ids)
    toks = torch.tensor([ids[1:] + [t_n]])
    hid = head.fc(g)
    out, logits = head(emb(toks), hid)
    return hid, out, logits


def draft_config(tcfg, rope_theta):
    """The head's Llama config: the target's geometry, one layer, its own RoPE base."""
    dcfg = copy.deepcopy(tcfg)
    dcfg.num_hidden_layers = 1
    dcfg.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    return dcfg


def load_target():
    tcfg = LlamaConfig.from_pretrained(TARGET)
    tcfg._attn_implementation = "eager"
    model = LlamaForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return tcfg, model


def load_fixture(d):
    """(target model, head, d2t, aux layer ids) of a head written by this tool, fp32."""
    from safetensors import safe_open
    tcfg, model = load_target()
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    llama = cfg.get("transformer_layer_config", cfg)
    L = tcfg.num_hidden_layers
    ids = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           or cfg.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3])
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        emb = None
        if "embed_tokens.weight" in names:
            emb = torch.nn.Embedding(tcfg.vocab_size, tcfg.hidden_size)
            emb.weight.data.copy_(f.get_tensor("embed_tokens.weight").float())
        head = Eagle3(draft_config(tcfg, llama["rope_theta"]), tcfg.hidden_size, cfg["draft_vocab_size"],
                      norm_before_residual=cfg.get("norm_before_residual", False), fc_bias="fc.bias" in names,
                      embed_tokens=emb).eval()
        sd = {}
        for k in names - {"d2t", "t2d", "embed_tokens.weight"}:
            for pre in ("midlayer.", "layers.0."):
                if k.startswith(pre):
                    k2 = k[len(pre):]
                    break
            else:
                k2 = k
            sd[k2] = f.get_tensor(k).float()
        d2t = f.get_tensor("d2t")
    missing, unexpected = head.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.startswith(("rotary.", "embed_tokens.")) for k in missing), (missing, unexpected)
    return model, head, d2t, ids


def references(model, head, d2t, layer_ids):
    """Per prompt: the target's next token, the draft logits at every position, the k = 3 chain."""
    refs = []
    emb = embedder(model, head)
    with torch.no_grad():
        for ids in PROMPTS:
            n = len(ids)
            full = model.model(torch.tensor([ids])).last_hidden_state[0]
            t_n = int(model.lm_head(full[-1]).argmax())
            hid, out, logits = draft_logits(model, head, ids, t_n, layer_ids)
            # The chain: d_1 from the last prompt position, then positions n, n + 1 fed (embed(d_j),
            # the previous position's pre-norm out).
            toks, hids = ids[1:] + [t_n], hid[0]
            o, lg = out[0], logits[0]
            chain, margins = [], []
            for j in range(K):
                row = lg[n - 1 + j]
                top2 = torch.topk(row, 2).values
                d = int(row.argmax())
                chain.append(d + int(d2t[d]))
                margins.append(float(top2[0] - top2[1]))
                if j + 1 < K:
                    toks = toks + [chain[-1]]
                    hids = torch.cat([hids, o[n - 1 + j].view(1, -1)], 0)
                    o, lg = head(emb(torch.tensor([toks])), hids.view(1, len(toks), -1))
                    o, lg = o[0], lg[0]
            refs.append(dict(ids=ids, target_next=t_n, draft_logits=[[round(float(v), 6) for v in r] for r in logits[0]],
                             chain=chain, chain_margins=margins))
    return refs


def write_refs(d, layer_ids, d2t, refs, **extra):
    with open(os.path.join(d, "eagle3_refs.json"), "w") as f:
        json.dump(dict(target="models/llama_gqa", generator="tools/make_tiny_eagle3.py", aux_layer_ids=layer_ids,
                       draft_vocab_size=DRAFT_V, d2t=d2t.tolist(), k=K, **extra, prompts=refs), f)


def main():
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "tiny_eagle3"))
    a = ap.parse_args()
    tcfg, model = load_target()
    for p in model.parameters():
        p.requires_grad_(False)
    L, H, V = tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.vocab_size
    layer_ids = [2, L // 2, L - 3]  # vLLM's default for Llama targets; the config below leaves it implicit
    dcfg = draft_config(tcfg, DRAFT_ROPE_THETA)
    gen = torch.Generator().manual_seed(4242)
    with open(os.path.join(TARGET, "refs.json")) as f:
        fit = [p["ids"] for p in json.load(f)["prompts"] if len(p["ids"]) > 1] + PROMPTS
    fit += torch.randint(0, V, (24, 7), generator=gen).tolist()
    data, counts = [], torch.zeros(V)
    with torch.no_grad():
        for p in fit:
            ids = torch.tensor([p])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=FIT_NEW,
                                 min_new_tokens=FIT_NEW, pad_token_id=0)
            data.append((seq, aux_states(model, seq, layer_ids)))
            counts += torch.bincount(seq[0, 2:], minlength=V).float()
    draft_ids = sorted(torch.argsort(counts, descending=True, stable=True)[:DRAFT_V].tolist())
    d2t = torch.tensor(draft_ids) - torch.arange(DRAFT_V)
    t2d_idx = torch.full((V,), -1, dtype=torch.long)
    t2d_idx[torch.tensor(draft_ids)] = torch.arange(DRAFT_V)
    print(f"draft vocabulary: {DRAFT_V} of {V} target ids cover {float(counts[draft_ids].sum() / counts.sum()):.2f} "
          f"of the fit continuations' tokens")

    head = Eagle3(dcfg, H, DRAFT_V).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5))
    train(model, head, gen, data, t2d_idx, layer_ids)
    bf16_(head)

    refs = references(model, head, d2t, layer_ids)
    with torch.no_grad():
        # The reference must respond to every feature the C test relies on.
        ids = PROMPTS[3]
        t_n = refs[3]["target_next"]
        base = draft_logits(model, head, ids, t_n, layer_ids)[2]
        scale = float(base.abs().max())
        moved = {}
        moved["aux_layer_ids (0, 1, 2)"] = draft_logits(model, head, ids, t_n, [0, 1, 2])[2]
        head.use_hidden_norm = False
        moved["no hidden_norm"] = draft_logits(model, head, ids, t_n, layer_ids)[2]
        head.use_hidden_norm = True
        head.norm_before_residual = True
        moved["norm_before_residual"] = draft_logits(model, head, ids, t_n, layer_ids)[2]
        head.norm_before_residual = False
        rot = head.rotary
        head.rotary = LlamaRotaryEmbedding(tcfg)
        moved["the target's rope_theta"] = draft_logits(model, head, ids, t_n, layer_ids)[2]
        head.rotary = rot
        sens = {}
        for k, v in moved.items():
            d = float((v - base).abs().max())
            sens[k] = d
            print(f"  reference with {k}: logits move by {d:.3g} (scale {scale:.3g})")
            assert d > 1e-2 * scale, k  # the C test's tolerance is 1e-4 of the scale

    os.makedirs(a.out, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": dcfg.intermediate_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": DRAFT_ROPE_THETA,
        "rope_scaling": None,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "vocab_size": V,
        "draft_vocab_size": DRAFT_V,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    sd = head.state_dict()
    tensors = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for k, v in sd.items():
        if k.split(".")[0] in ("input_layernorm", "hidden_norm", "self_attn", "post_attention_layernorm", "mlp"):
            tensors["midlayer." + k] = v
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    tensors["d2t"] = d2t.to(torch.int64)
    tensors["t2d"] = t2d_idx >= 0
    save_file(tensors, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    write_refs(a.out, layer_ids, d2t, refs, sensitivity=sens)
    print("wrote", a.out)

    # The same head in RedHat's speculators layout (Eagle3Speculator): the Llama part in
    # transformer_layer_config, explicit aux layer ids at the top level (another order than the
    # default, so the ids are read), the layer as layers.0.*, its own embed_tokens (the target's,
    # rounded to bf16) and an fc bias (small, random), so its references differ from the head's.
    spec_ids = [1, 0, 2]
    with torch.no_grad():
        head.fc = torch.nn.Linear(3 * H, H, bias=True)
        head.fc.weight.copy_(sd["fc.weight"])
        head.fc.bias.copy_((0.3 * torch.randn(H, generator=gen)).to(torch.bfloat16).float())
        head.embed_tokens = torch.nn.Embedding(V, H)
        head.embed_tokens.weight.copy_(model.model.embed_tokens.weight.to(torch.bfloat16).float())
    refs = references(model, head, d2t, spec_ids)
    out = os.path.join(os.path.dirname(os.path.abspath(a.out)), os.path.basename(os.path.abspath(a.out)) + "_speculators")
    os.makedirs(out, exist_ok=True)
    llama = {k: v for k, v in cfg.items() if k not in ("architectures", "draft_vocab_size", "torch_dtype")}
    scfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama,
        "draft_vocab_size": DRAFT_V,
        "norm_before_residual": False,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": spec_ids,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}],
                               "verifier": {"name_or_path": "tests/fixtures/models/llama_gqa",
                                            "architectures": ["LlamaForCausalLM"]}},
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(scfg, f, indent=2)
    sd2 = head.state_dict()
    st = {"fc.weight": sd2["fc.weight"], "fc.bias": sd2["fc.bias"], "norm.weight": sd2["norm.weight"],
          "lm_head.weight": sd2["lm_head.weight"], "embed_tokens.weight": sd2["embed_tokens.weight"]}
    for k, v in sd2.items():
        if k.split(".")[0] in ("input_layernorm", "hidden_norm", "self_attn", "post_attention_layernorm", "mlp"):
            st["layers.0." + k] = v
    st = {k: v.to(torch.bfloat16).contiguous() for k, v in st.items()}
    st["d2t"] = d2t.to(torch.int64)
    st["t2d"] = t2d_idx >= 0
    save_file(st, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_refs(out, spec_ids, d2t, refs)
    print("wrote", out)


if __name__ == "__main__":
    main()
