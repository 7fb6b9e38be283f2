"""`specpd serve --disagg 1p1d` over real processes survives its children: the prefill (or decode) server
SIGKILLed, the next request waits for it or gets 503 with Retry-After naming it (never a refused connection or a
502), the launcher restarts it and the cluster serves again, with the other server's pages back to its total; the same when the kill comes right after
the router's first /health 200 (the launcher printed its ready line before that 200 and supervises from then
on); a child that never became healthy fails the command naming it; the transfer backend is decided once by
the launcher and passed to every child."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from specpd.machine import split_cores, usable_cores
from specpd.server.cluster import child_commands, choose_transfer_backend
from specpd.server.launch import REPO, free_port, tail
from tests.disagg.test_pd_e2e import MAX_TOKENS, PROMPTS, engine_args, expected, model_dir, tiny  # noqa: F401
from tests.server.launcher import launch_server
from tests.server.test_tp_server import tp_ranks

HEARTBEAT_TIMEOUT_S = 3.0


def test_children_get_the_launchers_transfer_backend():
    from specpd.server.cli import build_parser
    argv = ["serve", "--disagg", "2p1d", "--transfer-backend", "tcp", "--model", "m", "--port", "9000"]
    args = build_parser().parse_args(argv)
    assert choose_transfer_backend(args.transfer_backend) == "tcp"
    prefill, decode, router = child_commands(args, argv[1:], "mooncake")
    for cmd in prefill + decode:
        assert cmd.count("--transfer-backend") == 1 and cmd[cmd.index("--transfer-backend") + 1] == "mooncake"
        assert cmd[:3] == [sys.executable, "-m", "specpd"] and "--model" in cmd
    assert "--transfer-backend" not in router
    assert [c[c.index("--bootstrap-port") + 1] for c in prefill] == ["8998", "8999"]
    # the cores are split between the children, each told its share (none without one)
    threads = [int(c[c.index("--num-threads") + 1]) for c in prefill + decode]
    assert all(t >= 1 for t in threads) and sum(threads) == max(usable_cores(), 3)
    assert "--num-threads" not in router
    given = argv + ["--num-threads", "4"]
    prefill, decode, _ = child_commands(build_parser().parse_args(given), given[1:], "tcp")
    assert all(c.count("--num-threads") == 1 and c[c.index("--num-threads") + 1] == "4" for c in prefill + decode)
    # per-role tensor parallelism: each child its --tp-size, its share of the cores divided between its ranks
    sized = ["serve", "--disagg", "1p1d", "--model", "m", "--port", "9000", "--prefill-tp", "3", "--decode-tp=2"]
    [p_cmd], [d_cmd], router = child_commands(build_parser().parse_args(sized), sized[1:], "tcp")
    assert p_cmd[p_cmd.index("--tp-size") + 1] == "3" and d_cmd[d_cmd.index("--tp-size") + 1] == "2"
    assert "--prefill-tp" not in p_cmd + d_cmd + router and "--decode-tp=2" not in p_cmd + d_cmd + router
    p_share, d_share = split_cores(usable_cores(), 1, 1)
    assert int(p_cmd[p_cmd.index("--num-threads") + 1]) == max(1, p_share[0] // 3)
    assert int(d_cmd[d_cmd.index("--num-threads") + 1]) == max(1, d_share[0] // 2)


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_killed_server_is_restarted_and_the_cluster_serves_again(model_dir, expected, victim):  # noqa: F811
    p_port, d_port, boot = free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port",
            str(boot), "--log-level", "warning", "--pd-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
            "--pd-local-prefill-tokens", "0",  # the repeated prompt hits D's cache: keep P in the loop
            *engine_args(model_dir)]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}

    def tokens(resp):
        return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]

    with launch_server(args) as srv:
        client, launcher = srv["client"], srv["proc"]
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and tokens(resp) == expected[1], resp.text
        dead_url, other_url = (p_url, d_url) if victim == "prefill" else (d_url, p_url)
        dead = httpx.get(dead_url + "/server_info").json()
        other_total = httpx.get(other_url + "/server_info").json()["total_pages"]
        assert dead["transfer_backend"] in ("mooncake", "tcp")

        os.kill(dead["pid"], signal.SIGKILL)
        killed = time.monotonic()
        resp = client.post("/v1/completions", json=body, timeout=60)  # the router waits for its backend, bounded
        assert resp.status_code in (200, 503), resp.text
        if resp.status_code == 503:
            assert int(resp.headers["Retry-After"]) >= 1 and f"{victim} server {dead_url} is down" in resp.text
        print(f"{resp.status_code} {time.monotonic() - killed:.2f} s after the kill")

        while True:  # the launcher restarts P; the first request that works ends the outage
            assert launcher.poll() is None, f"the launcher stopped the cluster:\n{tail(srv['log'])}"
            assert time.monotonic() - killed < 60, "the cluster did not serve again within a minute"
            try:
                resp = client.post("/v1/completions", json=body, timeout=30)
            except httpx.TransportError as e:
                raise AssertionError(f"the router itself went away: {e!r}") from None
            if resp.status_code == 200:
                break
            assert resp.status_code == 503 and resp.headers.get("Retry-After"), resp.text  # never a 502
            time.sleep(0.5)
        assert tokens(resp) == expected[1]
        assert httpx.get(dead_url + "/server_info").json()["pid"] != dead["pid"]
        deadline = time.monotonic() + 2 * HEARTBEAT_TIMEOUT_S + 5  # rooms toward the dead one: the usual rules
        while (other := httpx.get(other_url + "/server_info").json())["free_pages"] != other_total:
            assert time.monotonic() < deadline, other
            time.sleep(0.2)
        queues = ("pd_transfer", "pd_prealloc") if victim == "prefill" else ("pd_bootstrap", "pd_inflight")
        assert all(other[q] == 0 for q in queues), other


def test_a_killed_tensor_parallel_rank_restarts_its_server_and_the_cluster_serves_again(model_dir, expected):  # noqa: F811
    """D at --decode-tp 2: its rank 1 killed, D exits on its own (specpd/server/async_engine.py) and the
    launcher starts a whole new D (a new group); P is untouched and the cluster answers as before."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port",
            str(boot), "--log-level", "warning", "--decode-tp", "2", "--pd-local-prefill-tokens", "0",
            *engine_args(model_dir)]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}

    def tokens(resp):
        return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]

    with launch_server(args) as srv:
        client = srv["client"]
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and tokens(resp) == expected[1], resp.text
        d_info, p_pid = httpx.get(d_url + "/server_info").json(), httpx.get(p_url + "/server_info").json()["pid"]
        assert d_info["runtime"]["tp_size"] == 2
        [rank] = tp_ranks(d_info["pid"])
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            assert srv["proc"].poll() is None, f"the launcher stopped the cluster:\n{tail(srv['log'])}"
            assert time.monotonic() - killed < 60, "the cluster did not serve again within a minute"
            try:
                resp = client.post("/v1/completions", json=body, timeout=30)
                if resp.status_code == 200 and httpx.get(d_url + "/server_info").json()["pid"] != d_info["pid"]:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert tokens(resp) == expected[1]
        assert httpx.get(p_url + "/server_info").json()["pid"] == p_pid  # P untouched


def _launcher(args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specpd", "serve", *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_server_killed_right_after_the_routers_first_200_is_restarted(model_dir, expected, victim):  # noqa: F811
    """The window of issue 30: a client (a load balancer's probe, a test) that uses the cluster the moment the
    router's /health says 200 and then loses P or D must find it restarted, never the whole cluster stopped."""
    port, p_port, d_port, boot = free_port(), free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--port", str(port), "--prefill-port", str(p_port), "--decode-port", str(d_port),
            "--bootstrap-port", str(boot), "--log-level", "warning", "--pd-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
            "--pd-local-prefill-tokens", "0", *engine_args(model_dir)]
    base = f"http://127.0.0.1:{port}"
    victim_url = f"http://127.0.0.1:{p_port if victim == 'prefill' else d_port}"
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with tempfile.NamedTemporaryFile("w+", prefix="specpd-cluster-", suffix=".log") as log:
        launcher = _launcher(args, log)
        try:
            deadline = time.monotonic() + 300
            while True:  # poll the router's /health as a load balancer would, every 20 ms
                assert launcher.poll() is None, f"the launcher exited during start-up:\n{tail(log.name)}"
                assert time.monotonic() < deadline, f"the cluster never became healthy:\n{tail(log.name)}"
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            first_200 = time.monotonic()
            # the ready line comes before any 200 (the launcher prints it, then lets /health answer)
            assert "specpd ready: serving" in tail(log.name, 100_000), tail(log.name)
            pid = httpx.get(victim_url + "/server_info", timeout=5).json()["pid"]
            os.kill(pid, signal.SIGKILL)
            window = time.monotonic() - first_200
            assert window < 0.5, f"the kill came {window:.2f} s after the first 200: not the window under test"

            while True:  # restarted; the first request that works ends the outage
                assert launcher.poll() is None, f"the launcher stopped the cluster:\n{tail(log.name)}"
                assert time.monotonic() - first_200 < 120, f"the cluster did not serve again:\n{tail(log.name)}"
                try:
                    resp = httpx.post(base + "/v1/completions", json=body, timeout=30)
                except httpx.TransportError as e:
                    raise AssertionError(f"the router itself went away: {e!r}\n{tail(log.name)}") from None
                if resp.status_code == 200:
                    break
                time.sleep(0.5)
            tokens = [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]
            assert tokens == expected[1]
            assert httpx.get(victim_url + "/server_info", timeout=5).json()["pid"] != pid
            assert f"{victim} {victim_url} exited with -9; restarting it" in tail(log.name, 100_000)
            print(f"killed {window * 1000:.0f} ms after the first 200; served again "
                  f"{time.monotonic() - first_200:.1f} s after it")
        finally:
            _stop(launcher)


def test_a_child_that_never_became_healthy_fails_the_start_naming_it(tmp_path):
    """Start-up failure stays one: servers that cannot load their model stop the command, the first one named."""
    port, p_port, d_port, boot = free_port(), free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--port", str(port), "--prefill-port", str(p_port), "--decode-port", str(d_port),
            "--bootstrap-port", str(boot), "--log-level", "warning", "--model", str(tmp_path / "no-such-model")]
    with tempfile.NamedTemporaryFile("w+", prefix="specpd-cluster-", suffix=".log") as log:
        launcher = _launcher(args, log)
        try:
            assert launcher.wait(300) == 1, tail(log.name)
        finally:
            if launcher.poll() is None:
                _stop(launcher)
        out = tail(log.name, 100_000)
        assert "during startup, before it ever answered its health check; stopping the cluster" in out, out
        assert "specpd ready" not in out, out
