"""What each decode server's adaptive speculation did, as the router reports it (/server_info, /metrics). No torch.

A decode server's /server_info carries its policy's counters and the cost model it calibrated at startup
(specpd/spec/policy.py, cost.py); the router puts every decode server's depth-0 share beside its tau
and its cost table, so a cluster whose D never (or always) speculates shows it, and why, in one place.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest


def decode_spec_summary(url: str, info: dict) -> dict:
    """One decode server's speculation at a glance, from its /server_info: how often its adaptive policy chose a
    plain step (depth 0) against tau, its probes, and the cost model it calibrated (clock, 1/2/4/8/16-row
    target and draft forwards in seconds, the online scales)."""
    policy = info.get("spec_policy") or {}
    cost = policy.get("cost_model") or {}

    def rows(table: dict | None) -> dict | None:
        return {r: table[r] for r in ("1", "2", "4", "8", "16") if r in table} if table else None
    return {"url": url, "spec_rounds": info.get("spec_rounds"), "spec_rounds_off_share": info.get("spec_rounds_off_share"),
            "spec_accept_length": info.get("spec_accept_length"), "spec_verify_count": info.get("spec_verify_count"),
            "spec_probes": info.get("spec_probes"), "accept": policy.get("accept"),
            "cost_model": {"clock": cost.get("clock"), "target_rows": rows(cost.get("target_rows")),
                           "draft_rows": rows(cost.get("draft_rows")),
                           "extend_rows": rows(cost.get("extend_rows")),
                           "per_request": cost.get("per_request"),
                           "tree_factor": cost.get("tree_factor"), "scale": cost.get("scale"),
                           "draft_scale": cost.get("draft_scale")} if cost else None}


def decode_spec_metrics(summaries: list[dict]) -> bytes:
    """Prometheus text for `decode_spec_summary`s: gauges labelled by decode server."""
    from prometheus_client.core import GaugeMetricFamily

    class _Collector:
        def collect(self):
            def family(name, doc, value_of, extra: tuple[str, ...] = ()):
                fam = GaugeMetricFamily(name, doc, labels=["decode", *extra])
                for s in summaries:
                    for labels, value in value_of(s):
                        if value is not None:
                            fam.add_metric([s["url"], *labels], float(value))
                return fam
            yield family("specpd:decode_spec_rounds_off_share", "Share of a decode server's request-rounds its "
                         "adaptive policy ran as a plain step (depth 0).", lambda s: [((), s["spec_rounds_off_share"])])
            yield family("specpd:decode_spec_accept_length", "A decode server's tau: tokens committed per verify "
                         "forward (bonus included).", lambda s: [((), s["spec_accept_length"])])
            yield family("specpd:decode_spec_rounds", "Request-rounds a decode server's adaptive policy planned.",
                         lambda s: [((), s["spec_rounds"])])
            yield family("specpd:decode_spec_probes", "Request-rounds a decode server's adaptive policy probed.",
                         lambda s: [((), s["spec_probes"])])

            def table(key):
                return lambda s: [((r,), v) for r, v in ((s["cost_model"] or {}).get(key) or {}).items()]
            yield family("specpd:decode_spec_cost_target_seconds", "A decode server's calibrated target forward by "
                         "rows (one request; before the online scale).", table("target_rows"), ("rows",))
            yield family("specpd:decode_spec_cost_draft_seconds", "A decode server's calibrated draft forward by "
                         "rows (before the online scales).", table("draft_rows"), ("rows",))
            yield family("specpd:decode_spec_cost_extend_seconds", "A decode server's calibrated draft extend (the "
                         "head on the last row) by rows (before the online scales).", table("extend_rows"), ("rows",))
            yield family("specpd:decode_spec_cost_scale", "Measured / calibrated seconds of a decode server's decode "
                         "rounds (the online scale on its table).", lambda s: [((), (s["cost_model"] or {}).get("scale"))])

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry)
