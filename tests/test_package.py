"""The package works where it is installed (issue 63): the wheel `pip wheel` builds from this tree holds every
file of specpd/, and installed with its declared dependencies (pinned by requirements.txt) into a clean venv, run
from a directory outside the repository, it compiles its kernels from its own sources and serves a request.

A wheel that left csrc/'s headers out served nothing: its kernels did not build, and the attention backend called
the missing one in the first step. The clean venv is deleted at the end (~2 GB: torch and xgrammar's deps)."""
import os
import shutil
import subprocess
import sys
import time
import zipfile

import httpx
import pytest

from specpd.kernels.build import compiler
from specpd.machine import cache_root
from specpd.server.launch import free_port, healthy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 300


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def source_files() -> list[str]:
    """The tree a clone of this checkout holds: tracked files and new ones git does not ignore."""
    if not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout: the files a clone holds are unknown")
    out = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(REPO, f))]


def build_wheel(tmp_path) -> str:
    """`pip wheel` of a copy of the tree (a build in place would reuse a stale build/ of earlier runs)."""
    src, dist = tmp_path / "src", tmp_path / "dist"
    files = source_files()
    for f in files:
        os.makedirs(src / os.path.dirname(f), exist_ok=True)
        shutil.copy2(os.path.join(REPO, f), src / f)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)])
    [wheel] = dist.glob("specpd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    missing = sorted(f for f in files if f.startswith("specpd/") and f not in shipped)
    assert not missing, f"the wheel leaves out {missing} (pyproject.toml's package-data)"
    return str(wheel)


def clean_env(cache: str) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH into this tree, the model already downloaded and
    converted (symlinked from this machine's cache), no compiled kernel."""
    os.makedirs(os.path.join(cache, "kernels"))
    for name in os.listdir(cache_root()):
        if name != "kernels":
            os.symlink(os.path.join(cache_root(), name), os.path.join(cache, name))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "SPECPD_CACHE": cache, "OMP_NUM_THREADS": "1"}


def test_the_wheel_installed_in_a_clean_venv_serves_a_request(tmp_path):
    wheel = build_wheel(tmp_path)
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(str(tmp_path / "cache"))
    try:
        run([sys.executable, "-m", "venv", str(venv)], cwd=elsewhere)
        python = str(venv / "bin" / "python")
        run([python, "-m", "pip", "install", "-q", wheel, "-c", os.path.join(REPO, "requirements.txt")],
            cwd=elsewhere, env=env)
        where = run([python, "-c", "import specpd; print(specpd.__file__)"], cwd=elsewhere, env=env).stdout.strip()
        assert where.startswith(str(venv) + os.sep), where
        serve_one_request(str(venv / "bin" / "specpd"), elsewhere, env)
        if compiler() is not None:  # built from the installed csrc/, on this machine
            built = {f.split("-")[0] for f in os.listdir(tmp_path / "cache" / "kernels") if f.endswith(".so")}
            assert {"cpu_attention", "cpu_ops", "cpu_stack"} <= built, built
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def serve_one_request(specpd: str, cwd, env: dict[str, str]) -> None:
    """`specpd serve` with its defaults: one completion, greedy, its pages back, and a log with no kernel that
    failed to build and no traceback."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(cwd / "serve.log", "w+") as log:
        proc = subprocess.Popen([specpd, "serve", "--host", "127.0.0.1", "--port", str(port), "--model", "default",
                                 "--kv-cache-memory-mb", "32", "--max-model-len", "256"],
                                cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not healthy(base):
                assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-4000:]
                time.sleep(0.3)
            with httpx.Client(base_url=base, timeout=120) as client:
                total = client.get("/server_info").json()["total_pages"]
                resp = client.post("/v1/completions", json={"model": "default", "prompt": "The capital of France is",
                                                            "max_tokens": 4, "temperature": 0})
                assert resp.status_code == 200, resp.text
                choice = resp.json()["choices"][0]
                assert "Paris" in choice["text"] and choice["finish_reason"] == "length", choice
                free = client.get("/server_info").json()["free_pages"]
                for _ in range(150):  # the engine thread frees them just after it answers
                    if free == total:
                        break
                    time.sleep(0.1)
                    free = client.get("/server_info").json()["free_pages"]
                assert free == total, f"KV pages not returned: {free}/{total} free"
        finally:
            proc.terminate()
            proc.wait(30)
        text = open(log.name).read()
    assert "C kernel" not in text and "attention backend 'cpu' unavailable" not in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
