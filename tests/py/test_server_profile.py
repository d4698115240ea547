"""GET /tokenizer_info (vLLM's; used by remote-tokenizer clients such as lm-eval-harness) and the
profiling endpoints POST /start_profile, /stop_profile (need --profile-dir)."""
import json
import os

import pytest

from server_util import SMOLLM2, Server

pytestmark = pytest.mark.skipif(not SMOLLM2, reason="ATOMC_SMOLLM2 not set")


def test_tokenizer_info_and_profiling(tmp_path):
    srv = Server(SMOLLM2, "--max-model-len", "256", "--profile-dir", str(tmp_path / "prof"), api_key="k")
    try:
        st, info = srv.json("GET", "/tokenizer_info")
        assert st == 200
        assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
        assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 256
        st, _ = srv.json("GET", "/tokenizer_info", auth=False)
        assert st == 401
        # /tokenize of the EOS text gives one id, as a remote tokenizer needs.
        st, tok = srv.json("POST", "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
        assert st == 200 and len(tok["tokens"]) == 1

        st, body = srv.json("POST", "/stop_profile")
        assert st == 409 and "no profile is running" in body["error"]["message"]
        st, body = srv.json("POST", "/start_profile")
        assert st == 200
        st, out = srv.json("POST", "/v1/completions", {"prompt": "The sea is", "max_tokens": 4, "temperature": 0})
        assert st == 200
        st, body = srv.json("POST", "/stop_profile")
        assert st == 200
        trace = json.load(open(body["trace"]))
        names = {e["name"] for e in trace["traceEvents"]}
        assert {"step", "schedule", "prepare_inputs", "execute", "postprocess", "detokenize"} <= names
        assert os.path.dirname(body["trace"]) == str(tmp_path / "prof")
    finally:
        assert srv.stop() == 0


def test_profiling_off_without_profile_dir():
    srv = Server(SMOLLM2, "--max-model-len", "128")
    try:
        st, body = srv.json("POST", "/start_profile")
        assert st == 404 and "--profile-dir" in body["error"]["message"]
        st, _ = srv.json("GET", "/start_profile")
        assert st == 405
    finally:
        assert srv.stop() == 0
