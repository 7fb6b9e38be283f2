"""A C kernel that does not build is logged once, with the command and the compiler's message, and the engine
serves on the torch paths instead: no step calls a missing kernel (issue 63, a wheel without csrc/'s headers).

The failures are real compiler errors: a -march the compiler does not know (SPECPD_KERNEL_MARCH), and the
sources of an install that left the headers out."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from specpd.attention import base
from specpd.attention.base import get_backend_class
from specpd.attention.cpu_backend import CpuAttentionBackend
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.kernels import build, cpu_attention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAD_MARCH = "no-such-cpu"
PROMPT = "The capital of France is"

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler: nothing to fail")


def compiler_error(*flags: str) -> str:
    """The compiler's own first error line for `flags` on an empty C file: what the warning must carry."""
    proc = subprocess.run([build.compiler(), *flags, "-x", "c", "-c", "-o", os.devnull, os.devnull],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    return next(line for line in proc.stderr.splitlines() if "error" in line)


@pytest.fixture
def fresh_loads():
    """This process's loads forgotten before and after (the next use reloads the cached library)."""
    def forget():
        for cached in (build.load, cpu_attention._lib, cpu_attention._kernel, base._warn_fallback):
            cached.cache_clear()
        build._FAILED.clear()
    forget()
    yield
    forget()


def warnings_about(caplog, filename: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "specpd.kernels.build" and r.levelno == logging.WARNING and filename in r.getMessage()]


def test_a_failed_build_is_logged_once_with_the_command_and_the_compilers_message(monkeypatch, caplog, tmp_path,
                                                                                   fresh_loads):
    monkeypatch.setenv("SPECPD_KERNEL_MARCH", BAD_MARCH)
    monkeypatch.setenv("SPECPD_CACHE", str(tmp_path))
    error = compiler_error(f"-march={BAD_MARCH}")
    with caplog.at_level(logging.WARNING):
        assert build.load("cpu_ops.c") is None
        assert build.load("cpu_ops.c") is None
    [message] = warnings_about(caplog, "cpu_ops.c")
    assert f"-march={BAD_MARCH}" in message and "cpu_ops.c" in message and error in message
    assert build.unavailable("cpu_ops.c") == f"the compiler failed: {error}"
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_sources_without_their_headers_fall_back_to_torch_attention(monkeypatch, caplog, tmp_path, fresh_loads):
    """The wheel of issue 63: csrc/*.c without amx.h and dtypes.h. The registry hands out the torch backend,
    saying why, where the cpu backend was asked for; a direct caller of the kernel gets the reason too."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name in os.listdir(os.path.dirname(build.source_path("cpu_attention.c"))):
        if name.endswith(".c"):
            shutil.copy(build.source_path(name), csrc / name)
    monkeypatch.setattr(build, "source_path", lambda name: str(csrc / name))
    monkeypatch.setenv("SPECPD_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert get_backend_class("cpu") is TorchAttentionBackend
    [message] = warnings_about(caplog, "cpu_attention.c")
    assert re.search(r"(amx|dtypes)\.h: No such file", message), message
    why = CpuAttentionBackend.unavailable()
    assert why.startswith("csrc/cpu_attention.c: the compiler failed:") and re.search(r"(amx|dtypes)\.h", why)
    assert any(r.name == "specpd.attention.base" and why in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match=r"attention kernel is not available.*(amx|dtypes)\.h"):
        cpu_attention.Prepared(*[None] * 9)


def reference_tokens(max_tokens: int) -> list[int]:
    """Greedy tokens of the default model for PROMPT, in this process (its kernels built as usual)."""
    from specpd.config import CacheConfig, EngineConfig
    from specpd.core import SamplingParams
    from specpd.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(kv_cache_memory_mb=32), max_model_len=256))
    assert cpu_attention.available() and isinstance(engine.runner.backend, CpuAttentionBackend)
    total = engine.free_pages
    out = engine.generate([engine.tokenizer.encode(PROMPT)], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                            ignore_eos=True))[0]
    assert engine.free_pages == total
    return out.token_ids


def test_generate_serves_on_the_torch_paths_when_no_kernel_builds():
    """`specpd generate` with EAGLE-3 in a process where every kernel fails to compile: the same greedy tokens as
    the kernels give, each library's failure logged once, the fallback named, no traceback."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SPECPD_KERNEL_MARCH": BAD_MARCH}
    cmd = [sys.executable, "-m", "specpd", "generate", "--model", "default", "--prompt", PROMPT, "--json",
           "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos", "--kv-cache-memory-mb", "32",
           "--max-model-len", "256", "--speculative-algorithm", "eagle3", "--draft-model", "default"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == reference_tokens(8)
    assert out["spec_verify_count"] > 0  # the draft ran, on the torch backend too
    error = compiler_error(f"-march={BAD_MARCH}")
    for name in ("cpu_attention.c", "cpu_ops.c", "cpu_stack.c"):
        logged = [line for line in proc.stderr.splitlines() if f"C kernel {name} not built" in line]
        assert len(logged) == 1, (name, proc.stderr[-4000:])
        assert f"-march={BAD_MARCH}" in logged[0]
    assert proc.stderr.count(error) >= 3
    fallback = [line for line in proc.stderr.splitlines() if "attention backend 'cpu' unavailable" in line]
    assert len(fallback) == 1 and "using 'torch'" in fallback[0] and error in fallback[0]
    assert "Traceback" not in proc.stderr
