"""Prefill and decode servers of different tensor-parallel sizes (--tp-size on each role): real P, D and router
processes, a tiny random Llama (4 heads, 2 KV heads), token-id prompts, KV over tcp.

A P at TP a gathers every forward's new K/V into whole pages on its rank 0; the pages travel as at TP 1; a D at
TP b scatters a committed handoff's pages to its ranks (specpd/model/tp.py). For 1->2, 2->1 and 2->2, with no
draft and with an EAGLE chain and tree in both draft modes (the fixed policy): greedy output through the router is the
unified TP 1 engine's (plain and streamed), D reports the unified engine's verify rounds and accepted tokens
request by request, and every server's pages come back to the total.
"""
import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import (MAX_TOKENS, PROMPTS, eagle_dir, engine_args, expected, model_dir,  # noqa: F401
                                      servers, spec_flags, stream_tokens, tiny, unified_run, wait_free_pages)
from tests.disagg.test_pd_e2e import TREE

CASES = [pytest.param(1, 2, "both", TREE, id="p1-d2-eagle-tree-draft-on-both"),
         pytest.param(2, 1, "both", TREE, id="p2-d1-eagle-tree-draft-on-both"),
         pytest.param(2, 2, "decode-only", TREE, id="p2-d2-eagle-tree-draft-on-decode-only"),
         pytest.param(1, 2, "decode-only", None, id="p1-d2-eagle-chain-draft-on-decode-only"),
         pytest.param(2, 1, "both", None, id="p2-d1-eagle-chain-draft-on-both"),
         pytest.param(2, 1, None, None, id="p2-d1-no-draft")]


@pytest.mark.parametrize("p_tp,d_tp,mode,tree", CASES)
def test_p_and_d_of_different_tp_sizes_match_unified(model_dir, eagle_dir, expected, p_tp, d_tp, mode,  # noqa: F811
                                                     tree):
    boot = free_port()
    spec = spec_flags(eagle_dir, mode, tree)
    specs = [["--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port", str(boot), "--tp-size", str(p_tp),
              *engine_args(model_dir), *spec],
             ["--role", "decode", "--transfer-backend", "tcp", "--tp-size", str(d_tp), *engine_args(model_dir), *spec]]
    want_counts, _ = unified_run(model_dir, eagle_dir, mode, tree)
    with servers(specs) as (p_url, d_url):
        for url, tp in ((p_url, p_tp), (d_url, d_tp)):
            assert httpx.get(url + "/server_info").json()["runtime"]["tp_size"] == tp
        router = [["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port", str(boot)]]
        with servers(router) as [r_url], httpx.Client(base_url=r_url, timeout=60) as client:
            for prompt, want, counts in zip(PROMPTS, expected, want_counts):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                resp = client.post("/v1/completions", json={**body, "logprobs": 0})
                assert resp.status_code == 200, resp.text
                tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
                assert [int(t.removeprefix("token_id:")) for t in tokens] == want
                if mode:
                    usage = resp.json()["usage"]
                    assert (usage["spec_verify_count"], usage["spec_accepted_tokens"]) == counts
                assert stream_tokens(client, body) == want
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)


QUESTIONS = ["What is the capital of France, and what is it known for?",
             "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def default_unified():
    """The unified TP 1 engine with the shipped EAGLE-3 head (hybrid tree, pinned policy): text and acceptance."""
    from specpd.config import CacheConfig, EngineConfig, SpecConfig
    from specpd.core import SamplingParams
    from specpd.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(num_pages=64), spec=SpecConfig(
        "eagle3", draft_model="default", spec_adaptive_pinned=True)))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    return [(o.text, o.spec_verify_count, o.spec_accepted_tokens) for o in outs]


@pytest.mark.parametrize("p_tp,d_tp,mode", [(3, 1, "both"), (1, 3, "decode-only")],
                         ids=["p3-d1-draft-on-both", "p1-d3-draft-on-decode-only"])
def test_the_default_model_with_the_shipped_head_across_tp_sizes(default_unified, p_tp, d_tp, mode):
    boot = free_port()
    common = ["--model", "default", "--num-pages", "64", "--num-threads", "1", "--transfer-backend", "tcp",
              "--speculative-algorithm", "eagle3", "--draft-model", "default", "--spec-adaptive-pinned",
              "--draft-mode", mode]
    specs = [["--role", "prefill", "--bootstrap-port", str(boot), "--tp-size", str(p_tp), *common],
             ["--role", "decode", "--tp-size", str(d_tp), *common]]
    with servers(specs) as (p_url, d_url):
        router = [["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port", str(boot)]]
        with servers(router) as [r_url], httpx.Client(base_url=r_url, timeout=120) as client:
            for question, (text, verifies, accepted) in zip(QUESTIONS, default_unified):
                resp = client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0})
                assert resp.status_code == 200, resp.text
                body = resp.json()
                assert body["choices"][0]["message"]["content"] == text
                assert (body["usage"]["spec_verify_count"], body["usage"]["spec_accepted_tokens"]) == (verifies,
                                                                                                       accepted)
            assert accepted > 0
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)
