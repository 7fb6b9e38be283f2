"""Nothing assumes one host: P, D and the router in three network namespaces joined by veth pairs on a bridge
(addresses this test creates), serving through the router from the root namespace, over tcp and Mooncake.

P binds 0.0.0.0 and names itself with --advertise-host (its bootstrap route, control socket and transfer
session carry that address, and its /server_info tells the router); D binds its own address; the router
reaches both by the URLs it was given. Skipped where namespaces cannot be made (not root, no `ip`)."""
import contextlib
import os
import shutil
import subprocess
import sys
import uuid

import httpx
import pytest

from specpd.disagg.transfer import backend_available
from specpd.server.launch import REPO, ServerStartError, serve_processes
from tests.disagg.test_pd_e2e import MAX_TOKENS, PROMPTS, engine_args, expected, model_dir, tiny  # noqa: F401

SUBNET = "10.203.0"
ADDR = {"p": f"{SUBNET}.1", "d": f"{SUBNET}.2", "r": f"{SUBNET}.3"}
BOOT = 18998


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:4]
    bridge, names = f"spbr{tag}", {k: f"specpd-{k}-{tag}" for k in ADDR}
    made = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(("link", bridge))
        _ip("addr", "add", f"{SUBNET}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for k, ns in names.items():
            _ip("netns", "add", ns)
            made.append(("netns", ns))
            inner, outer = f"v{k}{tag}", f"vb{k}{tag}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{ADDR[k]}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        _teardown(made)
        pytest.skip(f"cannot build network namespaces here: {e.stderr.strip()}")
    try:
        yield names
    finally:
        _teardown(made)


def _teardown(made):
    for kind, name in reversed(made):
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip(kind, "del", name)


@contextlib.contextmanager
def in_namespaces(names, specs: dict[str, list[str]], timeout_s: float = 180):
    """`specpd serve` per role inside its namespace; yields {role: base URL} once each answers from here."""
    roles = list(specs)
    try:
        with serve_processes([["--log-level", "warning", *specs[k]] for k in roles], timeout_s,
                             env={"MC_LOG_LEVEL": "ERROR"}, wrappers=[["ip", "netns", "exec", names[k]] for k in roles],
                             hosts=[ADDR[k] for k in roles]) as procs:
            yield {k: base for k, (_, base, _) in zip(roles, procs)}
    except ServerStartError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_pd_across_network_namespaces(namespaces, model_dir, expected, backend):  # noqa: F811
    ok, why = backend_available(backend)
    if not ok:
        pytest.skip(why)
    engine = [*engine_args(model_dir), "--transfer-backend", backend]
    specs = {"p": ["--role", "prefill", "--host", "0.0.0.0", "--advertise-host", ADDR["p"],
                   "--bootstrap-port", str(BOOT), *engine],
             "d": ["--role", "decode", "--host", ADDR["d"], *engine]}
    with in_namespaces(namespaces, specs) as urls:
        p_url, d_url = urls["p"], urls["d"]
        info = httpx.get(p_url + "/server_info").json()
        assert info["bootstrap_host"] == ADDR["p"]
        with in_namespaces(namespaces, {"r": ["--role", "router", "--host", ADDR["r"], "--prefill", p_url,
                                              "--decode", d_url]}) as router:
            with httpx.Client(base_url=router["r"], timeout=60) as client:
                for prompt, want in zip(PROMPTS, expected):
                    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                "temperature": 0, "ignore_eos": True, "logprobs": 0})
                    assert resp.status_code == 200, resp.text
                    tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
                    assert [int(t.removeprefix("token_id:")) for t in tokens] == want
        p_info, d_info = httpx.get(p_url + "/server_info").json(), httpx.get(d_url + "/server_info").json()
        assert p_info["kv_transfers"] == len(PROMPTS)
        for got in (p_info, d_info):
            assert got["free_pages"] == got["total_pages"]


def test_a_wildcard_host_without_advertise_host_is_refused(model_dir):  # noqa: F811
    proc = subprocess.run([sys.executable, "-m", "specpd", "serve", "--role", "decode", "--host", "0.0.0.0",
                           "--port", "1", *engine_args(model_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode != 0 and "--advertise-host" in proc.stderr, proc.stderr[-2000:]
