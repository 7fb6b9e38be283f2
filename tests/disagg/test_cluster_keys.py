"""Keys everywhere a request can enter a `specpd serve --disagg` cluster (issue 63), over real processes.

One cluster, `--disagg 1p1d --host 0.0.0.0 --api-key-file F` (F mode 0600): no process of it has the key on its
command line (what `ps` shows every user: /proc/<pid>/cmdline of the launcher and of every child); each child
has it in its environment; the router, P and D all refuse a request without it (401), on /v1/* and on the admin
route that changes state (/flush_cache), and the router sends it on, so a keyed request completes; the router
listens on every interface, P and D (HTTP, bootstrap, control) on loopback only. Without a cluster: the
children's command lines without a key (P and D on loopback, no key anywhere), and --api-key-file refused,
naming the path, when group or others may read it, when it is empty or missing.
"""
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from specpd.disagg.bootstrap import fetch_route
from specpd.server.launch import REPO, free_port, tail
from tests.disagg.test_pd_e2e import MAX_TOKENS, PROMPTS, engine_args, model_dir, tiny  # noqa: F401

KEY = "cluster-key-7f3a91"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of the sockets listening on `port`."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


LOOPBACK, ANY = "0100007F", "00000000"


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    key_file = tmp_path_factory.mktemp("keys") / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port, p_port, d_port, boot = free_port(), free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--host", "0.0.0.0", "--port", str(port), "--prefill-port", str(p_port),
            "--decode-port", str(d_port), "--bootstrap-port", str(boot), "--log-level", "warning",
            "--api-key-file", str(key_file), "--transfer-backend", "tcp", *engine_args(model_dir)]
    env = {k: v for k, v in os.environ.items() if k != "SPECPD_API_KEY"}
    env.update(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OPENBLAS_NUM_THREADS="1")
    with tempfile.NamedTemporaryFile("w+", prefix="specpd-keys-", suffix=".log") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "specpd", "serve", *args], cwd=REPO, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                assert launcher.poll() is None, f"the launcher exited:\n{tail(log.name)}"
                assert time.monotonic() < deadline, f"the cluster never became healthy:\n{tail(log.name)}"
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            yield {"launcher": launcher, "base": base, "ports": (port, p_port, d_port, boot),
                   "prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}"}
        finally:
            launcher.terminate()
            try:
                launcher.wait(30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()


def test_no_command_line_holds_the_key_and_every_child_has_it_in_its_environment(cluster):
    launcher = cluster["launcher"].pid
    children = _children(launcher)
    roles = {}
    for pid in [launcher, *children]:
        cmdline = _read(f"/proc/{pid}/cmdline")
        assert KEY.encode() not in cmdline, cmdline.replace(b"\0", b" ")
        assert b"--api-key\0" not in cmdline
        if pid != launcher:
            argv = cmdline.split(b"\0")
            roles[argv[argv.index(b"--role") + 1].decode()] = pid
            assert f"SPECPD_API_KEY={KEY}".encode() in _read(f"/proc/{pid}/environ").split(b"\0")
    assert sorted(roles) == ["decode", "prefill", "router"], roles


def test_router_p_and_d_refuse_a_request_without_the_key(cluster):
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    for base in (cluster["base"], cluster["prefill"], cluster["decode"]):
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            resp = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error", resp.text
            assert httpx.post(base + "/flush_cache", headers=headers, timeout=30).status_code == 401
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(base + "/health", timeout=30).status_code == 200  # read-only routes stay open
    resp = httpx.post(cluster["base"] + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS, resp.text
    assert httpx.post(cluster["base"] + "/flush_cache", headers=AUTH, timeout=30).status_code == 200


def test_router_listens_everywhere_and_p_and_d_on_loopback_only(cluster):
    port, p_port, d_port, boot = cluster["ports"]
    assert _listening(port) == {ANY}, _listening(port)
    control = int(fetch_route("127.0.0.1", boot).zmq_endpoint.rsplit(":", 1)[1])  # P's control socket
    for own in (p_port, d_port, boot, control):
        assert _listening(own) == {LOOPBACK}, (own, _listening(own))


def test_children_without_a_key_bind_loopback_and_carry_none():
    from specpd.server.cli import build_parser
    from specpd.server.cluster import child_commands, child_env
    argv = ["serve", "--disagg", "1p1d", "--host", "0.0.0.0", "--advertise-host", "10.0.0.5", "--model", "m"]
    prefill, decode, router = child_commands(build_parser().parse_args(argv), argv[1:], "tcp")
    for cmd in prefill + decode:
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd.count("--host") == 1, cmd
        assert "--advertise-host" not in cmd  # one box: peers reach each other on loopback
    assert router[router.index("--host") + 1] == "0.0.0.0"
    assert all("--api-key" not in c for c in prefill + decode + [router])
    assert "SPECPD_API_KEY" not in child_env(None) and child_env("k")["SPECPD_API_KEY"] == "k"


def test_a_key_file_others_may_read_is_refused_naming_it(tmp_path):
    from specpd.admission import KeyFileError, api_key_of, read_key_file
    path = tmp_path / "key"
    path.write_text("secret\n")
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match=f"--api-key-file {path}: group or others may access it"):
        read_key_file(str(path))
    path.chmod(0o600)
    assert read_key_file(str(path)) == "secret"
    assert api_key_of(None, str(path), []) == "secret"
    with pytest.raises(KeyFileError, match="not both"):
        api_key_of("typed", str(path), ["--api-key", "typed"])
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(KeyFileError, match="is empty"):
        read_key_file(str(tmp_path / "empty"))
    with pytest.raises(KeyFileError, match=f"--api-key-file {tmp_path / 'missing'}: cannot read it"):
        read_key_file(str(tmp_path / "missing"))
    path.chmod(0o640)  # the command refuses to start, naming the file
    run = subprocess.run([sys.executable, "-m", "specpd", "serve", "--api-key-file", str(path), "--model", "x"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert run.returncode != 0 and f"--api-key-file {path}: group or others may access it" in run.stderr, run.stderr
