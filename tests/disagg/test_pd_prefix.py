"""Prefix caching under PD, real processes: multi-turn conversations through the router with EAGLE in both
draft modes. Every turn's tokens and acceptance equal the unified engine's; D's cache makes P send only the
pages D lacks (KVDestination.cached_tokens), or D prefills a short new turn itself; pages come back on P and D;
/flush_cache on the router empties both caches."""
import time

import httpx
import pytest

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import engine_args, eagle_dir, model_dir, servers, tiny, wait_free_pages  # noqa: F401

PS = 4
SYSTEM = list(range(100, 140))  # a 40-token "system prompt" (the tiny model's vocab is 320)
TURNS = [list(range(200, 206)), list(range(250, 269)), list(range(300, 303))]
MAX_TOKENS = 8


def conversation(run_turn) -> list[tuple[list[int], tuple[int, int], int]]:
    """Each turn's prompt is the history (system, user turns, the model's own replies) plus the new turn."""
    history, outs = list(SYSTEM), []
    for turn in TURNS:
        prompt = history + turn
        tokens, counts, cached = run_turn(prompt)
        outs.append((tokens, counts, cached))
        history = prompt + tokens
    return outs


def complete(client: httpx.Client, prompt: list[int], p_url: str) -> tuple[list[int], tuple[int, int], int]:
    """One greedy turn through the router: (its tokens, (verify rounds, accepted tokens), cached prompt tokens),
    once the prefill server's pages are free again."""
    body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0}).json()
    assert "choices" in body, body
    wait_free_pages(p_url)
    tokens = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
    usage = body["usage"]
    return (tokens, (usage["spec_verify_count"], usage["spec_accepted_tokens"]),
            usage["prompt_tokens_details"]["cached_tokens"])


def unified(model_dir, eagle_dir, mode):
    spec = SpecConfig("eagle", draft_model=eagle_dir, spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6,
                      draft_mode=mode, spec_adaptive=False)
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=PS, num_pages=128), spec=spec))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def run(prompt):
        o = engine.generate([prompt], params)[0]
        return o.token_ids, (o.spec_verify_count, o.spec_accepted_tokens), o.num_cached_tokens
    return conversation(run)


@pytest.mark.parametrize("mode,local", [("both", 0), ("decode-only", 0), ("both", 128), ("decode-only", 128)])
def test_multi_turn_under_pd_matches_unified(model_dir, eagle_dir, mode, local):  # noqa: F811
    want = unified(model_dir, eagle_dir, mode)
    p_boot = free_port()
    spec = ["--speculative-algorithm", "eagle", "--draft-model", eagle_dir, "--spec-num-steps", "3",
            "--spec-topk", "2", "--spec-num-draft-tokens", "6", "--draft-mode", mode, "--no-spec-adaptive"]
    specs = [["--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port", str(p_boot),
              *engine_args(model_dir), *spec],
             ["--role", "decode", "--transfer-backend", "tcp", "--pd-local-prefill-tokens", str(local),
              *engine_args(model_dir), *spec]]
    with servers(specs) as (p_url, d_url):
        with servers([["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port",
                       str(p_boot)]]) as (router,), httpx.Client(base_url=router, timeout=60) as client:
            sent = []

            def run(prompt):
                before = httpx.get(p_url + "/server_info").json()["kv_bytes"]
                out = complete(client, prompt, p_url)
                sent.append(httpx.get(p_url + "/server_info").json()["kv_bytes"] - before)
                return out

            got = conversation(run)
            assert [(t, c) for t, c, _ in got] == [(t, c) for t, c, _ in want]
            cached = [c for _, _, c in got]
            assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
            d_info = httpx.get(d_url + "/server_info").json()
            p_info = httpx.get(p_url + "/server_info").json()
            if local:  # turns 2 and 3 add a few tokens to what D holds: D prefilled them, P sent nothing
                deadline = time.monotonic() + 30  # P counts a skip when D's word reaches it, maybe after the answer
                while p_info["prefills_skipped"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                    p_info = httpx.get(p_url + "/server_info").json()
                assert d_info["pd_local_prefills"] == 2 and p_info["prefills_skipped"] == 2, (d_info, p_info)
                assert sent[1] == sent[2] == 0, sent
            else:  # P sent only the pages after D's cached prefix: fewer bytes than the whole prompt's
                assert d_info["pd_local_prefills"] == 0
                metrics = httpx.get(p_url + "/metrics").text
                assert f'specpd:pd_kv_bytes{{model_name=' in metrics and p_info["kv_bytes"] == sum(sent)
                page_bytes = sent[0] / -(-(len(SYSTEM) + len(TURNS[0])) // PS)
                for turn, (prompt_len, c) in enumerate([(len(SYSTEM) + len(TURNS[0]) + MAX_TOKENS + len(TURNS[1]),
                                                         cached[1])], start=1):
                    assert sent[turn] == page_bytes * (-(-prompt_len // PS) - c // PS), (sent, cached)
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)
            flushed = client.post("/flush_cache").json()
            assert flushed["flushed_pages"] > 0
            for base in (p_url, d_url):
                info = httpx.get(base + "/server_info").json()
                assert info["cached_pages"] == 0 and info["free_pages"] == info["total_pages"]


def test_a_decode_servers_cache_takes_no_page_whose_draft_kv_was_never_built(model_dir, eagle_dir):  # noqa: F811
    """Under the adaptive policy a request's depth-0 rounds defer the draft's extend, and its pages go to the cache
    with the features instead (SpecRunner.cache_payloads). D's own match for a handoff stops before the first such
    page (P sends the rest, draft KV included), where it once took them as built: turn by turn, PD equals the
    unified engine, whose hits rebuild that draft KV from the features. Pinned policy: exact."""
    spec = SpecConfig("eagle", draft_model=eagle_dir, spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6,
                      draft_mode="both", spec_adaptive_pinned=True)
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=PS, num_pages=128), spec=spec))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lagging = []

    def run_unified(prompt):
        o = engine.generate([prompt], params)[0]
        lagging.append(sum(n.payload is not None for n in engine.prefix_cache._nodes()))
        return o.token_ids, (o.spec_verify_count, o.spec_accepted_tokens), o.num_cached_tokens
    want = conversation(run_unified)
    assert any(lagging[:-1]), lagging  # exercised: a later turn hits cached pages whose draft KV was never built
    flags = ["--speculative-algorithm", "eagle", "--draft-model", eagle_dir, "--spec-num-steps", "3",
             "--spec-topk", "2", "--spec-num-draft-tokens", "6", "--draft-mode", "both", "--spec-adaptive-pinned"]
    p_boot = free_port()
    with servers([["--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port", str(p_boot),
                   *engine_args(model_dir), *flags],
                  ["--role", "decode", "--transfer-backend", "tcp", "--pd-local-prefill-tokens", "0",
                   *engine_args(model_dir), *flags]]) as (p_url, d_url):
        with servers([["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port",
                       str(p_boot)]]) as (router,), httpx.Client(base_url=router, timeout=60) as client:
            got = conversation(lambda prompt: complete(client, prompt, p_url))
            assert [(t, c) for t, c, _ in got] == [(t, c) for t, c, _ in want]
            # the turn after the one that left pages lagging: D took fewer pages than the unified engine, which
            # rebuilt their draft KV from the features
            turn = lagging.index(max(lagging[:-1])) + 1
            assert got[turn][2] < want[turn][2], (got, want, lagging)
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)
