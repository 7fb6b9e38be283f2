"""The PD time-to-first-token breakdown: per request, how long each stage took, on this host's own clock.

Every duration is the difference of two `time.monotonic()` readings taken in the same process: no
timestamp ever crosses a host. A stage that spans a peer's work (D waiting for P's handoff record)
is measured by the side that waits, and set against the peer's own figures for the same request only
as durations (D's `d_wait_record` >= P's `p_prefill` + `p_record` on any clock).

Stages, in a request's order (P = prefill server, D = decode server; names are the /metrics labels):
  router_prefill_done   router: request received -> P's HTTP answer (the KV handed off)
  router_decode_headers router: request received -> D's response headers
  router_ttft           router: request received -> first streamed token out to the client
  p_admit               P: HTTP request read -> room in P's bootstrap queue (engine thread)
  p_wait_destination    P: room queued -> D's KVDestination there too, prefill admitted
  p_queue               P: prefill admitted -> its first chunk's engine step starts
  p_prefill_chunk       P: one chunk's engine step (one sample per chunk)
  p_prefill             P: first chunk's step start -> last chunk's step end (y0 sampled; draft extend
                        included in draft-on-both)
  p_record              P: last chunk done -> handoff record queued for D (its serialization)
  p_kv_submit           P: record queued -> KV write submitted to the transfer backend
  p_kv_write            P: KV write submitted -> its completion seen by P's engine thread
  p_total               P: HTTP request read -> TransferDone queued for D
  d_admit               D: HTTP request read (before bootstrap) -> room in D's prealloc queue
  d_prealloc            D: room queued -> pages offered to P (KVDestination queued)
  d_wait_record         D: pages offered -> P's handoff record arrived
  d_wait_kv             D: handoff record arrived -> P's TransferDone arrived
  d_draft_extend_chunk  D, decode-only with streaming: the draft extend over one chunk's TargetFeatures (one
                        sample per chunk; the last chunk's runs while its pages are written)
  d_commit              D: both arrived -> handoff committed (decode-only: the draft extend over what the
                        record carries included)
  d_first_token_out     D: committed -> y0 handed to the HTTP stream
  d_ttft                D: HTTP request read -> y0 handed to the HTTP stream
"""
from __future__ import annotations

import collections
import threading

STAGES = ("router_prefill_done", "router_decode_headers", "router_ttft",
          "p_admit", "p_wait_destination", "p_queue", "p_prefill_chunk", "p_prefill", "p_record", "p_kv_submit",
          "p_kv_write", "p_total",
          "d_admit", "d_prealloc", "d_wait_record", "d_wait_kv", "d_draft_extend_chunk", "d_commit",
          "d_first_token_out", "d_ttft")
WINDOW = 4096  # samples kept per stage for the quantiles (the newest)


def between(marks: dict[str, float], stages: list[tuple[str, str, str]]) -> dict[str, float]:
    """{stage: marks[end] - marks[start]} for each (stage, start, end) whose two marks exist."""
    return {stage: marks[end] - marks[start] for stage, start, end in stages if start in marks and end in marks}


def describe(durations: dict[str, float | list[float]]) -> str:
    """'p_admit 0.21 ms, p_prefill_chunk [3.1, 2.9] ms, ...' for a debug log line."""
    parts = []
    for stage, value in durations.items():
        if isinstance(value, list):
            parts.append(f"{stage} [{', '.join(f'{1000 * v:.2f}' for v in value)}] ms")
        else:
            parts.append(f"{stage} {1000 * value:.2f} ms")
    return ", ".join(parts)


class StageStats:
    """The last WINDOW samples of every stage, plus counts and sums since start. Thread-safe: the engine
    thread and the event loop observe, a scrape reads."""

    def __init__(self, window: int = WINDOW):
        self._lock = threading.Lock()
        self._samples: dict[str, collections.deque] = {}
        self._count: dict[str, int] = collections.Counter()
        self._sum: dict[str, float] = collections.Counter()
        self._window = window

    def observe(self, durations: dict[str, float | list[float]]) -> None:
        with self._lock:
            for stage, value in durations.items():
                for v in value if isinstance(value, list) else [value]:
                    self._samples.setdefault(stage, collections.deque(maxlen=self._window)).append(v)
                    self._count[stage] += 1
                    self._sum[stage] += v

    def summary(self) -> dict[str, dict]:
        """{stage: {"count", "sum_s", "p50_ms", "p99_ms", "max_ms"}} (quantiles over the recent window)."""
        with self._lock:
            snap = {stage: (sorted(s), self._count[stage], self._sum[stage]) for stage, s in self._samples.items()}
        out = {}
        for stage in sorted(snap, key=lambda s: STAGES.index(s) if s in STAGES else len(STAGES)):
            xs, count, total = snap[stage]
            pick = lambda q: round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
            out[stage] = {"count": count, "sum_s": round(total, 6), "p50_ms": pick(0.5), "p99_ms": pick(0.99),
                          "max_ms": round(1000 * xs[-1], 3)}
        return out


class StageCollector:
    """Prometheus: `specpd:pd_stage_seconds` as a summary per stage (quantile 0.5 and 0.99 over the recent
    window, _count and _sum since start)."""

    def __init__(self, stages: StageStats, model_name: str):
        self._stages = stages
        self._model = model_name

    def collect(self):
        from prometheus_client.metrics_core import Metric
        name = "specpd:pd_stage_seconds"
        m = Metric(name, "PD time-to-first-token breakdown: seconds per stage of a request, measured on this "
                         "server's own clock (stages: specpd/disagg/timeline.py).", "summary")
        for stage, s in self._stages.summary().items():
            labels = {"model_name": self._model, "stage": stage}
            for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
                m.add_sample(name, {**labels, "quantile": q}, s[key] / 1000)
            m.add_sample(name + "_count", labels, s["count"])
            m.add_sample(name + "_sum", labels, s["sum_s"])
        yield m
