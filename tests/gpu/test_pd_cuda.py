"""On a CUDA GPU: PD with both KV pools in GPU memory, pages moved by Mooncake between them.

A prefill and a decode worker over real ZMQ and a Mooncake transfer engine in one process (as
tests/disagg/test_handoff.py on CPU), their engines on the device with the defaults (CUDA graphs, Triton):
greedy output equal to the unified engine's on the device, plain and with EAGLE-3 trees in both draft modes,
and every page back on both sides. Mooncake's non-cuda wheel (the one `make install` puts in) cannot register
GPU memory: the test then skips and says so; the CUDA build is `pip install mooncake-transfer-engine`.
"""
from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.model.hf_models import save_tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0")
PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), [7], list(range(1, 33))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def mooncake_on_gpu() -> str | None:
    """Why Mooncake cannot move GPU memory here, or None."""
    pytest.importorskip("zmq", reason="pyzmq (the PD control plane) is not installed")
    from specpd.disagg.transfer import backend_available
    ok, why = backend_available("mooncake")
    if not ok:
        return f"mooncake does not load: {why}"
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        return ("only mooncake's non-cuda wheel is installed: it cannot register GPU memory (the CUDA build: pip "
                "install mooncake-transfer-engine)")
    return None


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, num_hidden_layers=8)
    return str(path)


def make_engine(path, spec=None, with_draft=True):
    return LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                  cache=CacheConfig(page_size=4, num_pages=128),
                                  scheduler=SchedulerConfig(chunked_prefill_size=8), spec=spec or SpecConfig()),
                     with_draft=with_draft)


@pytest.mark.parametrize("mode", ["plain", "both", "decode-only"])
def test_pd_over_mooncake_with_gpu_kv_equals_unified(target, tmp_path, mode):
    why = mooncake_on_gpu()
    if why:
        pytest.skip(why)
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from tests.disagg.handoff_helpers import run_pd
    spec = None
    if mode != "plain":
        random_draft_checkpoint(str(tmp_path), "eagle3", ModelConfig.from_hf(load_checkpoint(target).hf_config), 1)
        spec = SpecConfig("eagle3", draft_model=str(tmp_path), spec_num_steps=3, spec_topk=3,
                          spec_num_draft_tokens=6, spec_adaptive_pinned=True, spec_ngram=False, draft_mode=mode)
    expected = [o.token_ids for o in make_engine(target, spec).generate(PROMPTS, GREEDY)]
    p = PrefillWorker(make_engine(target, spec, with_draft=mode != "decode-only"), "mooncake", bootstrap_port=0)
    d = DecodeWorker(make_engine(target, spec), "mooncake")
    assert p.engine.runner.kv_pool.buffer.is_cuda and d.engine.runner.kv_pool.buffer.is_cuda
    p_free, d_free = p.free_pages, d.free_pages
    try:
        final = run_pd(p, d, PROMPTS, GREEDY)
        assert [final[f"d{i}"].token_ids for i in range(len(PROMPTS))] == expected
        assert p.free_pages == p_free and d.free_pages == d_free
    finally:
        p.close()
        d.close()
