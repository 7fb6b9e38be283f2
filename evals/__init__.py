"""The benchmarks of specpd, run as `python -m evals.<name>` from the repository root (docs/benchmarks.md).

Every experiment is one module `evals/<subject>_<what>.py` (or `evals/<subject>.py` for a subject's main one:
peers, spec, pd, prefix, tp, soak, gpu; the rest: kernels_*, engine_*) and writes one canonical JSON,
`evals/results/<its name>.json` (`<its name>_<variant>.json` for a mode or box it records apart, a .png beside
it). What they share (starting servers, the streaming client, prompts, the result writer) is `evals.harness`.
"""
