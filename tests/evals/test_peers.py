"""The pure parts of evals/peers.py (no server): metrics parsing, τ, parity, summaries, the plan."""
import argparse

from evals import peers_report
from evals import peers_servers as peers

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="default"} 15.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="default"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="default"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="default",position="0"} 7.0
vllm:num_requests_running{engine="0",model_name="default"} NaN
"""


def test_parse_prometheus_sums_labelled_samples_and_ignores_other_metrics():
    got = peers.parse_prometheus(VLLM_METRICS + 'vllm:spec_decode_num_drafts_total{engine="1"} 5\n',
                                 peers.VLLM_SPEC_COUNTERS)
    assert got == {"vllm:spec_decode_num_accepted_tokens_total": 9.0, "vllm:spec_decode_num_drafts_total": 20.0,
                   "vllm:spec_decode_num_draft_tokens_total": 45.0}


def test_vllm_tau_is_one_plus_accepted_per_draft_over_the_cell():
    before = peers.parse_prometheus(VLLM_METRICS, peers.VLLM_SPEC_COUNTERS)
    after = {"vllm:spec_decode_num_accepted_tokens_total": 9.0 + 30, "vllm:spec_decode_num_drafts_total": 15.0 + 20,
             "vllm:spec_decode_num_draft_tokens_total": 45.0 + 60}
    got = peers.vllm_tau(before, after)
    assert got["tau"] == 1 + 30 / 20 and got["drafts"] == 20 and got["acceptance_rate"] == 0.5
    assert peers.vllm_tau(before, before) is None  # no verify in the cell: no τ


def test_specpd_counters_from_server_info():
    assert peers.specpd_counters({"spec_accept_length": 2.5, "spec_verify_count": 10}) == (25.0, 10.0, 0, 0)
    assert peers.specpd_counters({"spec_accept_length": None, "spec_verify_count": 0}) == (0.0, 0.0, 0, 0)
    info = {"spec_accept_length": 2.0, "spec_verify_count": 6, "spec_rounds": 10, "spec_rounds_off": 4}
    assert peers.specpd_counters(info) == (12.0, 6.0, 10, 4)
    assert peers.specpd_counters(None) == (0.0, 0.0, 0, 0)


def test_matching_prefix_and_parity_report():
    assert peers_report.matching_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert peers_report.matching_prefix([1, 2], [1, 2]) == 2
    assert peers_report.matching_prefix("error: x", [1]) is None
    servers = {"specpd/plain/fp32": {"reps": [{"parity_tokens": [[1, 2, 3], [4, 5, 6]]}]},
               "vllm/plain/fp32": {"reps": [{"parity_tokens": [[1, 2, 3], [4, 5, 6]]}]},
               "vllm/plain/bf16": {"reps": [{"failed": "x"}, {"parity_tokens": [[1, 9, 3], [4, 5, 6]]}]}}
    got = peers_report.parity_report(servers, 2, 3)["servers"]
    assert got["vllm/plain/fp32"] == {"vs_specpd/plain/fp32": {"matching_prefix": [3, 3], "equal": True}}
    assert got["vllm/plain/bf16"] == {"vs_specpd/plain/fp32": {"matching_prefix": [1, 3], "equal": False}}
    assert got["specpd/plain/fp32"] == {}


def test_summarize_cell_takes_medians_and_spreads_over_reps():
    reps = [{"num_errors": 0, "tpot_p50_s": t, "tpot_p99_s": 2 * t, "ttft_p50_s": 0.1, "output_tok_s": 1 / t,
             "tau": None} for t in (0.05, 0.04, 0.06)]
    got = peers_report.summarize_cell(reps)
    assert round(got["tpot_p50_ms"], 6) == 50.0 and [round(x, 6) for x in got["tpot_p50_ms_spread"]] == [40.0, 60.0]
    assert got["tau"] is None and got["tau_spread"] is None and got["reps"] == 3


def test_unsupported_cells_name_their_reason():
    assert "GGUF" in peers.unsupported("llamacpp", "eagle3", "q4_1")
    assert peers.unsupported("llamacpp", "ngram", "q4_1") is None
    assert peers.unsupported("vllm", "eagle3", "bf16") is None


def test_specpd_gets_a_dtype_flag_only_off_its_default():
    assert "--dtype" not in peers.specpd_spec("plain", "fp32", "float32").cmd
    assert peers.specpd_spec("eagle3", "bf16", "float32").cmd[-2:] == ("--dtype", "bfloat16")
    assert "--dtype" not in peers.specpd_spec("ngram", "bf16", "bfloat16").cmd


def test_estimate_uses_measured_startup_and_throughput():
    spec = peers.specpd_spec("plain", "fp32", "float32")
    args = argparse.Namespace(concurrency=[1], requests=8, max_tokens=96, workloads=["chat"], reps=2)
    report = {"servers": {spec.name: {"reps": [{"startup_s": 5.0, "cells": {"chat/c1": {"output_tok_s": 96.0}}}]}}}
    assert peers_report.estimate_s(args, [spec], report) == 2 * (5.0 + 10.0 + 8 * 96 / 96.0)


def test_pairs_compare_each_server_with_specpd_plain_rep_by_rep():
    def rep(tok_s, tpot):
        return {"cells": {"chat/c8": {"output_tok_s": tok_s, "tpot_p50_s": tpot}}}
    servers = {"specpd/plain/bf16": {"reps": [rep(100, 0.02), {"failed": "x"}, rep(200, 0.01)]},
               "specpd/eagle3/bf16": {"reps": [rep(110, 0.01), rep(999, 0.001), rep(150, 0.02)]},
               "vllm/plain/fp32": {"reps": [rep(50, 0.04)]}}
    got = peers_report.pairs(servers, ["chat/c8"])
    assert set(got) == {"specpd/eagle3/bf16"}  # no plain server at fp32 to compare with; plain is the reference
    cell = got["specpd/eagle3/bf16"]["chat/c8"]
    assert cell["tok_s_ratios"] == [1.1, 0.75]  # rep 1 of plain failed: that rep pairs nothing
    assert cell["tok_s_ratio_spread"] == [0.75, 1.1] and abs(cell["tok_s_ratio"] - 0.925) < 1e-9
    assert cell["tpot_speedup_spread"] == [0.5, 2.0]


def test_a_specpd_cells_tau_and_depth0_share_come_from_the_counters_around_it():
    import types
    from evals import peers_client
    run = types.SimpleNamespace(spec=types.SimpleNamespace(engine="specpd"))
    rows = [{"spec_verify_count": 4, "spec_accept_length": 2.5}, {"spec_verify_count": 0}, {"error": "x"}]
    got = peers_client.tau_of(run, rows, (10.0, 5.0, 20, 8), (20.0, 9.0, 30, 14))
    assert got == {"tau": 2.5, "verify_rounds": 4, "tau_server_info": 2.5, "depth0_share": 0.6}
    assert peers_client.tau_of(run, [], (0.0, 0.0, 5, 5), (0.0, 0.0, 5, 5))["depth0_share"] is None


def test_paired_c1_runs_each_prompt_on_every_server_in_turn_the_order_rotated(monkeypatch):
    import types
    from evals import peers_client
    calls = []

    def fake_cell(base, prompts, concurrency, max_tokens):
        calls.append((base, prompts[0][0]))
        return [{"ttft_s": 0.01, "tpot_s": 0.001 * len(base), "tokens": max_tokens, "chunks": max_tokens}], 0.5

    monkeypatch.setattr(peers_client, "run_cell", fake_cell)
    monkeypatch.setattr(peers_client, "tau_probe", lambda run: (0.0, 0.0, 0, 0))
    monkeypatch.setattr(peers_client.time, "sleep", lambda s: None)
    runs = [types.SimpleNamespace(spec=types.SimpleNamespace(name=n, engine="specpd"), base=b)
            for n, b in (("plain", "a"), ("spec", "bb"))]
    entries = {"plain": {"cells": {}}, "spec": {"cells": {}}}
    args = types.SimpleNamespace(max_tokens=8)
    peers_client.measure_interleaved(runs, entries, "chat", [[1], [2], [3]], args, gap_s=0.0)
    assert calls == [("a", 1), ("bb", 1), ("bb", 2), ("a", 2), ("a", 3), ("bb", 3)]
    for name, tpot in (("plain", 1.0), ("spec", 2.0)):
        cell = entries[name]["cells"]["chat/c1"]
        assert cell["requests"] == 3 and cell["wall_s"] == 1.5 and cell["output_tok_s"] == 24 / 1.5
        assert abs(cell["tpot_p50_s"] * 1e3 - tpot) < 1e-9
        assert cell["tpot_s_by_prompt"] == [tpot / 1e3] * 3  # in the prompts' order, for pairs' pooled ratio


def test_c1_pairs_pool_every_reps_requests_prompt_by_prompt():
    def rep(plain_or_spec, scale):
        tpots = [0.010 * (1 + i / 10) * scale for i in range(6)]  # prompt i: its own TPOT on either server
        if plain_or_spec == "spec":
            tpots = [t / (1.5 if i % 2 else 1.2) for i, t in enumerate(tpots)]
        return {"cells": {"chat/c1": {"output_tok_s": 100.0, "tpot_p50_s": tpots[3], "tpot_s_by_prompt": tpots}}}
    servers = {"specpd/plain/bf16": {"reps": [rep("plain", 1.0), rep("plain", 1.3)]},
               "specpd/eagle3/bf16": {"reps": [rep("spec", 1.0), rep("spec", 1.3)]}}
    cell = peers_report.pairs(servers, ["chat/c1"])["specpd/eagle3/bf16"]["chat/c1"]
    assert cell["pooled_requests"] == 12
    assert abs(cell["tpot_speedup_by_prompt"] - 1.35) < 1e-9  # six prompt pairs at 1.2, six at 1.5
    assert abs(cell["tpot_speedup_by_prompt_10_90"][0] - 1.2) < 1e-9
    assert abs(cell["tpot_speedup_by_prompt_10_90"][1] - 1.5) < 1e-9
    plain = sorted(0.010 * (1 + i / 10) * s for s in (1.0, 1.3) for i in range(6))
    spec = sorted(0.010 * (1 + i / 10) * s / (1.5 if i % 2 else 1.2) for s in (1.0, 1.3) for i in range(6))
    want = (plain[5] + plain[6]) / (spec[5] + spec[6])
    assert abs(cell["tpot_speedup_pooled"] - want) < 1e-9
    servers["specpd/plain/bf16"]["reps"][0]["cells"]["chat/c1"].pop("tpot_s_by_prompt")  # an older run's file
    servers["specpd/plain/bf16"]["reps"][1]["cells"]["chat/c1"].pop("tpot_s_by_prompt")
    assert "tpot_speedup_pooled" not in peers_report.pairs(servers, ["chat/c1"])["specpd/eagle3/bf16"]["chat/c1"]


def test_cells_take_more_requests_than_their_clients():
    from evals import peers as bench_peers
    args = argparse.Namespace(requests=None)
    assert bench_peers.requests_per_cell(args, 1) == bench_peers.C1_REQUESTS > 8
    assert bench_peers.requests_per_cell(args, 8) == 32 and bench_peers.requests_per_cell(args, 32) == 64
    assert bench_peers.requests_per_cell(argparse.Namespace(requests=5), 1) == 5
