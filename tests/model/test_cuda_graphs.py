"""CUDA graphs in the engine (specpd/model/cuda_graphs.py), checked on CPU through their padded static-buffer path
run without capture (--cuda-graph-eager): every forward a graph would replay (decode rows, tree verify rows, the
draft's extend and tree / chain steps) gives the plain eager path's hidden states and logits, the greedy tokens of
an engine without graphs, reads the same metadata storage every step, and gives its pages back; configurations
that cannot run are refused at start-up. Captured replay against eager runs in tests/gpu/test_cuda_graphs.py.
"""
from __future__ import annotations

import pytest
import torch

from specpd.attention.flashinfer_backend import FlashInferAttentionBackend
from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.cuda_graphs import graphs_on
from specpd.model.loader import load_checkpoint
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [7], list(range(100, 113))]
NUM_PAGES = 256
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    return str(path)


def engine(path, graphs: bool, backend="torch", spec=None, max_bs=8, layers=None):
    return LLMEngine(EngineConfig(model=path, attention_backend=backend, max_model_len=256, cuda_graphs=graphs,
                                  cuda_graph_eager=graphs, cuda_graph_max_bs=max_bs,
                                  cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=16), spec=spec or SpecConfig()))


def tokens(eng, prompts=PROMPTS, max_tokens=21):
    start = eng.free_pages
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert eng.free_pages == start
    return [o.token_ids for o in outs]


class EagerTwin:
    """Runs each forward the graph runner served again on the plain eager path, and compares the outputs."""

    def __init__(self, graph_runner, eager, logits=None, tol=TOL):
        self.compared, self.ptrs = 0, set()
        run, forward = graph_runner.run, graph_runner.forward

        def recording_forward(ids, positions, meta, hidden, rows, variant):
            self.ptrs.add(tuple(t.data_ptr() for t in (meta.qo_indptr, meta.kv_lens, meta.page_table,
                                                        meta.write_pages, ids, positions)))
            return forward(ids, positions, meta, hidden, rows, variant)

        def twin(*args, **kw):
            out = run(*args, **kw)
            if out is not None:
                want = eager(*args, **kw)
                for got, exp in zip(out, want):
                    torch.testing.assert_close(got, exp, **tol)
                if logits is not None:
                    torch.testing.assert_close(logits(out[0]), logits(want[0]), **tol)
                self.compared += 1
            return out

        graph_runner.run, graph_runner.forward = twin, recording_forward


def twin_target(runner, tol=TOL) -> EagerTwin:
    graphs = runner.graphs

    def eager(ids, positions, q_lens, kv_lens, page_lists, tree_masks=None, variant=()):
        runner.graphs = None
        try:
            hidden, captured = runner.forward(ids, positions, q_lens, kv_lens, page_lists, tree_masks, variant[0])
        finally:
            runner.graphs = graphs
        return (hidden, *captured)
    return EagerTwin(graphs, eager, runner.model.compute_logits, tol)


def twin_draft(proposer, tol=TOL) -> EagerTwin:
    graphs = proposer.graphs

    def eager(ids, positions, q_lens, kv_lens, pages, tree_masks=None, hidden=None, last_only=False, variant=()):
        proposer.graphs = None
        try:
            return (proposer._run(ids, hidden, positions, q_lens, kv_lens, pages, variant[0], tree_masks,
                                  last_only),)
        finally:
            proposer.graphs = graphs
    return EagerTwin(graphs, eager, tol=tol)


def test_decode_padded_path_equals_eager(target):
    expected = tokens(engine(target, False))
    eng = engine(target, True, max_bs=4)
    assert eng.free_pages == NUM_PAGES - 1  # the scratch page pad rows write, never a request's
    twin = twin_target(eng.runner)
    assert tokens(eng) == expected
    assert twin.compared >= 20 and eng.runner.graphs.num_graphs >= 1
    assert len(twin.ptrs) == 1  # one storage for every step and every bucket
    small = engine(target, True, max_bs=2)  # past the largest bucket: eager
    small_twin = twin_target(small.runner)
    assert tokens(small) == expected and small_twin.compared < twin.compared


@pytest.mark.parametrize("algorithm,topk,num_tokens", [("eagle3", 3, 8), ("eagle", 1, None), ("mtp", 2, 5)],
                         ids=["eagle3_tree", "eagle_chain", "mtp_tree"])
def test_speculation_padded_path_equals_eager(target, tmp_path, algorithm, topk, num_tokens):
    cfg = ModelConfig.from_hf(load_checkpoint(target).hf_config)
    random_draft_checkpoint(str(tmp_path), algorithm, cfg, seed=1)
    spec = SpecConfig(algorithm, draft_model=str(tmp_path), spec_num_steps=3, spec_topk=topk,
                      spec_num_draft_tokens=num_tokens, spec_adaptive_pinned=True, spec_ngram=False)
    expected = tokens(engine(target, False))
    eng = engine(target, True, spec=spec)
    target_twin = twin_target(eng.runner)
    draft_twin = twin_draft(eng.spec_runner.proposer)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected  # lossless through the padded path
    assert all(o.spec_verify_count > 0 for o in outs)
    assert target_twin.compared > 5 and draft_twin.compared > 5
    assert len(target_twin.ptrs) == 1 and len(draft_twin.ptrs) == 1
    assert eng.free_pages == NUM_PAGES - 1


def test_ngram_trees_through_the_padded_path(target):
    eng = engine(target, True, spec=SpecConfig("ngram", spec_num_steps=4, spec_topk=2, spec_num_draft_tokens=6,
                                                spec_adaptive_pinned=True))
    twin = twin_target(eng.runner)
    assert tokens(eng, [p * 3 for p in PROMPTS]) == tokens(engine(target, False), [p * 3 for p in PROMPTS])
    assert twin.compared > 5


@pytest.mark.triton_interpreter
def test_triton_padded_path_equals_eager_under_the_interpreter(tmp_path):
    """The Triton kernels through the padded static path (interpreted: small), a tree draft and verify."""
    save_tiny_model("llama", tmp_path / "t", num_hidden_layers=2)
    target = str(tmp_path / "t")
    cfg = ModelConfig.from_hf(load_checkpoint(target).hf_config)
    random_draft_checkpoint(str(tmp_path / "d"), "eagle", cfg, seed=1)
    spec = SpecConfig("eagle", draft_model=str(tmp_path / "d"), spec_num_steps=2, spec_topk=2,
                      spec_num_draft_tokens=4, spec_adaptive_pinned=True, spec_ngram=False)
    prompts = [PROMPTS[0], PROMPTS[3]]
    expected = tokens(engine(target, False, "triton"), prompts, 5)
    eng = engine(target, True, "triton", spec=spec)
    target_twin, draft_twin = twin_target(eng.runner), twin_draft(eng.spec_runner.proposer)
    assert tokens(eng, prompts, 5) == expected
    assert target_twin.compared > 1 and draft_twin.compared > 1


# ---- start-up refusals and resolution ----

def test_resolution_of_auto():
    gpu = EngineConfig(device="cuda").resolved()
    assert graphs_on(gpu) and gpu.attention_backend == "triton"
    assert not graphs_on(EngineConfig(device="cuda", tp_size=2).resolved())
    assert not graphs_on(EngineConfig(device="cpu").resolved())
    assert graphs_on(EngineConfig(device="cuda", attention_backend="torch").resolved())
    assert not graphs_on(EngineConfig(device="cuda", attention_backend="flashinfer").resolved())  # chosen: no graphs
    no_graphs = EngineConfig(device="cuda", cuda_graphs=False).resolved().attention_backend
    assert no_graphs in ("flashinfer", "triton")  # flashinfer where it is installed
    assert EngineConfig(device="cpu", cuda_graphs=True, cuda_graph_eager=True).resolved().attention_backend != "triton"


@pytest.mark.parametrize("overrides,match", [
    (dict(cuda_graphs=True), r"--cuda-graphs needs --device cuda \(got --device cpu\)"),
    (dict(cuda_graphs=True, cuda_graph_eager=True, tp_size=2), r"--cuda-graphs runs at --tp-size 1 only \(got "
                                                                r"--tp-size 2\)"),
    (dict(cuda_graphs=True, cuda_graph_eager=True, attention_backend="flashinfer"),
     r"--attention-backend flashinfer cannot: use --no-cuda-graphs"),
    (dict(cuda_graphs=True, cuda_graph_eager=True, attention_backend="cpu"), r"--attention-backend cpu cannot"),
    (dict(cuda_graphs=True, cuda_graph_eager=True, cuda_graph_max_bs=0), r"--cuda-graph-max-bs must be >= 1"),
])
def test_unrunnable_configurations_are_refused_at_start(target, overrides, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=target, cache=CacheConfig(page_size=4, num_pages=16), **overrides))


def test_a_tree_config_needs_a_backend_with_tree_masks(target, monkeypatch):
    monkeypatch.setattr(FlashInferAttentionBackend, "tree_masks", False)
    tree = SpecConfig("ngram", spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=5)
    with pytest.raises(ValueError, match=r"--attention-backend flashinfer has no tree masks, which "
                                         r"--speculative-algorithm ngram drafts trees with \(--spec-topk 2"):
        LLMEngine(EngineConfig(model=target, attention_backend="flashinfer", cuda_graphs=False, spec=tree,
                               cache=CacheConfig(page_size=4, num_pages=16)))
    chain = SpecConfig("ngram", spec_num_steps=3, spec_topk=1)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):  # past the check: the backend itself
        LLMEngine(EngineConfig(model=target, attention_backend="flashinfer", cuda_graphs=False, spec=chain,
                               cache=CacheConfig(page_size=4, num_pages=16)))
