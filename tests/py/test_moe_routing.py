"""moe_route (backend.h) against HF transformers' own router modules: DeepseekV3TopkRouter (sigmoid,
e_score_correction_bias, noaux_tc groups scored by their top-2 sum), Glm4MoeTopkRouter (the same
routing, its own class), DeepseekV2TopkRouter (softmax, greedy and group_limited_greedy: groups
scored by their max). Each router gets an identity weight, so its hidden states are the logits.

Cases: random logits, and logits / biases drawn from a few values so that exact ties occur between
experts and between groups; groups of fewer experts than top_k; top_k equal to the kept experts.
The cases with HF's chosen ids and weights go to a JSON file that build/tests/test_moe_routing
reads (ATOMC_MOE_ROUTE_CASES) and checks: the same experts with the same weights, or, where HF's
torch.topk resolved an exact tie differently (its tie order is unspecified; ours is the lower id),
a selection whose multiset of keys equals HF's at both the group and the expert level.

The committed tests/fixtures/moe_routing/hf_cases.json (what the C test reads without the
variable) is written by `python3 tests/py/test_moe_routing.py --write`; this test draws new cases.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
BUILD = os.environ.get("ATOMC_BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "tests", "test_moe_routing")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "moe_routing", "hf_cases.json")

# (router family, E, top_k, n_group, topk_group, renormalize, scale, tokens)
CONFIGS = [
    ("deepseek_v3", 256, 8, 8, 4, True, 2.5, 8),  # DeepSeek-V3 / R1 / Kimi-K2 shape
    ("glm4_moe", 160, 8, 1, 1, True, 2.5, 8),     # GLM-4.5 (ungrouped)
    ("glm4_moe", 64, 6, 8, 3, True, 1.0, 16),      # grouped GLM-style
    ("glm4_moe", 8, 3, 4, 2, True, 1.5, 24),       # groups of 2 < top_k 3
    ("deepseek_v3", 8, 4, 4, 2, False, 1.0, 24),   # top_k = kept experts, no renormalisation
    ("deepseek_v2_group", 32, 6, 8, 3, False, 16.0, 16),  # V2 group_limited_greedy (max score)
    ("deepseek_v2_group", 12, 4, 6, 3, False, 1.0, 24),   # groups of 2
    ("deepseek_v2_greedy", 64, 6, 1, 1, False, 1.0, 16),  # V2-Lite greedy
]


def make_router(family, E, k, ng, tg, renorm, scale):
    import torch

    if family in ("deepseek_v3", "glm4_moe"):
        if family == "deepseek_v3":
            from transformers import DeepseekV3Config as C
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as R
        else:
            from transformers import Glm4MoeConfig as C
            from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as R
        cfg = C(hidden_size=E, num_attention_heads=1, num_key_value_heads=1, n_routed_experts=E,
                num_experts_per_tok=k, n_group=ng, topk_group=tg, norm_topk_prob=renorm,
                routed_scaling_factor=scale)
    else:
        from transformers import DeepseekV2Config as C
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as R
        method = "group_limited_greedy" if family == "deepseek_v2_group" else "greedy"
        cfg = C(hidden_size=E, num_attention_heads=1, num_key_value_heads=1, n_routed_experts=E,
                num_experts_per_tok=k, n_group=ng, topk_group=tg, topk_method=method,
                routed_scaling_factor=scale)
    r = R(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
    return r


def f32(x):
    """x as the shortest decimal that reads back as the same float32 (the C side parses floats)."""
    import numpy as np

    return float(repr(np.float32(x)).replace("np.float32(", "").rstrip(")"))


def make_cases(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    cases = []
    for family, E, k, ng, tg, renorm, scale, T in CONFIGS:
        sigmoid = family in ("deepseek_v3", "glm4_moe")
        for ties in (False, True):
            r = make_router(family, E, k, ng, tg, renorm, scale)
            if ties:  # a few values: exact ties between experts and between groups (non-negative
                # logits and one bias: otherwise sums like sigmoid(x) + sigmoid(-x) = 1 tie in real
                # numbers but not in floats, where rounding, not a tie rule, decides)
                logits = torch.randint(0, 5, (T, E), generator=g).float() * 0.5
                bias = torch.full((E,), 0.25)
            else:
                logits = torch.randn(T, E, generator=g) * 2.0
                bias = torch.randn(E, generator=g) * 0.1
            if sigmoid:
                with torch.no_grad():
                    r.e_score_correction_bias.copy_(bias)
            with torch.no_grad():
                _, w, ids = r(logits)
            cases.append({
                "name": f"{family} E{E} k{k} g{ng}/{tg}{' ties' if ties else ''}",
                "scoring": "sigmoid" if sigmoid else "softmax",
                "group_score": "top2_sum" if sigmoid else "max",
                "num_experts": E, "top_k": k, "n_group": ng, "topk_group": tg,
                "renormalize": bool(renorm) if sigmoid else False, "scale": scale,
                "ties": ties,
                "bias": [f32(x) for x in bias] if sigmoid else None,
                "logits": [[f32(x) for x in row] for row in logits],
                "hf_ids": [[int(x) for x in row] for row in ids],
                "hf_weights": [[f32(x) for x in row] for row in w],
            })
    return cases


def run_c(path, tmp_path):
    env = dict(os.environ, ATOMC_MOE_ROUTE_CASES=str(path))
    r = subprocess.run([BIN, "moe_route_hf_cases"], capture_output=True, text=True, env=env, timeout=120)
    return r


@pytest.mark.skipif(not os.path.exists(BIN), reason="build/tests/test_moe_routing not built")
def test_moe_route_matches_hf_routers(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cases = make_cases(20261202)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps({"cases": cases}))
    r = run_c(path, tmp_path)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("hf routing cases:"))
    # "hf routing cases: C cases, N tokens, X exact, Y tie-equivalent"
    parts = line.split()
    n_tokens, exact, ties = int(parts[5]), int(parts[7]), int(parts[9])
    assert n_tokens == sum(c[-1] for c in CONFIGS) * 2
    assert exact + ties == n_tokens
    assert exact > n_tokens // 2
    assert ties > 0  # the tie cases did make torch.topk and our order disagree somewhere


@pytest.mark.skipif(not os.path.exists(BIN), reason="build/tests/test_moe_routing not built")
def test_moe_route_hf_check_can_fail(tmp_path):
    """The C comparison fails when HF's answer is perturbed (a wrong expert, a wrong weight)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cases = make_cases(7)
    c = cases[0]
    row = c["hf_ids"][0]
    row[0] = next(e for e in range(c["num_experts"]) if e not in row)
    path = tmp_path / "bad_ids.json"
    path.write_text(json.dumps({"cases": [c]}))
    assert run_c(path, tmp_path).returncode != 0
    cases = make_cases(7)
    c = cases[0]
    c["hf_weights"][1][0] *= 1.001
    path = tmp_path / "bad_w.json"
    path.write_text(json.dumps({"cases": [c]}))
    assert run_c(path, tmp_path).returncode != 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python3 tests/py/test_moe_routing.py --write  (regenerates " + FIXTURE + ")")
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    with open(FIXTURE, "w") as f:
        json.dump({"generator": "tests/py/test_moe_routing.py --write", "cases": make_cases(1)}, f,
                  separators=(",", ":"))
    print(FIXTURE, os.path.getsize(FIXTURE), "bytes")
