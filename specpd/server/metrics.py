"""Prometheus metrics for one server, named `specpd:*` like vLLM's `vllm:*`.

Counters and histograms are updated by the event loop as outputs arrive (see AsyncEngine._dispatch);
gauges read the engine's last stats snapshot at scrape time, so scraping never touches the engine.
Each server owns its registry, so several apps can live in one process (tests).
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from specpd.core import RequestOutput

disable_created_metrics()  # no `*_created` series next to every counter and histogram

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _SpecCollector:
    """Speculative decoding counters from the engine's stats snapshot: an acceptance-length
    histogram (tokens committed per verify forward, bonus included) and per-position acceptance."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        st = self._stats()
        yield from _grammar_metrics(st, self._model)
        hist = st.get("spec_accept_length_hist")
        if not hist:
            return
        buckets, total = [], 0
        for length, count in enumerate(hist):
            if length == 0:
                continue
            total += count
            buckets.append((str(float(length)), total))
        buckets.append(("+Inf", total))
        committed = sum(length * count for length, count in enumerate(hist))
        h = HistogramMetricFamily("specpd:spec_accept_length", "Tokens committed per verify forward (bonus included).",
                                  labels=["model_name"])
        h.add_metric([self._model], buckets, committed)
        yield h
        pos = CounterMetricFamily("specpd:spec_accepted_tokens_per_position",
                                  "Accepted draft tokens by draft depth (1 = first proposed token).",
                                  labels=["model_name", "position"])
        for depth, count in enumerate(st.get("spec_accepted_per_position", []), start=1):
            pos.add_metric([self._model, str(depth)], count)
        yield pos
        verify = CounterMetricFamily("specpd:spec_verify", "Verify forwards.", labels=["model_name"])
        verify.add_metric([self._model], st.get("spec_verify_count", 0))
        yield verify
        proposed = st.get("spec_draft_tokens_hist")  # adaptive speculation: what the policy chose
        if proposed is not None:
            buckets, total, tokens = [], 0, 0
            for n, count in enumerate(proposed):
                total += count
                tokens += n * count
                buckets.append((str(float(n)), total))
            buckets.append(("+Inf", total))
            h = HistogramMetricFamily("specpd:spec_draft_tokens_per_round",
                                      "Draft tokens proposed per request per round (0 = speculation off).",
                                      labels=["model_name"])
            h.add_metric([self._model], buckets, tokens)
            yield h
            off = CounterMetricFamily("specpd:spec_rounds_off", "Request rounds the adaptive policy ran as a plain "
                                      "decode step.", labels=["model_name"])
            off.add_metric([self._model], st.get("spec_rounds_off", 0))
            yield off
            narrow = CounterMetricFamily("specpd:spec_rounds_narrow", "Request rounds the adaptive policy drafted "
                                         "narrow (the draft's best depth + 1 nodes).", labels=["model_name"])
            narrow.add_metric([self._model], st.get("spec_rounds_narrow", 0))
            yield narrow
            rounds = CounterMetricFamily("specpd:spec_rounds", "Request rounds planned by the adaptive policy.",
                                         labels=["model_name"])
            rounds.add_metric([self._model], st.get("spec_rounds", 0))
            yield rounds


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.requests_finished = Counter(
            "specpd:requests_finished", "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finish_reason"], registry=r)
        self.requests_rejected = Counter(
            "specpd:requests_rejected", "Requests refused before the engine, by offending field (400), or "
            "'body' (413), 'api_key' (401), 'queue' (503).",
            ["model_name", "param"], registry=r)
        self.prompt_tokens = Counter(
            "specpd:prompt_tokens", "Prompt tokens of admitted requests.", ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter(
            "specpd:generation_tokens", "Generated tokens.", ["model_name"], registry=r).labels(**labels)
        self.ttft = Histogram(
            "specpd:time_to_first_token_seconds", "Time from arrival to the first output token.",
            ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram(
            "specpd:time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            ["model_name"], buckets=_TPOT_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram(
            "specpd:e2e_request_latency_seconds", "Time from arrival to the final output.",
            ["model_name"], buckets=_E2E_BUCKETS, registry=r).labels(**labels)
        for name, key, doc in (
                ("specpd:num_requests_running", "num_running", "Requests in the running batch."),
                ("specpd:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
                ("specpd:kv_pages_free", "free_pages", "KV cache pages no request holds (free, or cached "
                 "and evictable)."),
                ("specpd:kv_pages_total", "total_pages", "Total KV cache pages."),
                ("specpd:prefix_cache_pages", "cached_pages", "KV pages held by the prefix cache."),
                ("specpd:prefix_cache_hit_tokens", "prefix_cache_hit_tokens",
                 "Prompt tokens taken from the prefix cache since start."),
                ("specpd:prefix_cache_query_tokens", "prefix_cache_query_tokens",
                 "Prompt tokens looked up in the prefix cache since start."),
                ("specpd:pd_kv_bytes", "kv_bytes", "PD prefill: KV bytes sent to decode servers since start "
                 "(per request: divide by specpd:pd_kv_transfers)."),
                ("specpd:pd_kv_transfers", "kv_transfers", "PD prefill: completed KV handoffs since start.")):
            gauge = Gauge(name, doc, ["model_name"], registry=r).labels(**labels)
            gauge.set_function(lambda key=key: float(stats().get(key, 0)))
        r.register(_SpecCollector(stats, model_name))
        self._model_name = model_name

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_finished(self, stream, out: RequestOutput, now: float) -> None:
        """`stream` is the RequestStream (arrival / first_token_time) of the request that just finished."""
        self.requests_finished.labels(self._model_name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        self.e2e.observe(now - stream.arrival)
        if stream.first_token_time is not None and out.num_output_tokens > 1:
            self.tpot.observe((now - stream.first_token_time) / (out.num_output_tokens - 1))

    def observe_rejected(self, param: str | None) -> None:
        field = (param or "none").split(".")[0].split("[")[0]  # messages[3].content -> messages
        self.requests_rejected.labels(self._model_name, field).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_GRAMMAR_COUNTERS = (  # engine stats key (specpd.grammar.matcher.GrammarStats) -> metric, help
    ("grammar_mask_seconds", "specpd:grammar_mask_seconds", "Time filling and applying structured-output masks "
     "(target rows, every draft-tree node, draft proposals); divide by grammar_mask_steps for the time per step."),
    ("grammar_mask_calls", "specpd:grammar_mask_steps", "Target masking passes (one per constrained request per step)."),
    ("grammar_compiles", "specpd:grammar_compiles", "Constraints compiled (cache misses, failures included)."),
    ("grammar_compile_cache_hits", "specpd:grammar_compile_cache_hits", "Constraint compiles served from the cache."),
    ("grammar_compile_seconds", "specpd:grammar_compile_seconds", "Time compiling constraints (worker threads)."))


def _grammar_metrics(st: dict[str, Any], model: str):
    """Structured-output counters, once a constrained request has built the grammar backend."""
    from prometheus_client.core import CounterMetricFamily
    if "grammar_mask_seconds" not in st:
        return
    for key, name, doc in _GRAMMAR_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], st.get(key, 0))
        yield family
