"""Model ids from the local Hugging Face cache (`--model ORG/NAME`, as vLLM users type it).

A cache laid out the way huggingface_hub writes it (hub/models--ORG--NAME/{refs/main, snapshots/REV/
with symlinks into blobs/}) is built in a temporary directory from a committed tiny fixture; the id
must give the same greedy tokens as the directory itself, under HF_HUB_CACHE, HF_HOME and the
default ~/.cache/huggingface/hub; a missing id lists where it looked."""
import json
import os
import shutil
import subprocess

import pytest

from server_util import SMOLLM2, Server

ATOMC = os.environ.get("ATOMC_BIN", "build/atomc")
TINY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa"))
REV = "0123456789abcdef0123456789abcdef01234567"


def make_cache(hub, org="tiny-org", name="tiny-llama", with_ref=True):
    repo = os.path.join(hub, f"models--{org}--{name}")
    blobs, snap = os.path.join(repo, "blobs"), os.path.join(repo, "snapshots", REV)
    os.makedirs(blobs)
    os.makedirs(snap)
    for i, f in enumerate(sorted(os.listdir(TINY))):
        blob = os.path.join(blobs, f"blob{i}")
        shutil.copy(os.path.join(TINY, f), blob)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, f))
    if with_ref:
        os.makedirs(os.path.join(repo, "refs"))
        with open(os.path.join(repo, "refs", "main"), "w") as fh:
            fh.write(REV)
    return f"{org}/{name}"


def clean_env(**kw):
    e = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    e.update(kw)
    return e


def gen(model, env):
    out = subprocess.run([ATOMC, "generate", "--model", model, "--json", "--cpu-kv-cache-gb", "0.02",
                          "--prompt-ids", "1,5,9,13", "--max-tokens", "6", "--ignore-eos"],
                         capture_output=True, text=True, timeout=120, env=env)
    return out


def test_repo_id_resolves_under_each_cache_variable(tmp_path):
    ref = gen(TINY, clean_env())
    assert ref.returncode == 0, ref.stderr
    ids = json.loads(ref.stdout)["ids"]
    hub = tmp_path / "hubcache"
    rid = make_cache(str(hub))
    for env in (clean_env(HF_HUB_CACHE=str(hub)),
                clean_env(HF_HOME=str(tmp_path / "home_hf"), HF_HUB_CACHE=str(hub)),  # HF_HUB_CACHE wins
                clean_env(HOME=str(tmp_path / "home"))):
        if "HOME" in env and env["HOME"] == str(tmp_path / "home"):
            os.makedirs(tmp_path / "home" / ".cache" / "huggingface", exist_ok=True)
            if not os.path.exists(tmp_path / "home" / ".cache" / "huggingface" / "hub"):
                os.symlink(hub, tmp_path / "home" / ".cache" / "huggingface" / "hub")
        out = gen(rid, env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["ids"] == ids
        assert f"snapshots/{REV}" in out.stderr  # the resolution is logged
    hf_home = tmp_path / "hfhome"
    rid2 = make_cache(str(hf_home / "hub"), name="other", with_ref=False)  # no refs/main: the snapshot
    out = gen(rid2, clean_env(HF_HOME=str(hf_home)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ids"] == ids


def test_bench_serve_model_is_a_name_not_a_path(tmp_path):
    # `bench serve --model ORG/NAME` names the served model in requests; it must not be looked up.
    out = subprocess.run([ATOMC, "bench", "serve", "--model", "nobody/nothing", "--port", "1", "--num-prompts", "1",
                          "--random-vocab-size", "1000", "--disable-tqdm"], capture_output=True, text=True,
                         timeout=60, env=clean_env(HF_HUB_CACHE=str(tmp_path)))
    assert "Hugging Face cache" not in out.stderr and "every request failed" in out.stderr


def test_missing_id_says_where_it_looked(tmp_path):
    out = gen("nobody/nothing", clean_env(HF_HUB_CACHE=str(tmp_path)))
    assert out.returncode != 0
    assert f"{tmp_path}/models--nobody--nothing" in out.stderr and "HF_HUB_CACHE" in out.stderr
    assert "does not download" in out.stderr
    # An empty repo directory (interrupted download) is its own error.
    os.makedirs(tmp_path / "models--nobody--empty")
    out = gen("nobody/empty", clean_env(HF_HUB_CACHE=str(tmp_path)))
    assert out.returncode != 0 and "no snapshot" in out.stderr


def test_serve_names_the_model_after_the_id(tmp_path):
    # A GGUF repo (no config.json): the id resolves to its one .gguf file; serve names the model by the id.
    if not SMOLLM2:
        pytest.skip("set ATOMC_SMOLLM2 to the SmolLM2-135M-Instruct GGUF")
    snap = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF" / "snapshots" / REV
    os.makedirs(snap)
    os.symlink(os.path.abspath(SMOLLM2), snap / "smollm2.gguf")
    rid = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    s = Server(rid, "--max-model-len", "512", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    try:
        status, body = s.json("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == [rid]
        status, body = s.json("POST", "/v1/completions", {"model": rid, "prompt": "The capital of France is",
                                                           "max_tokens": 3, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
    finally:
        s.stop()
    # Two .gguf files and no config.json: ambiguous, refused with the count.
    os.symlink(os.path.abspath(SMOLLM2), snap / "second.gguf")
    out = subprocess.run([ATOMC, "generate", "--model", rid, "--prompt", "x", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=60, env=clean_env(HF_HUB_CACHE=str(tmp_path / "hub")))
    assert out.returncode != 0 and "2 .gguf files" in out.stderr
