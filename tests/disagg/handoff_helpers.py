"""PD handoff helpers shared by the one-process handoff tests (test_handoff.py, test_handoff_failures.py) and
others that drive a PrefillWorker and a DecodeWorker by hand."""
import time

import pytest

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), [7], list(range(1, 33))]  # 32: a page-aligned prompt
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model("llama", path)
    return str(path)


def make_engine(model_dir, page_size=4, spec=None, with_draft=True):
    return LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=page_size, num_pages=64),
                                  scheduler=SchedulerConfig(chunked_prefill_size=8), spec=spec or SpecConfig()),
                     with_draft=with_draft)


def make_workers(model_dir, spec=None, page_size=4, **decode_kwargs):
    """P and D over tcp; in draft-on-decode-only mode P loads no draft (as `specpd serve` builds it)."""
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    decode_only = spec is not None and spec.draft_mode == "decode-only"
    p = PrefillWorker(make_engine(model_dir, page_size, spec, with_draft=not decode_only), "tcp",
                      bootstrap_port=0)
    d = DecodeWorker(make_engine(model_dir, page_size, spec), "tcp", **decode_kwargs)
    return p, d


FIRST_LOGPROB: dict = {}  # request id -> the logprob entry of its first output token (run_pd / run_unified)


def run_unified(engine, prompts, params) -> list:
    final = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"u{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_logprobs and out.request_id not in FIRST_LOGPROB:
                FIRST_LOGPROB[out.request_id] = out.new_logprobs[0]
            if out.finished:
                final[out.request_id] = out
    return [final[f"u{i}"] for i in range(len(prompts))]


def run_pd(p, d, prompts, params, room_base=1000):
    """Drive a PrefillWorker and a DecodeWorker by hand; returns the final outputs by request id."""
    from specpd.disagg.worker import BootstrapInfo
    for i, prompt in enumerate(prompts):
        info = BootstrapInfo("127.0.0.1", p.bootstrap.port, room_base + i)
        p.expect(f"p{i}", info)
        p.add_request(f"p{i}", prompt, params)
        d.bootstrap(f"d{i}", info)
        d.add_request(f"d{i}", prompt, params)
    final, deadline = {}, time.monotonic() + 60
    while (p.has_unfinished_requests() or d.has_unfinished_requests()) and time.monotonic() < deadline:
        for worker in (p, d):
            for out in worker.step():
                assert out.error is None, out.error
                if out.new_logprobs and out.request_id not in FIRST_LOGPROB:
                    FIRST_LOGPROB[out.request_id] = out.new_logprobs[0]
                if out.finished:
                    final[out.request_id] = out
    assert all(final[f"p{i}"].finish_reason == "handoff" for i in range(len(prompts)))
    return final
