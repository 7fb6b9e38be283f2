"""The names evals/bench_peers.py and evals/peers*.py import from before evals/ became a package: each is now in
evals.harness (results, prompts, servers, client) or evals.kernels_against. Those scripts move onto the harness
once no run of them is in flight; nothing else imports this.
"""
from __future__ import annotations

from evals.harness.client import sse_chunks
from evals.harness.prompts import (SHAREGPT_PIN, chat_prompt, held_out_first_turns, held_out_prompt_sets,
                                   held_out_sharegpt_prompts, humaneval_prompts, real_text_prompts)
from evals.harness.results import REPO_ROOT, log, machine_info, median, percentile, versions, write_json
from evals.harness.servers import keep_logs, transfer_backend
from evals.kernels_against import kernel_at

__all__ = ["REPO_ROOT", "SHAREGPT_PIN", "chat_prompt", "held_out_first_turns", "held_out_prompt_sets",
           "held_out_sharegpt_prompts", "humaneval_prompts", "keep_logs", "kernel_at", "log", "machine_info",
           "median", "percentile", "real_text_prompts", "sse_chunks", "transfer_backend", "versions", "write_json"]
