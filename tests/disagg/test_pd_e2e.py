"""Real processes on 127.0.0.1: router -> prefill (P) + decode (D), a tiny random Llama, token-id prompts.

Greedy output through the router equals the unified engine's (non-stream and stream), with every transfer
backend that loads here, non-spec and EAGLE chain and tree in both draft modes (with the unified engine's
acceptance counts); a seeded sampled request gives the unified engine's tokens; P's and D's free pages
return to their totals; a P with another page size is refused by D with both values named, and the router
drops P's half of that request; a duplicate room is refused by P without harming the first owner. `specpd serve --disagg 1p1d` brings up the
cluster; a prefill server killed mid-request gives the client an error and D its pages back.
"""
import concurrent.futures
import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from specpd.config import CacheConfig, EngineConfig
from specpd.core import SamplingParams
from specpd.disagg.transfer import backend_available
from specpd.engine.llm_engine import LLMEngine
from specpd.server.launch import free_port
from tests.model.hf_models import save_tiny_model
from tests.server.launcher import launch_server, launch_servers

PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), list(range(1, 33))]
MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_pd")
    return str(path), save_tiny_model("llama", path)


@pytest.fixture(scope="module")
def model_dir(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def expected(tiny):
    """The unified engine's greedy tokens, which are HF transformers' (so PD == unified == HF)."""
    from tests.model.test_hf_equivalence import hf_greedy
    engine = LLMEngine(EngineConfig(model=tiny[0], cache=CacheConfig(page_size=4, num_pages=128)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    unified = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert unified == [hf_greedy(tiny[1], p, MAX_TOKENS) for p in PROMPTS]
    return unified


@contextlib.contextmanager
def servers(specs: list[list[str]]):
    """Start every `specpd serve` command line at once; yields their base URLs once all answer /health."""
    with launch_servers([["--log-level", "warning", *args] for args in specs], STARTUP_TIMEOUT_S) as procs:
        yield [base for _, base, _ in procs]


def engine_args(model_dir, page_size=4):
    return ["--model", model_dir, "--page-size", str(page_size), "--num-pages", "128", "--num-threads", "1"]


def wait_free_pages(base: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(base + "/server_info").json()
        if info["free_pages"] == info["total_pages"] or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def stream_tokens(client: httpx.Client, body: dict) -> list[int]:
    """Text of a streamed completion is not checkable without a tokenizer: ask for logprobs=0 and read ids."""
    tokens, usage = [], None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "logprobs": 0,
                                                        "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if not chunk["choices"]:  # the usage chunk (stream_options.include_usage)
                usage = chunk["usage"]
                continue
            lps = chunk["choices"][0].get("logprobs") or {}
            tokens += [int(t.removeprefix("token_id:")) for t in lps.get("tokens", [])]
    assert usage["completion_tokens"] == len(tokens)
    return tokens


@pytest.fixture(scope="module")
def eagle_dir(model_dir, tmp_path_factory):
    from specpd.config import ModelConfig
    from specpd.spec.draft.loader import random_draft_checkpoint
    from specpd.model.loader import load_checkpoint
    path = str(tmp_path_factory.mktemp("tiny_eagle"))
    random_draft_checkpoint(path, "eagle", ModelConfig.from_hf(load_checkpoint(model_dir).hf_config), seed=1)
    return path


def _backend(name):
    ok, why = backend_available(name)
    return pytest.mark.skipif(not ok, reason=why)


TREE = ("2", "6")  # --spec-topk, --spec-num-draft-tokens
CASES = [pytest.param("tcp", None, None, id="tcp"),
         pytest.param("mooncake", None, None, id="mooncake", marks=_backend("mooncake")),
         pytest.param("tcp", "both", None, id="tcp-eagle-chain-draft-on-both"),
         pytest.param("tcp", "decode-only", None, id="tcp-eagle-chain-draft-on-decode-only"),
         pytest.param("tcp", "both", TREE, id="tcp-eagle-tree-draft-on-both"),
         pytest.param("mooncake", "decode-only", TREE, id="mooncake-eagle-tree-draft-on-decode-only",
                      marks=_backend("mooncake"))]
SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}


def spec_flags(eagle_dir, mode, tree) -> list[str]:
    if not mode:
        return []
    flags = ["--speculative-algorithm", "eagle", "--draft-model", eagle_dir, "--spec-num-steps", "3",
             "--draft-mode", mode, "--no-spec-adaptive"]
    return flags + (["--spec-topk", tree[0], "--spec-num-draft-tokens", tree[1]] if tree else [])


def unified_run(model_dir, eagle_dir, mode, tree) -> tuple[list[tuple[int, int]], list[int]]:
    """The unified engine on the same config: per-prompt (verify count, accepted tokens) for greedy, and
    the tokens of the seeded sampled request."""
    from specpd.config import SpecConfig
    spec = SpecConfig()
    if mode:
        spec = SpecConfig("eagle", draft_model=eagle_dir, spec_num_steps=3, draft_mode=mode, spec_adaptive=False,
                          **({"spec_topk": int(tree[0]), "spec_num_draft_tokens": int(tree[1])} if tree else {}))
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=128), spec=spec))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    counts = [(o.spec_verify_count, o.spec_accepted_tokens) for o in engine.generate(PROMPTS, params)]
    sampled = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED))[0]
    return counts, sampled.token_ids


@pytest.mark.parametrize("backend,mode,tree", CASES)
def test_router_prefill_decode_matches_unified(model_dir, eagle_dir, expected, backend, mode, tree):
    p_boot, p8_boot = free_port(), free_port()
    spec_args = spec_flags(eagle_dir, mode, tree)
    if backend == "mooncake":  # as `make serve` runs: the engine threads under SCHED_IDLE
        spec_args += ["--engine-priority", "low"]
    specs = [["--role", "prefill", "--transfer-backend", backend, "--bootstrap-port", str(p_boot),
              *engine_args(model_dir), *spec_args],
             ["--role", "decode", "--transfer-backend", backend, *engine_args(model_dir), *spec_args]]
    mismatch = backend == "tcp" and not mode
    if mismatch:  # the mismatch check once: a P with another page size
        specs.append(["--role", "prefill", "--transfer-backend", backend, "--bootstrap-port", str(p8_boot),
                      "--pd-bootstrap-timeout", "3", *engine_args(model_dir, page_size=8)])
    want_counts, want_sampled = unified_run(model_dir, eagle_dir, mode, tree)
    with servers(specs) as bases:
        p_url, d_url = bases[0], bases[1]
        routers = [["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port", str(p_boot)]]
        if mismatch:
            routers.append(["--role", "router", "--prefill", bases[2], "--decode", d_url,
                            "--bootstrap-port", str(p8_boot)])
        with servers(routers) as router_urls, httpx.Client(base_url=router_urls[0], timeout=60) as client:
            for prompt, want in zip(PROMPTS, expected):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                resp = client.post("/v1/completions", json={**body, "logprobs": 0})
                assert resp.status_code == 200, resp.text
                tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
                assert [int(t.removeprefix("token_id:")) for t in tokens] == want
                if mode:  # the acceptance D reports equals the unified engine's, request by request
                    usage = resp.json()["usage"]
                    assert (usage["spec_verify_count"], usage["spec_accepted_tokens"]) == \
                        want_counts[PROMPTS.index(prompt)]
                assert stream_tokens(client, body) == want
            # seeded sampling: the same tokens as the unified engine (P samples y0, D the rest)
            resp = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                        "ignore_eos": True, "logprobs": 0, **SEEDED})
            assert resp.status_code == 200, resp.text
            tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
            assert [int(t.removeprefix("token_id:")) for t in tokens] == want_sampled
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)
            if mismatch:
                resp = httpx.post(router_urls[1] + "/v1/completions", timeout=60,
                                  json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
                assert resp.status_code == 400, resp.text
                assert "page_size: prefill=8 decode=4" in resp.json()["error"]["message"]
                deadline = time.monotonic() + 10  # the router dropped P's half: P's bootstrap queue empties
                while httpx.get(bases[2] + "/server_info").json()["pd_bootstrap"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert httpx.get(bases[2] + "/server_info").json()["pd_bootstrap"] == 0
                check_duplicate_room_refused(bases[2])


def check_duplicate_room_refused(p_url: str) -> None:
    """A second request for a room P holds gets a 400 naming the room; the first owner is untouched and
    fails only by its own bootstrap timeout (no D claims it here); P's pages come back."""
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 4242}
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, **room}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, p_url + "/v1/completions", json=body, timeout=60)
        deadline = time.monotonic() + 10
        held = lambda i: i["pd_bootstrap"] + i["pd_prefilling"] + i["pd_parked"]  # noqa: E731 (optimistic: parked)
        while held(httpx.get(p_url + "/server_info").json()) != 1:
            assert time.monotonic() < deadline and not first.done(), "P never queued the first request"
            time.sleep(0.05)
        second = httpx.post(p_url + "/v1/completions", json=body, timeout=60)
        assert second.status_code == 400 and "room 4242 is already in use" in second.text, second.text
        assert held(httpx.get(p_url + "/server_info").json()) == 1
        resp = first.result(timeout=30)
    assert resp.status_code >= 500 and "no decode server claimed room 4242" in resp.text, resp.text
    info = wait_free_pages(p_url)
    assert info["free_pages"] == info["total_pages"] and info["pd_bootstrap"] == info["pd_parked"] == 0, info


def test_disagg_cluster_launcher(model_dir, expected):
    """`specpd serve --disagg 1p1d` starts P, D and the router; greedy output matches unified (a dead child
    is restarted: tests/disagg/test_cluster.py)."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port",
            str(boot), "--log-level", "warning", *engine_args(model_dir)]
    with launch_server(args) as srv:
        client, launcher = srv["client"], srv["proc"]
        info = client.get("/server_info").json()
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        assert info["role"] == "router" and [s["url"] for s in info["prefill"]] == [p_url] \
            and [s["url"] for s in info["decode"]] == [d_url]
        body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]] == expected[1]
        p_info, d_info = httpx.get(p_url + "/server_info").json(), httpx.get(d_url + "/server_info").json()
        assert p_info["role"] == "prefill" and d_info["role"] == "decode" and p_info["pid"] != d_info["pid"]
        info = client.get("/server_info").json()  # the router's view of its backends
        assert info["backends"][d_url]["role"] == "decode" and info["backends"][p_url]["pid"] == p_info["pid"]
        assert info["free_pages"] == info["total_pages"] == p_info["total_pages"] + d_info["total_pages"]
        assert launcher.poll() is None


def test_a_killed_prefill_fails_the_request_and_frees_decode_pages(model_dir):
    """P frozen with a request's room open on D, then killed: the client gets an error, and D's pages come
    back within the heartbeat timeout (2 s here), not the abort timeout (600 s here)."""
    boot = free_port()
    specs = [["--role", "prefill", "--bootstrap-port", str(boot), *engine_args(model_dir)],
             # D's cache holds the prompt after the first request: --pd-local-prefill-tokens 0 keeps P in the
             # loop, so the room in transfer holds a cached prefix (locked) and its own pages
             ["--role", "decode", "--pd-heartbeat-timeout", "2", "--pd-abort-timeout", "600",
              "--pd-local-prefill-tokens", "0", *engine_args(model_dir)]]
    with servers(specs) as (p_url, d_url):
        with servers([["--role", "router", "--prefill", p_url, "--decode", d_url]]) as (router,):
            p_pid = httpx.get(p_url + "/server_info").json()["pid"]
            total = httpx.get(d_url + "/server_info").json()["total_pages"]
            body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            assert httpx.post(router + "/v1/completions", json=body, timeout=60).status_code == 200
            os.kill(p_pid, signal.SIGSTOP)
            try:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(httpx.post, router + "/v1/completions", json=body, timeout=60)
                    deadline = time.monotonic() + 20
                    while httpx.get(d_url + "/server_info").json()["pd_transfer"] != 1:
                        assert time.monotonic() < deadline, "D never offered pages for the room"
                        time.sleep(0.1)
                    assert httpx.get(d_url + "/server_info").json()["free_pages"] < total
                    killed = time.monotonic()
                    os.kill(p_pid, signal.SIGKILL)
                    resp = pending.result(timeout=30)
                assert resp.status_code >= 500 and "prefill" in resp.json()["error"]["message"], resp.text
                while (d := httpx.get(d_url + "/server_info").json())["free_pages"] != total:
                    assert time.monotonic() - killed < 10, d
                    time.sleep(0.1)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p_pid, signal.SIGKILL)


def test_smollm2_with_the_shipped_head_through_pd_matches_unified():
    """The default model and its shipped EAGLE-3 head, draft-on-decode-only over real processes: the
    router's greedy output and acceptance counts equal the unified engine's for a chat prompt."""
    from specpd.config import SpecConfig
    from specpd.model.loader import load_checkpoint
    ckpt = load_checkpoint("default")
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                              add_generation_prompt=True)
    prompt = ckpt.tokenizer.encode(text, add_special_tokens=False)
    spec = SpecConfig("eagle3", draft_model="default", spec_num_steps=3, draft_mode="decode-only",
                      spec_adaptive=False)
    unified = LLMEngine(EngineConfig(model="default", spec=spec, cache=CacheConfig(page_size=16, num_pages=64)),
                        checkpoint=ckpt)
    want = unified.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    boot = free_port()
    args = ["--model", "default", "--page-size", "16", "--num-pages", "64", "--num-threads", "1",
            "--speculative-algorithm", "eagle3", "--draft-model", "default", "--spec-num-steps", "3",
            "--draft-mode", "decode-only", "--no-spec-adaptive"]
    with servers([["--role", "prefill", "--bootstrap-port", str(boot), *args], ["--role", "decode", *args]]) as (p, d):
        with servers([["--role", "router", "--prefill", p, "--decode", d]]) as (router,):
            resp = httpx.post(router + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            got = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
            assert got == want.token_ids
            assert (body["usage"]["spec_verify_count"], body["usage"]["spec_accepted_tokens"]) == \
                (want.spec_verify_count, want.spec_accepted_tokens)
            for base in (p, d):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)


def test_router_splits_parallel_samples(model_dir):
    """n > 1 through the router: one P/D request per sample (the first alone until P has prefilled it, so the
    others hit P's prefix cache), merged into one answer: sample i is what the unified engine gives seed + i,
    under choice index i, streamed and not; usage counts the prompt once; pages come back on P and D."""
    n, prompt = 3, PROMPTS[1]
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=128)))
    want = [engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     **{**SEEDED, "seed": SEEDED["seed"] + i}))[0].token_ids
            for i in range(n)]
    boot = free_port()
    specs = [["--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port", str(boot), *engine_args(model_dir)],
             ["--role", "decode", "--transfer-backend", "tcp", *engine_args(model_dir)]]
    with servers(specs) as (p_url, d_url):
        with servers([["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port", str(boot)]]) \
                as (router,), httpx.Client(base_url=router, timeout=120) as client:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": n, "logprobs": 0, **SEEDED}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert [c["index"] for c in out["choices"]] == list(range(n))
            assert [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in out["choices"]] == want
            assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == n * MAX_TOKENS
            assert httpx.get(p_url + "/server_info").json()["prefix_cache_hit_tokens"] > 0
            tokens, usage = [[] for _ in range(n)], None
            with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
            for chunk in map(json.loads, lines[:-1]):
                if not chunk["choices"]:
                    usage = chunk["usage"]
                    continue
                choice = chunk["choices"][0]
                tokens[choice["index"]] += [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
            assert tokens == want and usage["completion_tokens"] == n * MAX_TOKENS
            too_many = client.post("/v1/completions", json={**body, "n": 129})
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        for url in (p_url, d_url):
            info = wait_free_pages(url)
            assert info["free_pages"] == info["total_pages"], url
