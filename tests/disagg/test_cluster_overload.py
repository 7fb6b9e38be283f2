"""An overloaded PD cluster refuses new requests up front and never fails the ones it took (issue 63), over real
processes: `specpd serve --disagg 1p1d --max-queued-requests 2` (the launcher passes the limit to P and D), a tiny
random Llama, token-id prompts.

A burst larger than the queues: every request either completes in full or is refused with 503 and Retry-After
(P's or D's full queue, relayed by the router, the other half dropped) — nothing fails midway, nothing is a 502 —
and the pages come back on P and D. Without a limit (the default) the same burst queues and completes (the
deadlines on D count silence, not the wait: tests/disagg/test_deadlines.py).
"""
import concurrent.futures

import httpx
import pytest

from specpd.server.launch import free_port
from tests.disagg.fault_cluster import assert_pages_back
from tests.disagg.test_pd_e2e import engine_args, model_dir, tiny  # noqa: F401
from tests.server.launcher import launch_server

BURST = 10
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(model_dir):  # noqa: F811
    p_port, d_port, boot = free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port",
            str(boot), "--log-level", "warning", "--max-queued-requests", "2", "--pd-local-prefill-tokens", "0",
            *engine_args(model_dir)]
    with launch_server(args) as srv:
        yield srv["base"], f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"


def test_a_burst_past_the_queues_is_refused_up_front_and_nothing_admitted_fails(cluster):
    base, p_url, d_url = cluster

    def one(i: int) -> httpx.Response:
        body = {"prompt": [(5 * i + k) % 250 + 3 for k in range(40)], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(base + "/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(one, range(BURST)))
    statuses = [r.status_code for r in answers]
    print(f"\n{BURST} at once: {sorted(statuses)}")
    for resp in answers:
        if resp.status_code == 200:  # admitted: answered in full
            assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS, resp.text
        else:  # refused up front, with when to come back
            assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
            assert "max-queued-requests" in resp.json()["error"]["message"], resp.text
    assert 200 in statuses
    if 503 not in statuses:
        pytest.skip("the burst never filled a queue here: the case did not arise")
    for url in (p_url, d_url):
        assert_pages_back(url, 30)
