"""The flags and configurations that choose the engine arguments of the PD benchmarks' clusters (evals/pd.py,
pd_interleaved.py; the clusters themselves: evals.harness.servers).
"""
from __future__ import annotations

import argparse


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    """The flags cluster_configs reads (this benchmark's and pd_interleaved.py's)."""
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
