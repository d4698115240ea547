"""`--device auto` (the CLI's default): CUDA when the binary has the CUDA backend and a usable GPU
is present, else the CPU, with the choice logged. This machine (and CI) has no GPU, so both the CPU
build and the CUDA build must pick the CPU and give the same greedy tokens as `--device cpu`."""
import json
import os
import socket
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CPU_BIN = os.environ.get("ATOMC_BIN", "build/atomc")
CUDA_BIN = os.path.join(ROOT, "build-cuda", "atomc")
TINY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "llama_gqa")


def gen(binary, *args):
    out = subprocess.run([binary, "generate", "--model", TINY, "--json", "--cpu-kv-cache-gb", "0.02",
                          "--prompt-ids", "1,5,9,13", "--max-tokens", "6", "--ignore-eos", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["ids"], out.stderr


def have_gpu():
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def test_cpu_build_defaults_to_cpu():
    auto, log = gen(CPU_BIN)
    assert "device auto: cpu (this atomc was built without CUDA)" in log
    cpu, log_cpu = gen(CPU_BIN, "--device", "cpu")
    assert "device auto" not in log_cpu
    assert auto == cpu and len(auto) == 6


def test_cuda_build_without_gpu_falls_back_to_cpu():
    if have_gpu():
        pytest.skip("a GPU is present: auto picks CUDA there (the GPU tests cover it)")
    if not os.path.exists(CUDA_BIN):
        pytest.skip("build-cuda/atomc not built (make CUDA=1; scripts/test.sh builds it where nvcc exists)")
    auto, log = gen(CUDA_BIN)
    assert "device auto: cpu (no usable GPU:" in log
    cpu, _ = gen(CPU_BIN, "--device", "cpu")
    assert auto == cpu
    out = subprocess.run([CUDA_BIN, "generate", "--model", TINY, "--device", "cuda", "--prompt-ids", "1,2",
                          "--max-tokens", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no CUDA device" in out.stderr


def test_serve_defaults_to_auto():
    """`atomc serve` resolves the same default (it once defaulted to the CPU on GPU machines)."""
    for binary, want in ((CPU_BIN, "device auto: cpu (this atomc was built without CUDA)"),
                         (CUDA_BIN, "device auto: cpu (no usable GPU:" if not have_gpu() else "device auto: cuda")):
        if binary == CUDA_BIN and not os.path.exists(CUDA_BIN):
            continue
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        p = subprocess.Popen([binary, "serve", "--model", TINY, "--port", str(port), "--kv-cache-memory-bytes", "20M"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = ""
        try:
            for line in p.stdout:
                log += line
                if "model runner ready" in line or "failed" in line:
                    break
        finally:
            p.terminate()
            p.wait(timeout=60)
        assert want in log, log


def test_unknown_device_is_refused():
    out = subprocess.run([CPU_BIN, "generate", "--model", TINY, "--device", "tpu", "--prompt-ids", "1",
                          "--max-tokens", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "unknown device 'tpu'" in out.stderr
