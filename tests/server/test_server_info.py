"""/server_info in SGLang's shape over a real `specpd serve` (SmolLM2-135M with its shipped EAGLE-3 head).

SGLang's benchmark client (sglang.benchmark.serving, formerly sglang/bench_serving.py) reads the acceptance
length after a run like this (`sglang_accept_length` replays it): GET {base}/server_info; if the body has
"decode" (a PD router), take body["decode"][0]; then body["internal_states"][0]["avg_spec_accept_length"],
and print "Accept length:" when it is truthy. Where SGLang's client is installed, it is also run for real.
"""
import importlib.util
import os
import subprocess
import sys

import httpx
import pytest

from tests.server.launcher import launch_server

HERE = os.path.dirname(os.path.abspath(__file__))


def sglang_accept_length(base: str) -> float | None:
    """What SGLang's bench client would print as "Accept length:" for the server at `base`."""
    resp = httpx.get(base + "/server_info")
    if resp.status_code != 200:
        return None
    info = resp.json()
    if "decode" in info:
        info = info["decode"][0]
    if "internal_states" in info and info["internal_states"]:
        return info["internal_states"][0].get("avg_spec_accept_length", None)
    return None


@pytest.fixture(scope="module")
def server():
    with launch_server(["--model", "default", "--max-model-len", "1024", "--kv-cache-memory-mb", "64",
                        "--speculative-algorithm", "eagle3", "--draft-model", "default", "--spec-num-steps", "3",
                        "--no-spec-adaptive", "--log-level", "warning"]) as srv:
        yield srv


def test_internal_states_carry_tau(server):
    client = server["client"]
    info = client.get("/server_info").json()
    assert info["internal_states"] == [{"avg_spec_accept_length": None, "spec_verify_count": 0}]
    assert sglang_accept_length(server["base"]) is None  # nothing verified yet: SGLang prints no line
    resp = client.post("/v1/completions", json={"prompt": "def fibonacci(n):", "max_tokens": 24,
                                                "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        [state] = info["internal_states"]
        # engine-wide tau = (accepted + bonus per verify) / verify forwards; one request so far: its own
        assert state["spec_verify_count"] == info["spec_verify_count"] == usage["spec_verify_count"] >= 1
        tau = (info["spec_accepted_tokens"] + info["spec_verify_count"]) / info["spec_verify_count"]
        assert state["avg_spec_accept_length"] == pytest.approx(tau) == pytest.approx(info["spec_accept_length"])
        assert 1.0 <= tau <= 4.0
    assert sglang_accept_length(server["base"]) == pytest.approx(tau)
    assert info["free_pages"] == info["total_pages"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang's client is not installed")
def test_sglang_bench_client_prints_the_accept_length(server, tmp_path):
    """SGLang's own client, unmodified (sglang_bench_client.py stubs only its server-side imports)."""
    from transformers import PreTrainedTokenizerFast

    from specpd.model.loader import load_checkpoint
    tok_dir = str(tmp_path / "tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=load_checkpoint("default").tokenizer.backend).save_pretrained(tok_dir)
    cmd = [sys.executable, os.path.join(HERE, "sglang_bench_client.py"), "--backend", "sglang-oai",
           "--base-url", server["base"], "--model", server["model"], "--tokenizer", tok_dir,
           "--dataset-name", "random-ids", "--random-input-len", "32", "--random-output-len", "16",
           "--num-prompts", "3", "--disable-tqdm", "--warmup-requests", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("Accept length:")]
    assert float(line.split()[-1]) == pytest.approx(sglang_accept_length(server["base"]), abs=0.005)
