"""The server with speculative decoding: usage carries acceptance, /metrics exports it, output is lossless."""
import json

import pytest

from specpd.config import CacheConfig, EngineConfig, ModelConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.server.launcher import launch_server

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("default")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    draft_dir = tmp_path_factory.mktemp("draft")
    random_draft_checkpoint(str(draft_dir), "eagle", ModelConfig.from_hf(checkpoint.hf_config), seed=0)
    with launch_server(["--model", "default", "--max-model-len", "1024", "--kv-cache-memory-mb", "64",
                        "--speculative-algorithm", "eagle", "--draft-model", str(draft_dir),
                        "--spec-num-steps", "3", "--spec-topk", "2", "--spec-num-draft-tokens", "5",
                        "--spec-adaptive-pinned",  # a fixed cost table: the first rounds speculate on any box
                        "--log-level", "warning"]) as srv:
        yield srv


def test_greedy_is_lossless_and_usage_reports_acceptance(server, checkpoint):
    client = server["client"]
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                "ignore_eos": True}).json()
    usage = body["usage"]
    assert usage["spec_verify_count"] >= 1
    assert usage["spec_accept_length"] >= 1.0
    assert usage["spec_accepted_tokens"] >= 0
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(num_pages=32)), checkpoint=checkpoint)
    ref = engine.generate([checkpoint.tokenizer.encode(PROMPT)],
                          SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert body["choices"][0]["text"] == ref.text


def test_metrics_and_server_info_export_acceptance(server):
    client = server["client"]
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    metrics = client.get("/metrics").text
    assert "specpd:spec_accept_length_bucket" in metrics
    assert "specpd:spec_accepted_tokens_per_position" in metrics
    assert "specpd:spec_draft_tokens_per_round_bucket" in metrics  # adaptive speculation (on by default)
    assert "specpd:spec_rounds_off_total" in metrics and "specpd:spec_rounds_narrow_total" in metrics
    info = client.get("/server_info").json()
    assert 0 <= info["spec_rounds_narrow"] <= info["spec_rounds"] - info["spec_rounds_off"]
    assert set(info["spec_policy"]) == {"cost_scale", "draft_scale", "accept", "prior", "top_path_share", "cost_model"}
    assert len(info["spec_policy"]["prior"]) == len(info["spec_policy"]["accept"])
    assert info["spec_policy"]["cost_model"]["target_rows"] and info["spec_probes"] >= 0
    assert info["spec_verify_count"] >= 1
    assert info["spec_rounds"] >= info["spec_verify_count"] and sum(info["spec_draft_tokens_hist"]) == info["spec_rounds"]
    assert info["free_pages"] == info["total_pages"]
    # what is in force: an EAGLE-family head merges n-grams in by default
    assert info["speculative"] == {"algorithm": "eagle", "hybrid": True, "num_steps": 3, "topk": 2,
                                   "num_draft_tokens": 5}


def test_streaming_with_speculation(server):
    client = server["client"]
    text, usage = "", None
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0.8,
                                                        "seed": 5, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage["completion_tokens"] >= 1 and usage["spec_verify_count"] >= 1 and text
    info = client.get("/server_info").json()
    assert info["free_pages"] == info["total_pages"]


def test_prefix_cache_usage_metrics_and_flush(server):
    """A second chat sharing a long system prompt reports OpenAI's cached_tokens; /flush_cache empties it."""
    client = server["client"]
    system = "You answer questions about the solar system in one short sentence. " * 6
    outs = []
    for q in ("How many moons does Mars have?", "Which planet is largest?"):
        body = client.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": 6, "temperature": 0}).json()
        outs.append(body["usage"])
    assert outs[0]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = outs[1]["prompt_tokens_details"]["cached_tokens"]
    assert 64 <= cached < outs[1]["prompt_tokens"], outs
    metrics = client.get("/metrics").text
    hits = [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("specpd:prefix_cache_hit_tokens{")]
    assert hits and hits[0] >= cached
    info = client.get("/server_info").json()
    assert info["cached_pages"] > 0 and info["free_pages"] == info["total_pages"]
    flushed = client.post("/flush_cache").json()
    assert flushed["flushed_pages"] == info["cached_pages"] and flushed["free_pages"] == info["total_pages"]
    assert client.get("/server_info").json()["cached_pages"] == 0
