"""The `specpd serve` clusters the PD benchmarks start on 127.0.0.1 (unified, 1P1D with P and D pinned to a core
each, or the --disagg launcher as `make serve` runs it), and the flags and configurations that choose their
engine arguments (evals/bench_pd.py, bench_pd_interleaved.py, bench_tp.py, tp_matrix.py).
"""
from __future__ import annotations

import argparse
import contextlib

from specpd.server.launch import free_port, serve_processes


@contextlib.contextmanager
def launch(commands: list[tuple[list[str], str | None]], timeout_s: float = 600):
    """Start `specpd serve` processes ((args, cpu list for taskset) each); yield their URLs once healthy."""
    with serve_processes([["--log-level", "warning", *args] for args, _ in commands], timeout_s,
                         cpus=[cpus for _, cpus in commands], env={"MC_LOG_LEVEL": "ERROR"}) as procs:
        yield [base for _, base, _ in procs]


def unified_cluster(engine_args: list[str], serve_defaults: bool = False):
    if serve_defaults:  # what the user types: the server takes the cores it may use
        return launch([(["--role", "unified", *engine_args], None)])
    return launch([(["--role", "unified", "--num-threads", "2", *engine_args], None)])


@contextlib.contextmanager
def launcher_cluster(engine_args: list[str]):
    """`specpd serve --disagg 1p1d ENGINE_ARGS`, as `make serve` starts it: yields (router, P, D) URLs."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    with launch([(["--disagg", "1p1d", "--host", "127.0.0.1", "--prefill-port", str(p_port), "--decode-port",
                   str(d_port), "--bootstrap-port", str(boot), *engine_args], None)]) as (router,):
        yield router, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"


@contextlib.contextmanager
def pd_cluster(engine_args: list[str], backend: str, p_tp: int = 1, d_tp: int = 1):
    """P on core 0, D on core 1 (a TP server's ranks share its core: a correctness run, e.g. descriptors)."""
    boot = free_port()
    common = ["--transfer-backend", backend, "--num-threads", "1", *engine_args]
    with launch([(["--role", "prefill", "--bootstrap-port", str(boot), "--tp-size", str(p_tp), *common], "0"),
                 (["--role", "decode", "--tp-size", str(d_tp), *common], "1")]) as (p, d):
        with launch([(["--role", "router", "--prefill", p, "--decode", d, "--bootstrap-port", str(boot)], None)]) \
                as (router,):
            yield router, p, d


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    """The flags cluster_configs reads (this benchmark's and bench_pd_interleaved.py's)."""
    ap.add_argument("--draft-model", default="default")
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--spec-steps", type=int, default=None, help="default: the algorithm's default shape")
    ap.add_argument("--spec-extra", default="",
                    help="more spec flags for the spec configs, e.g. --spec-extra=--no-spec-ngram")
    ap.add_argument("--backend", default="mooncake", choices=("mooncake", "tcp"))
    ap.add_argument("--engine-priority", choices=("normal", "low"), default="low",
                    help="every server's --engine-priority (low: transfer and HTTP threads preempt the engine)")
    ap.add_argument("--prefill-tp", type=int, default=1, help="P's --tp-size (PD configs)")
    ap.add_argument("--decode-tp", type=int, default=1, help="D's --tp-size (PD configs)")
    ap.add_argument("--serve-defaults", action="store_true",
                    help="exactly `make serve`'s command per config (the --disagg launcher, the model and spec flags "
                         "only): no pinning, threads, priority or page settings of this benchmark's own")


def cluster_configs(args) -> dict[str, tuple[str, list[str]]]:
    """config name -> (unified | pd, every server's engine arguments)."""
    if getattr(args, "serve_defaults", False):  # the Makefile's SPEC_ARGS, and nothing of this benchmark's
        spec = ["--speculative-algorithm", "eagle3", "--draft-model", "default"]
        return {"unified": ("unified", ["--model", "default"]), "unified_spec": ("unified", ["--model", "default", *spec]),
                "pd": ("pd", ["--model", "default"]),
                "pd_spec_both": ("pd", ["--model", "default", *spec, "--draft-mode", "both"]),
                "pd_spec_decode_only": ("pd", ["--model", "default", *spec, "--draft-mode", "decode-only"])}
    base = ["--model", "default", "--page-size", "16", "--kv-cache-memory-mb", "1024",
            "--engine-priority", args.engine_priority]
    spec = ["--speculative-algorithm", args.algorithm, "--draft-model", args.draft_model] + \
        (["--spec-num-steps", str(args.spec_steps)] if args.spec_steps else []) + \
        args.spec_extra.split()  # none: the defaults
    return {"unified": ("unified", base), "unified_spec": ("unified", base + spec),
            "pd": ("pd", base), "pd_spec_both": ("pd", base + spec + ["--draft-mode", "both"]),
            "pd_spec_decode_only": ("pd", base + spec + ["--draft-mode", "decode-only"]),
            # the effect of --engine-priority, side by side (the flag's last value wins)
            "pd_normal_priority": ("pd", base + ["--engine-priority", "normal"])}
