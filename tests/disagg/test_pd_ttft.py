"""The PD TTFT breakdown and y0 leaving D at once, over real processes on 127.0.0.1 (router -> P + D, a small
random Llama with a random EAGLE-3 head, draft-on-decode-only, the adaptive policy pinned, chunked prefill of
64 tokens so a 200-token prompt is 4 chunks on P).

- Every stage of specpd/disagg/timeline.py is counted once per request on the server that measures it (P's
  `p_prefill_chunk` once per chunk, D's `d_draft_extend_chunk` once per chunk of features it was sent), in
  /metrics (a summary with p50 / p99) and /server_info; each room has
  one debug log line on P and one on D; durations that contain others (each on its own clock) are not
  shorter than them (D's wait for the record covers P's prefill once P had D's destination; the router's
  TTFT covers D's).
- The streamed tokens and acceptance counts equal the unified engine's; D's commit -> first token out and
  D's decode step are printed, not bounded (a loaded or a fast box moves both).
- y0 leaves D when D commits, not after D's next forward (in one process, D stepped by hand: the step that
  commits a room returns y0 alone, before any forward of D has scheduled the request).
"""
import json
import statistics
import time

import httpx
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.disagg.timeline import STAGES
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from specpd.server.launch import free_port
from tests.model.hf_models import save_tiny_model
from tests.server.launcher import launch_servers

MODEL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=4096)
CHUNK = 64
PROMPT_LEN = 200  # 4 chunks of <= 64
PROMPTS = [[(7 * j + 3 * i) % 300 + 10 for j in range(PROMPT_LEN)] for i in range(5)]
MAX_TOKENS = 16
SPEC = ["--speculative-algorithm", "eagle3", "--spec-num-steps", "3", "--draft-mode", "decode-only",
        "--spec-adaptive-pinned"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny_llama_ttft")
    save_tiny_model("llama", model, **MODEL)
    draft = str(tmp_path_factory.mktemp("eagle3_ttft"))
    random_draft_checkpoint(draft, "eagle3", ModelConfig.from_hf(load_checkpoint(str(model)).hf_config), seed=2)
    return str(model), draft


def unified(model_dir: str, draft_dir: str) -> list[tuple[list[int], int, int]]:
    """(tokens, verify forwards, accepted) per prompt, one request at a time as the client sends them."""
    spec = SpecConfig("eagle3", draft_model=draft_dir, spec_num_steps=3, draft_mode="decode-only",
                      spec_adaptive_pinned=True)
    threads = torch.get_num_threads()
    try:  # one thread, as the servers run: more only fight the servers for this box's cores
        engine = LLMEngine(EngineConfig(model=model_dir, spec=spec, cache=CacheConfig(page_size=16, num_pages=256),
                                        scheduler=SchedulerConfig(chunked_prefill_size=CHUNK), num_threads=1))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = [engine.generate([p], params)[0] for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    return [(o.token_ids, o.spec_verify_count, o.spec_accepted_tokens) for o in outs]


def stream(client: httpx.Client, prompt: list[int]) -> tuple[list[int], dict, list[float]]:
    """Tokens, usage, and the arrival time of every data chunk of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    tokens, usage, arrivals = [], None, []
    with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            arrivals.append(time.monotonic())
            tokens += [int(t.removeprefix("token_id:")) for t in chunk["choices"][0]["logprobs"]["tokens"]]
    return tokens, usage, arrivals


def stage_lines(metrics_text: str, stage: str) -> list[str]:
    return [line for line in metrics_text.splitlines()
            if line.startswith("specpd:pd_stage_seconds") and f'stage="{stage}"' in line]


def test_ttft_breakdown_and_y0_leaves_at_once(dirs):
    model_dir, draft_dir = dirs
    want = unified(model_dir, draft_dir)
    boot = free_port()
    engine = ["--model", model_dir, "--page-size", "16", "--num-pages", "256", "--num-threads", "1",
              "--chunked-prefill-size", str(CHUNK), "--transfer-backend", "tcp", *SPEC, "--draft-model", draft_dir]
    specs = [["--role", "prefill", "--bootstrap-port", str(boot), "--log-level", "debug", *engine],
             ["--role", "decode", "--log-level", "debug", *engine]]
    with launch_servers(specs, 120) as procs:
        (_, p_url, p_log), (_, d_url, d_log) = procs
        router_spec = [["--role", "router", "--prefill", p_url, "--decode", d_url, "--bootstrap-port", str(boot),
                        "--log-level", "warning"]]
        with launch_servers(router_spec, 60) as [(_, router, _)], httpx.Client(base_url=router, timeout=60) as client:
            gaps = []
            for prompt, (tokens, verifies, accepted) in zip(PROMPTS, want):
                got, usage, arrivals = stream(client, prompt)
                assert got == tokens
                assert (usage["spec_verify_count"], usage["spec_accepted_tokens"]) == (verifies, accepted)
                gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]  # one of D's decode steps each
            n = len(PROMPTS)  # distinct first tokens: no prefix cache hit shortens a prefill
            stages = {}
            for role, url in (("router", router), ("p", p_url), ("d", d_url)):
                info = httpx.get(url + "/server_info").json()
                metrics = httpx.get(url + "/metrics").text
                for stage in (s for s in STAGES if s.startswith(role + "_")):
                    want_count = n * 4 if stage == "p_prefill_chunk" else n
                    if stage == "d_draft_extend_chunk":  # one per TargetFeatures: chunks computed before D's
                        # destination go with the next; the last chunk's always goes ahead of the record
                        want_count = info["pd_stages"][stage]["count"]
                        assert n <= want_count <= n * 4, info["pd_stages"][stage]
                    assert info["pd_stages"][stage]["count"] == want_count, (stage, info["pd_stages"])
                    lines = stage_lines(metrics, stage)
                    assert any('quantile="0.99"' in line for line in lines), (stage, lines)
                    assert any(line.startswith("specpd:pd_stage_seconds_count") and line.endswith(f" {want_count}.0")
                               for line in lines), (stage, lines)
                    stages[stage] = info["pd_stages"][stage]
        p_text, d_text = open(p_log).read(), open(d_log).read()  # the launcher removes the logs on exit
    s = {name: v["sum_s"] for name, v in stages.items()}
    rounding = 1e-5  # sum_s is rounded to the microsecond
    # every containment is causal (each start mark is taken before the message that starts the other stage
    # leaves, each end mark after the message that ends it came), so it holds however the OS schedules.
    # D's wait for the record contains P's prefill after P had D's destination (optimistic prefill: P may start
    # before D offers its pages, by at most P's own wait for the destination)
    assert s["d_wait_record"] >= s["p_prefill"] + s["p_record"] - s["p_wait_destination"] - rounding, s
    assert s["router_ttft"] >= s["d_ttft"] - rounding, s
    assert s["d_ttft"] >= s["d_wait_record"] + s["d_wait_kv"] - rounding, s
    assert s["p_total"] >= s["p_prefill"] + s["p_kv_write"] - rounding, s
    assert s["p_prefill"] >= s["p_prefill_chunk"] - rounding, s
    # y0 out at commit is test_y0_leaves_d_before_the_forward_that_decodes_it's (no clock); here it is measured
    step = statistics.median(gaps)
    print(f"\nd_first_token_out {stages['d_first_token_out']}, D step (median gap between streamed chunks) "
          f"{1000 * step:.2f} ms")
    p_lines = [line for line in p_text.splitlines() if f"({PROMPT_LEN} tokens, 4 chunks): p_admit" in line]
    d_lines = [line for line in d_text.splitlines() if f"({PROMPT_LEN} tokens): d_admit" in line]
    assert len(p_lines) == len(d_lines) == n, (len(p_lines), len(d_lines))
    assert all("p_prefill_chunk [" in line and "p_kv_write" in line for line in p_lines)
    assert all("d_first_token_out" in line for line in d_lines)


@pytest.mark.parametrize("spec", [False, True], ids=["non-spec", "eagle3-decode-only"])
def test_y0_leaves_d_before_the_forward_that_decodes_it(dirs, spec):
    """P and D in this process, stepped by hand, one room at a time as the client above sends them: the D step
    that commits a room returns its y0 alone, and no forward of D has scheduled the request yet (y0 used to
    leave with the outputs of the forward that decodes it). Causal, so no box is too slow or too fast for it."""
    from specpd.disagg.worker import BootstrapInfo
    from tests.disagg.handoff_helpers import make_workers
    model_dir, draft_dir = dirs
    cfg = SpecConfig("eagle3", draft_model=draft_dir, spec_num_steps=3, draft_mode="decode-only",
                     spec_adaptive_pinned=True) if spec else None
    p, d = make_workers(model_dir, cfg, page_size=16, local_prefill_tokens=0)  # every room prefilled on P
    scheduled: set[str] = set()  # request ids any of D's forwards has scheduled
    schedule = d.engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        scheduled.update(item.request.request_id for item in batch.items)
        return batch

    d.engine.scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            info = BootstrapInfo("127.0.0.1", p.bootstrap.port, 3000 + i)
            p.expect(f"p{i}", info)
            p.add_request(f"p{i}", prompt[:40], params)
            d.bootstrap(f"d{i}", info)
            d.add_request(f"d{i}", prompt[:40], params)
            first, final, deadline = None, None, time.monotonic() + 120
            while final is None:
                assert time.monotonic() < deadline, f"room {i} never finished on D"
                p.step()
                for out in d.step():
                    assert out.request_id == f"d{i}" and out.error is None, out
                    if first is None and out.new_token_ids:
                        first = (list(out.new_token_ids), out.request_id in scheduled)
                    if out.finished:
                        final = out
            assert first == ([final.token_ids[0]], False), (first, final.token_ids)
            assert len(final.token_ids) == params.max_tokens
        assert p.free_pages == d.free_pages == 64
    finally:
        p.close()
        d.close()
