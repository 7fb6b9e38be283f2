"""On a CUDA GPU: forwards replayed from captured CUDA graphs against the same forwards run eagerly.

Every replayed forward (decode rows, tree verify rows, the draft's extend and steps) is run again on the plain
eager path and compared (tests/model/test_cuda_graphs.py's EagerTwin, there on the padded path without capture);
the engine with graphs gives an engine without them its greedy tokens (fp32: exactly; the same padded path in bf16
is measured by evals/gpu.py), the metadata every graph reads is one storage, and the pages come back.
Skipped without a CUDA device.
"""
from __future__ import annotations

import os

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from tests.model.hf_models import save_tiny_model
from tests.model.test_cuda_graphs import twin_draft, twin_target

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0 (the interpreter runs the kernels on the host)")

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [7], list(range(100, 113)), list(range(3, 60, 2))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TOL = dict(atol=2e-4, rtol=2e-4)  # fp32 on the device: eager and replay pick kernels for different row counts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, num_hidden_layers=8)
    return str(path)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    cfg = ModelConfig.from_hf(load_checkpoint(target).hf_config)
    out = {}
    for algorithm in ("eagle3", "eagle", "mtp"):
        path = tmp_path_factory.mktemp(algorithm)
        random_draft_checkpoint(str(path), algorithm, cfg, seed=1)
        out[algorithm] = str(path)
    return out


def engine(path, graphs, backend="triton", dtype="float32", spec=None, max_bs=4):
    return LLMEngine(EngineConfig(model=path, device="cuda", dtype=dtype, attention_backend=backend,
                                  cuda_graphs=graphs, cuda_graph_max_bs=max_bs, max_model_len=512,
                                  cache=CacheConfig(page_size=16, num_pages=256),
                                  scheduler=SchedulerConfig(chunked_prefill_size=32), spec=spec or SpecConfig()))


def tokens(eng, prompts=PROMPTS):
    start = eng.free_pages
    outs = eng.generate(prompts, GREEDY)
    assert eng.free_pages == start
    return [o.token_ids for o in outs]


SPECS = {
    "plain": None,
    "eagle3_tree": lambda h: SpecConfig("eagle3", draft_model=h["eagle3"], spec_num_steps=3, spec_topk=3,
                                        spec_num_draft_tokens=8, spec_adaptive_pinned=True, spec_ngram=False),
    "eagle_chain": lambda h: SpecConfig("eagle", draft_model=h["eagle"], spec_num_steps=3, spec_topk=1,
                                        spec_adaptive_pinned=True, spec_ngram=False),
    "mtp_hybrid": lambda h: SpecConfig("mtp", draft_model=h["mtp"], spec_adaptive_pinned=True),
    "ngram_tree": lambda h: SpecConfig("ngram", spec_num_steps=4, spec_topk=2, spec_num_draft_tokens=6,
                                       spec_adaptive_pinned=True),
}


# every drafter on triton (the GPU default); the torch backend's static plan on plain decoding and trees
CASES = [("triton", name) for name in SPECS] + [("torch", "plain"), ("torch", "eagle3_tree")]


@pytest.mark.parametrize("backend,name", CASES)
def test_replay_equals_eager_forward_by_forward(target, heads, backend, name):
    spec = SPECS[name](heads) if SPECS[name] else None
    eng = engine(target, True, backend, spec=spec)
    assert eng.runner.graphs.settings.capture
    target_twin = twin_target(eng.runner, TOL)
    proposer = eng.spec_runner.proposer if eng.spec_runner else None
    proposer = getattr(proposer, "model", proposer)  # hybrid: its draft model's proposer
    draft_twin = twin_draft(proposer, TOL) if getattr(proposer, "graphs", None) is not None else None
    tokens(eng)
    assert target_twin.compared > 5 and len(target_twin.ptrs) == 1
    if draft_twin is not None:
        assert draft_twin.compared > 5 and len(draft_twin.ptrs) == 1


@pytest.mark.parametrize("backend,name", CASES)
def test_graphs_give_the_eager_engines_tokens(target, heads, backend, name):
    spec = SPECS[name](heads) if SPECS[name] else None
    plain = tokens(engine(target, False, backend))
    assert tokens(engine(target, False, backend, spec=spec)) == plain  # speculation exact on the device
    graphed = engine(target, True, backend, spec=spec)
    assert tokens(graphed) == plain
    assert graphed.runner.graphs.num_graphs > 0


def test_past_the_largest_bucket_runs_eagerly(target):
    plain = tokens(engine(target, False))
    small = engine(target, True, max_bs=2)
    assert tokens(small) == plain
    assert {k.bucket for k in small.runner.graphs._graphs} <= {1, 2}
