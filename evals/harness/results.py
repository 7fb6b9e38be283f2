"""The report writer of every benchmark: the machine and versions a result was measured on, its statistics, and
write_json, which makes sure each result file names the CPU ISA (specpd.machine.isa()), the machine and the commit.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def machine_info() -> dict:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": cpu, "logical_cores": os.cpu_count(), "usable_cores": usable,
            "memory_gib": mem_gib, "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS")}


def versions() -> dict:
    import torch
    import transformers

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=True).stdout.rstrip()
        except (OSError, subprocess.CalledProcessError):
            return None

    # call before measuring: it describes the code the process imported, not a later working tree
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "specpd")
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specpd_commit": git("rev-parse", "HEAD"),
            "specpd_uncommitted_files": [line[3:] for line in dirty.splitlines()] if dirty is not None else None}


def command_line() -> str:
    """How this run was started, as it reruns from the repository root: `python -m evals.<module> ARGS`."""
    module = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT).removesuffix(".py").replace(os.sep, ".")
    return " ".join(["python", "-m", module, *sys.argv[1:]])


def _holds(data, keys: tuple[str, ...]) -> bool:
    """Whether any dict in `data` (dicts nested in dicts) has one of `keys` set."""
    level = [data]
    while level:
        if any(isinstance(d, dict) and d.get(k) not in (None, "") for d in level for k in keys):
            return True
        level = [v for d in level if isinstance(d, dict) for v in d.values() if isinstance(v, dict)]
    return False


def provenance(data: dict) -> dict:
    """What `data` lacks of the provenance every result file carries: the CPU ISA (`isa`), the machine
    (`machine`: machine_info) and the versions with the commit (`versions`); a benchmark records them itself when
    it can (versions before it measures), this fills in what it did not."""
    from specpd.machine import isa
    out = {}
    if not _holds(data, ("isa", "cpu_isa")):
        out["isa"] = isa()
    if not _holds(data, ("cpu_model", "gpu")):
        out["machine"] = machine_info()
    if not _holds(data, ("specpd_commit", "commit")):
        out["versions"] = versions()
    return out


def write_json(path: str, data: dict) -> None:
    """`data` and what it lacks of provenance() as `path` (its folder made), indented, newline-terminated."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**data, **provenance(data)}, f, indent=2)
        f.write("\n")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs, linearly interpolated (numpy's default); None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)
