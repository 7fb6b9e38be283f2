"""Real processes on 127.0.0.1: router -> prefill (P) + decode (D), a tiny random Llama with a random EAGLE draft.

SPECPD_API_KEY is in every process's environment (as `specpd serve --disagg` hands it to its children): the
router, P and D all require the key, and the router sends it to P and D. A 30 MB body is refused by the router
with 413 before it is sent (the rest withheld; the times of whole uploads are printed) while a normal request
through it completes. The router's /server_info lists P
and D as objects carrying their own /server_info, so SGLang's bench client reads D's acceptance length.
P's and D's free pages return to their totals.
"""
import concurrent.futures
import time

import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import MAX_TOKENS, PROMPTS, engine_args, wait_free_pages
from tests.server.launcher import STARTUP_TIMEOUT_S
from tests.server.test_admission import answer_mid_upload, check_413
from tests.server.test_server_info import sglang_accept_length

KEY = "pd-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BIG = 30_000_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from specpd.config import ModelConfig
    from specpd.spec.draft.loader import random_draft_checkpoint
    from specpd.model.loader import load_checkpoint
    from specpd.server.launch import ServerStartError, serve_processes
    from tests.model.hf_models import save_tiny_model
    model_dir = str(tmp_path_factory.mktemp("tiny_llama_router"))
    save_tiny_model("llama", model_dir)
    eagle_dir = str(tmp_path_factory.mktemp("tiny_eagle_router"))
    random_draft_checkpoint(eagle_dir, "eagle", ModelConfig.from_hf(load_checkpoint(model_dir).hf_config), seed=1)
    spec = ["--speculative-algorithm", "eagle", "--draft-model", eagle_dir, "--spec-num-steps", "3",
            "--spec-adaptive-pinned"]  # a random head: an unpinned policy may rightly never speculate
    boot = free_port()
    env = {"SPECPD_API_KEY": KEY}
    try:
        with serve_processes([["--role", "prefill", "--bootstrap-port", str(boot), "--log-level", "warning",
                               *engine_args(model_dir), *spec],
                              ["--role", "decode", "--log-level", "warning", *engine_args(model_dir), *spec]],
                             STARTUP_TIMEOUT_S, env=env) as pd:
            p_url, d_url = pd[0][1], pd[1][1]
            with serve_processes([["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port",
                                   str(boot), "--log-level", "warning"]], STARTUP_TIMEOUT_S, env=env) as [router]:
                yield p_url, d_url, router[1]
    except ServerStartError as e:
        pytest.fail(str(e))


def _complete(router: str, prompt: list[int], headers=AUTH) -> httpx.Response:
    return httpx.post(router + "/v1/completions", headers=headers, timeout=120,
                      json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def _pages_back(*bases):
    for base in bases:
        info = wait_free_pages(base, 30)
        assert info["free_pages"] == info["total_pages"], (base, info)


def test_router_p_and_d_require_the_key_and_the_router_sends_it(cluster):
    p_url, d_url, router = cluster
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = _complete(router, PROMPTS[0], headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(router + "/health").status_code == 200
    resp = _complete(router, PROMPTS[0])
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS, resp.text
    for base in (p_url, d_url):  # behind the router too: a request without the key is refused
        assert httpx.get(base + "/v1/models").status_code == 401
        assert _complete(base, PROMPTS[0], {}).status_code == 401
        assert httpx.post(base + "/flush_cache").status_code == 401
        assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200
    _pages_back(p_url, d_url)


def test_30mb_body_is_413_fast_through_the_router_while_a_request_completes(cluster):
    p_url, d_url, router = cluster
    big = b'{"prompt": "' + b"a" * BIG + b'", "max_tokens": 4}'

    def chunked():
        yield b'{"prompt": "'
        for _ in range(BIG >> 20):
            yield b"a" * (1 << 20)
        yield b'"}'

    def timed(content):
        start = time.perf_counter()
        if content is None:
            resp = _complete(router, PROMPTS[1])
        else:
            resp = httpx.post(router + "/v1/completions", content=content, timeout=60,
                              headers={**AUTH, "Content-Type": "application/json"})
        return resp, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        normal = pool.submit(timed, None)
        # an answer at all, with the rest of the body never sent, is the refusal before the upload
        withheld = [pool.submit(answer_mid_upload, router, AUTH, BIG, 0),
                    pool.submit(answer_mid_upload, router, AUTH, None, 9 << 20)]
        refused = [pool.submit(timed, big), pool.submit(timed, chunked())]
        for future in withheld:
            check_413(*future.result())
        seconds = []
        for future in refused:
            resp, took = future.result()
            check_413(resp.status_code, resp.json())
            seconds.append(took)
        resp, took = normal.result()
    print(f"\n413 through the router uploading 30 MB with httpx: {seconds[0]:.2f} s (Content-Length), "
          f"{seconds[1]:.2f} s (chunked); the normal request beside them: {took:.2f} s")
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS, resp.text
    _pages_back(p_url, d_url)


def test_router_server_info_lists_servers_with_their_acceptance(cluster):
    p_url, d_url, router = cluster
    for prompt in PROMPTS:
        assert _complete(router, prompt).status_code == 200
    _pages_back(p_url, d_url)
    d_info = httpx.get(d_url + "/server_info").json()
    tau = d_info["internal_states"][0]["avg_spec_accept_length"]
    assert d_info["spec_verify_count"] >= len(PROMPTS) and tau == pytest.approx(d_info["spec_accept_length"])
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(router + path).json()
        assert [b["url"] for b in info["prefill"]] == [p_url] and [b["url"] for b in info["decode"]] == [d_url]
        assert info["prefill"][0]["role"] == "prefill" and info["decode"][0]["role"] == "decode"
        assert info["decode"][0]["internal_states"] == d_info["internal_states"]
        assert info["decode"][0]["pid"] == d_info["pid"]
        assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(tau)
        assert info["free_pages"] == info["total_pages"]
    assert sglang_accept_length(router) == pytest.approx(tau) and tau >= 1.0


def test_a_body_at_the_routers_limit_is_not_refused_by_p_or_d(cluster):
    """The router adds its bootstrap fields (~90 bytes) to a body it accepted: P and D leave room for them."""
    p_url, d_url, router = cluster
    head = b'{"prompt":[5,17,99],"max_tokens":4,"temperature":0,"pad":"'
    body = head + b" " * (8 * 1024 * 1024 - len(head) - 2) + b'"}'
    assert len(body) == 8 * 1024 * 1024
    resp = httpx.post(router + "/v1/completions", content=body, timeout=120,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text[:300]
    _pages_back(p_url, d_url)
