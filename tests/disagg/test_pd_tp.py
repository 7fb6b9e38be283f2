"""Prefill and decode servers of different tensor-parallel sizes (--tp-size on each role): real P, D and router
processes, a tiny random Llama (4 heads, 2 KV heads), token-id prompts, KV over tcp.

Every rank of P writes its KV heads straight into the D ranks holding them, one descriptor per page and
overlapping head range (specpd/disagg/kv_layout.py, kv_sender.py). For 1->2, 2->1 and 2->2, with no
draft and with an EAGLE tree in both draft modes (the fixed policy): greedy output through the router is the
unified TP 1 engine's (plain and streamed), D reports the unified engine's verify rounds and accepted tokens
request by request, and every server's pages come back to the total.
"""
import concurrent.futures
import time

import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import (MAX_TOKENS, PROMPTS, eagle_dir, engine_args, expected, model_dir,  # noqa: F401
                                      servers, spec_flags, stream_tokens, tiny, unified_run, wait_free_pages)
from tests.disagg.test_pd_e2e import TREE

# (an EAGLE chain across TP sizes adds nothing the tree does not: the layouts are the tree's, and chains in both modes
# are test_pd_e2e's at TP 1; each case here costs ~15 s of a 2-core CI)
CASES = [pytest.param(1, 2, "both", TREE, id="p1-d2-eagle-tree-draft-on-both"),
         pytest.param(2, 1, "both", TREE, id="p2-d1-eagle-tree-draft-on-both"),
         pytest.param(2, 2, "decode-only", TREE, id="p2-d2-eagle-tree-draft-on-decode-only"),
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


def test_a_write_failing_on_one_p_rank_fails_the_room_and_leaks_nothing(model_dir, expected):  # noqa: F811
    """P at TP 2 (in process: rank 0's backend fails its writes, rank 1 writes for real) into a D at TP 2: each P
    rank writes its own head range into the D rank holding it, one descriptor per page; rank 0's failure fails
    the room on P and D (after rank 1's write ended), every page comes back on both, and with the writes working
    again the next room's output is the unified engine's."""
    from specpd.config import CacheConfig, EngineConfig
    from specpd.core import SamplingParams
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.transfer import TransferError
    from specpd.disagg.worker import BootstrapInfo
    from specpd.engine.llm_engine import LLMEngine
    from tests.disagg.test_pd_stream import body

    boot = free_port()
    with servers([["--role", "decode", "--transfer-backend", "tcp", "--tp-size", "2", *engine_args(model_dir)]]) \
            as (d_url,):
        engine = LLMEngine(EngineConfig(model=model_dir, tp_size=2, num_threads=1,
                                        cache=CacheConfig(page_size=4, num_pages=128)), pd_role="prefill")
        worker = PrefillWorker(engine, "tcp", bootstrap_port=boot, optimistic_prefill=False)
        write, failing = worker.backend._write, [True]

        def rank0_write(*args):
            if failing[0]:
                raise TransferError("tcp: injected failure on rank 0")
            write(*args)

        worker.backend._write = rank0_write
        try:
            assert [ep.rank for ep in worker.kv.endpoints] == [0, 1]
            for room, (prompt, want) in enumerate(zip(PROMPTS[:2], expected[:2]), start=1):
                # logprobs: y0's travels in the record, so that D's answer lists it
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
                rid = f"r{room}"
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    worker.expect(rid, BootstrapInfo("127.0.0.1", boot, room))
                    worker.add_request(rid, prompt, params)
                    resp = pool.submit(httpx.post, d_url + "/v1/completions",
                                       json={**body(prompt, boot, room), "max_tokens": MAX_TOKENS}, timeout=60)
                    final, deadline = None, time.monotonic() + 30
                    while final is None and time.monotonic() < deadline:
                        final = next((o for o in worker.step() if o.request_id == rid and o.finished), None)
                    resp = resp.result(timeout=30)
                assert final is not None and not worker.inflight
                assert worker.free_pages == worker.total_pages
                if failing[0]:
                    assert final.error and "injected failure on rank 0" in final.error, final
                    assert resp.status_code >= 400 and "injected failure" in resp.text, resp.text
                    failing[0] = False
                else:
                    assert final.error is None and resp.status_code == 200, resp.text
                    tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
                    assert [int(t.removeprefix("token_id:")) for t in tokens] == want
                    # one descriptor per page for each P rank: its KV head into the D rank holding it
                    assert worker.kv_stats["kv_descriptors"] == 2 * -(-len(prompt) // 4), worker.kv_stats
                info = wait_free_pages(d_url)
                assert info["free_pages"] == info["total_pages"], info
        finally:
            worker.close()
            engine.runner.close()
