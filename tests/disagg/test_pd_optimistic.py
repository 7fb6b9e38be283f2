"""Optimistic prefill (`--pd-optimistic-prefill`, on by default) over real processes on 127.0.0.1 (a tiny random
Llama, token-id prompts; requests sent to P and D by hand so D's page offer can come late on purpose):

- D offers its pages only after P finished prefilling: P parks the room, holding its pages, and hands it off
  when D comes; D's greedy tokens are the unified engine's, and every page comes back on both;
- rooms without D's destination hold at most half of P's pool (`pd_pages_waiting`); the rest wait in the
  bootstrap queue unprefilled; all fail by the bootstrap timeout and P's pages come back;
- `--no-pd-optimistic-prefill`: the room waits in the bootstrap queue, not prefilled, until D comes.
Through the router, outputs and acceptance with optimistic prefill on (the default) equal unified in
test_pd_e2e.py (both draft modes, both backends).
"""
import concurrent.futures
import time

import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import MAX_TOKENS, PROMPTS, engine_args, expected, model_dir, servers, tiny  # noqa: F401

# long enough that a loaded box sets up what a test looks at (a parked room, 14 rooms taken) well before any room
# of it times out: the tests wait this long at most once
BOOTSTRAP_TIMEOUT_S = 10.0


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def tokens_of(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


def wait_for(url: str, predicate, what: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(got := info(url)):
        assert time.monotonic() < deadline, f"{what}: {got}"
        time.sleep(0.02)
    return got


def wait_pages_back(url: str, timeout_s: float = 30.0) -> dict:
    return wait_for(url, lambda i: i["free_pages"] == i["total_pages"] and not i.get("pd_pages_waiting")
                    and not i.get("pd_parked") and not i.get("pd_bootstrap"), f"{url}'s pages back", timeout_s)


@pytest.fixture(scope="module")
def cluster(model_dir):  # noqa: F811
    """(P with optimistic prefill, P without, D), each P's bootstrap port."""
    boots = [free_port(), free_port()]
    common = ["--pd-bootstrap-timeout", str(BOOTSTRAP_TIMEOUT_S), *engine_args(model_dir)]
    specs = [["--role", "prefill", "--bootstrap-port", str(boots[0]), *common],
             ["--role", "prefill", "--bootstrap-port", str(boots[1]), "--no-pd-optimistic-prefill", *common],
             ["--role", "decode", *engine_args(model_dir)]]
    with servers(specs) as urls:
        yield urls, boots


def body(prompt: list[int], boot: int, room: int) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}


@pytest.mark.parametrize("optimistic", [True, False], ids=["optimistic", "not-optimistic"])
def test_decode_offering_pages_after_the_prefill_still_gets_a_correct_handoff(cluster, expected, optimistic):  # noqa: F811
    (p_on, p_off, d_url), boots = cluster
    p_url, boot = (p_on, boots[0]) if optimistic else (p_off, boots[1])
    room = 1000 + optimistic
    # its own prompt per case: D's prefix cache would hold a repeated one and D would prefill it itself
    which = 1 if optimistic else 2
    prompt = PROMPTS[which]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prefill = pool.submit(httpx.post, p_url + "/v1/completions", json=body(prompt, boot, room), timeout=60)
        if optimistic:  # P prefilled without D and holds the pages (21 tokens: 6 of 4) until D comes
            got = wait_for(p_url, lambda i: i["pd_parked"] == 1, "P never parked the room")
            assert got["pd_pages_waiting"] == 6 and got["pd_bootstrap"] == 0
        else:  # P waits for D before it computes anything
            got = wait_for(p_url, lambda i: i["pd_bootstrap"] == 1, "P never queued the room")
            time.sleep(0.5)
            got = info(p_url)
            assert got["pd_bootstrap"] == 1 and got["pd_prefilling"] == got["pd_parked"] == 0, got
            assert got["free_pages"] == got["total_pages"]
        resp = httpx.post(d_url + "/v1/completions", json=body(prompt, boot, room), timeout=60)
        assert tokens_of(resp) == expected[which]
        assert prefill.result(timeout=30).status_code == 200
    for url in (p_url, d_url):
        wait_pages_back(url)
    got = info(p_url)
    assert got["engine_alive"], got
    stages = got["pd_stages"]
    assert stages["p_total"]["count"] >= 1, stages
    if optimistic:  # parked from its prefill's end until D's destination came
        assert stages["p_parked"]["count"] >= 1 and stages["p_parked"]["max_ms"] > 0, stages
    else:
        assert "p_parked" not in stages, stages


def test_rooms_without_a_destination_are_bounded_and_time_out(cluster):
    """14 requests of 10 pages and no D: at most half of P's 128 pages are held (6 rooms parked), the other 8
    wait unprefilled; every one fails by the bootstrap timeout and P's pages come back."""
    (p_url, _, _), boots = cluster
    prompts = [[(i + 1) * 7 % 300 + 1] + list(range(100, 139)) for i in range(14)]  # 40 tokens, distinct heads
    def timed_post(prompt, room):
        resp = httpx.post(p_url + "/v1/completions", json=body(prompt, boots[0], room), timeout=60)
        return resp, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        sent = time.monotonic()
        futures = [pool.submit(timed_post, p, 2000 + i) for i, p in enumerate(prompts)]
        # all 14 held at once: seen before the first of them can time out, or the case did not arise in time
        got = wait_for(p_url, lambda i: i["pd_parked"] + i["pd_bootstrap"] + i["pd_prefilling"] == 14
                       and i["pd_prefilling"] == 0, "P never took the 14 rooms", BOOTSTRAP_TIMEOUT_S)
        assert got["pd_pages_waiting"] <= got["total_pages"] // 2, got
        assert got["pd_parked"] == 6 and got["pd_bootstrap"] == 8, got
        results = [f.result(timeout=60) for f in futures]
    after = [at - sent for _, at in results]
    print(f"\nthe 14 rooms failed {min(after):.2f} to {max(after):.2f} s after they were sent "
          f"(bootstrap timeout {BOOTSTRAP_TIMEOUT_S:g} s)")
    for resp, _ in results:
        assert resp.status_code >= 500 and "no decode server claimed room" in resp.text, resp.text
    # by the bootstrap timeout, counted from when P read each request (after `sent`), and not a hang (the
    # client's timeout is 60 s)
    assert BOOTSTRAP_TIMEOUT_S <= min(after) and max(after) < BOOTSTRAP_TIMEOUT_S + 30, after
    wait_pages_back(p_url)
