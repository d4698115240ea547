#!/usr/bin/env python3
"""Writes tests/fixtures/models/deepseek_v3_mtp and glm4_moe_mtp: the tiny DeepSeek-V3 fixture of
tools/make_tiny_deepseek.py / the GLM-4-MoE fixture of tools/make_tiny_glm_mimo.py (config and
target weights copied unchanged; glm4_moe's partial MTP layer dropped) plus one random
multi-token-prediction layer, model.layers.3.* in the checkpoints' MTP layout (enorm, hnorm,
eh_proj, the family's decoder layer (DeepSeek: MLA + noaux_tc MoE with a shared expert; GLM: GQA
with biases, q/k norm, partial rotary + the same MoE kind), shared_head.norm; deepseek_v3_mtp has
no shared_head.head / embed_tokens (the target's serve, as for checkpoints that omit them),
glm4_moe_mtp has byte-identical copies of the target's (as DeepSeek-V3 ships them)), fitted for a few hundred Adam steps to the target's own greedy
continuations (so drafts are accepted at a realistic rate), and mtp_refs.json with the MTP forward computed from HF's own
modules (DeepseekV3DecoderLayer / Glm4MoeDecoderLayer, their RMSNorm, the model's rotary embedding), fp32 over
the bf16-stored weights:

    h_p    = the target's final hidden state (HF last_hidden_state, after model.norm)
    x      = eh_proj [enorm(embed(t_{p+1})) ; hnorm(h_p)]
    out    = DeepseekV3DecoderLayer_3(x) over positions 0.. (causal), logits = lm_head(shared_head.norm(out))
    chain  = d_1 = argmax at the prompt's last position (t_{n} = the target's greedy token), then
             d_j = argmax of the layer at position n + j - 2 fed (embed(d_{j-1}), out of the
             previous position), for k = 3 drafts

(vLLM's DeepSeekMultiTokenPredictorLayer / SGLang's deepseek_nextn compute this; transformers has
no MTP module.) refs per prompt: MTP logits at every position (input token t_{p+1}, predicting
t_{p+2}), the chained drafts with their top-2 margins, and the MTP MoE's smallest routing gap
(seeds are tried until it is >= 1e-3 in biased-sigmoid units, clear of fp32 noise).

Run (CPU, seconds):  python3 tools/make_tiny_mtp.py [--out tests/fixtures/models]
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_deepseek import select  # noqa: E402

PROMPTS = [[5, 77, 13, 200, 41], [9, 9, 120, 3, 250, 61, 17, 88, 30], list(range(40, 57)),
           [1, 100, 7, 220, 4, 4, 4, 150, 93, 12, 12, 60, 201, 33, 180, 2, 71, 71, 5, 140, 99, 8, 18, 255]]
K = 3
# target fixture -> (config, model, decoder layer and RMSNorm classes of its MTP layer)
ARCHS = {"deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3DecoderLayer, DeepseekV3RMSNorm),
         "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeDecoderLayer, Glm4MoeRMSNorm)}
TRAIN_STEPS = 250
FIT_NEW = 40  # greedy tokens of each fit sequence (the tests generate at most 24)


class MTP(torch.nn.Module):
    def __init__(self, arch, cfg, layer_idx):
        super().__init__()
        H = cfg.hidden_size
        Layer, Norm = ARCHS[arch][2], ARCHS[arch][3]
        self.enorm = Norm(H, eps=cfg.rms_norm_eps)
        self.hnorm = Norm(H, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.layer = Layer(cfg, layer_idx)
        self.head_norm = Norm(H, eps=cfg.rms_norm_eps)


def bf16_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for b in module.buffers():
            if b.is_floating_point():
                b.copy_(b.to(torch.bfloat16).float())


def mtp_forward_batch(model, mtp, ids, hidden):
    """out (B, T, H) and logits (B, T, V) of the MTP layer over positions 0..T-1 (causal), inputs
    ids (B, T) = t_{p+1} and hidden (B, T, H) = h_p."""
    B, T = ids.shape
    pos = torch.arange(T).view(1, -1).expand(B, -1)
    e = model.model.embed_tokens(ids)
    x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden)], dim=-1))
    cos_sin = model.model.rotary_emb(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1).view(1, 1, T, T).expand(B, 1, T, T)
    out = mtp.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    return out, model.lm_head(mtp.head_norm(out))


def mtp_forward(model, mtp, tokens, hidden):
    out, logits = mtp_forward_batch(model, mtp, torch.tensor([tokens]), hidden.view(1, len(tokens), -1))
    return out[0], logits[0]


def train(model, mtp, gen, prompts, steps=TRAIN_STEPS):
    """A short fit of the MTP layer to the target's own greedy continuations of `prompts` (what a
    real MTP layer is trained for: token p + 2 from h_p and t_{p+1}). A random tiny target is not
    predictable beyond what the layer memorises, so the fit data are the test prompts' own
    continuations (plus random prompts): on them drafts must be accepted at a high rate, which the
    engine tests check end to end (wrong hidden rows, positions or token shifts would destroy it).
    The reference is computed after the fit, on the rounded weights."""
    V = model.config.vocab_size
    data = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=FIT_NEW,
                                 min_new_tokens=FIT_NEW, pad_token_id=0)
            data.append((seq, model.model(seq).last_hidden_state))
    opt = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    for step in range(steps):
        loss = 0
        for i in torch.randint(0, len(data), (8,), generator=gen).tolist():
            s, h = data[i]
            _, logits = mtp_forward_batch(model, mtp, s[:, 1:-1], h[:, :-2])
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, V), s[:, 2:].reshape(-1)) / 8
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"  step {step}: loss {float(loss):.3f}", flush=True)
    with torch.no_grad():
        acc = n = 0
        for s, h in data:
            _, logits = mtp_forward_batch(model, mtp, s[:, 1:-1], h[:, :-2])
            acc += int((logits.argmax(-1) == s[:, 2:]).sum())
            n += s.shape[1] - 2
    print(f"MTP fit: loss {float(loss):.3f}, next-next-token accuracy on the fit data {acc / n:.2f}")


def load_fixture(d, arch="deepseek_v3"):
    """(target model, MTP module) of a fixture written by this tool, fp32."""
    Config, Model = ARCHS[arch][:2]
    cfg = Config.from_pretrained(d)
    cfg._attn_implementation = "eager"
    model = Model.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager").eval()
    mtp = MTP(arch, cfg, cfg.num_hidden_layers).eval()
    pre, E = f"model.layers.{cfg.num_hidden_layers}.", cfg.n_routed_experts
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        get = lambda n: f.get_tensor(pre + n).float()  # noqa: E731
        sd = {}
        for k in mtp.state_dict():
            if not k.startswith("layer.mlp.experts."):
                sd[k] = get({"head_norm.weight": "shared_head.norm.weight"}.get(k, k[6:] if k.startswith("layer.") else k))
        sd["layer.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([get(f"mlp.experts.{e}.gate_proj.weight"), get(f"mlp.experts.{e}.up_proj.weight")]) for e in range(E)])
        sd["layer.mlp.experts.down_proj"] = torch.stack([get(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    mtp.load_state_dict(sd)
    return model, mtp


def routing_gap(mtp, record):
    gap = 1e9
    for x in record:
        logits = torch.nn.functional.linear(x.view(-1, x.shape[-1]).float(), mtp.layer.mlp.gate.weight.float())
        gap = min(gap, select(mtp.layer.mlp.gate, logits)[1])
    return gap


def build(arch, src, seed):
    Config, Model = ARCHS[arch][:2]
    cfg = Config.from_pretrained(src)
    cfg._attn_implementation = "eager"
    model = Model.from_pretrained(src, torch_dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    L = cfg.num_hidden_layers
    mtp = MTP(arch, cfg, L).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5))
        mtp.layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts, generator=gen))
    for p in model.parameters():
        p.requires_grad_(False)
    with open(os.path.join(src, "refs.json")) as f:
        fit = [p["ids"] for p in json.load(f)["prompts"]] + PROMPTS
    fit += torch.randint(0, cfg.vocab_size, (24, 7), generator=gen).tolist()
    train(model, mtp, gen, fit)
    bf16_(mtp)
    record = []
    hook = mtp.layer.mlp.gate.register_forward_hook(lambda m, i, o: record.append(i[0].detach()))
    refs = []
    with torch.no_grad():
        for ids in PROMPTS:
            n = len(ids)
            full = model.model(torch.tensor([ids])).last_hidden_state[0]
            t_n = int(model.lm_head(full[-1]).argmax())
            tokens = ids[1:] + [t_n]
            hidden = full
            out, logits = mtp_forward(model, mtp, tokens, hidden)
            chain, margins = [], []
            for j in range(K):
                row = logits[n - 1 + j]
                top2 = torch.topk(row, 2).values
                d = int(row.argmax())
                chain.append(d)
                margins.append(float(top2[0] - top2[1]))
                if j + 1 < K:
                    tokens = tokens + [d]
                    hidden = torch.cat([hidden, out[n - 1 + j].view(1, -1)], 0)
                    out, logits = mtp_forward(model, mtp, tokens, hidden)
            _, l0 = mtp_forward(model, mtp, ids[1:] + [t_n], full)
            refs.append(dict(ids=ids, target_next=t_n, mtp_logits=[[round(float(v), 6) for v in r] for r in l0],
                             chain=chain, chain_margins=margins))
    hook.remove()
    return cfg, model, mtp, refs, routing_gap(mtp, record)


def main():
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    ap.add_argument("--model", choices=sorted(ARCHS), action="append", help="target fixture(s); default all")
    a = ap.parse_args()
    for arch in a.model or sorted(ARCHS):
        write(arch, a.out)


def write(arch, out):
    src = os.path.join(out, arch)
    for seed in range(100):
        cfg, model, mtp, refs, gap = build(arch, src, 1000 + seed)
        if gap >= 1e-3:
            break
    print(f"{arch}: seed {1000 + seed}: MTP routing gap {gap:.4g}")
    d = os.path.join(out, arch + "_mtp")
    os.makedirs(d, exist_ok=True)
    for f in ("config.json", "generation_config.json", "refs.json"):  # refs.json: the target's, unchanged
        shutil.copy(os.path.join(src, f), os.path.join(d, f))
    tensors = {}
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        L = cfg.num_hidden_layers
        for k in f.keys():
            if not k.startswith(f"model.layers.{L}."):  # glm4_moe carries a partial MTP layer: replaced
                tensors[k] = f.get_tensor(k)
    I = cfg.moe_intermediate_size
    pre = f"model.layers.{L}."
    sd = mtp.state_dict()
    for k, v in sd.items():
        if k.startswith("layer.mlp.experts."):
            continue
        name = {"head_norm.weight": "shared_head.norm.weight"}.get(k, k[len("layer."):] if k.startswith("layer.") else k)
        tensors[pre + name] = v.to(torch.bfloat16).contiguous()
    gu, dn = sd["layer.mlp.experts.gate_up_proj"], sd["layer.mlp.experts.down_proj"]
    for e in range(cfg.n_routed_experts):
        tensors[pre + f"mlp.experts.{e}.gate_proj.weight"] = gu[e, :I].to(torch.bfloat16).contiguous()
        tensors[pre + f"mlp.experts.{e}.up_proj.weight"] = gu[e, I:].to(torch.bfloat16).contiguous()
        tensors[pre + f"mlp.experts.{e}.down_proj.weight"] = dn[e].to(torch.bfloat16).contiguous()
    if arch == "glm4_moe":  # byte-identical copies of the target's, as DeepSeek-V3 ships them (not loaded twice)
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "mtp_refs.json"), "w") as f:
        json.dump(dict(model=arch + "_mtp", generator="tools/make_tiny_mtp.py", seed=1000 + seed,
                       mtp_routing_min_gap=gap, k=K, prompts=refs), f)
    print("wrote", d)


if __name__ == "__main__":
    main()
