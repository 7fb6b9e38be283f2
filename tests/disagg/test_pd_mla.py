"""PD with the MoE families and the checkpoint's own MTP layer, in one process: a PrefillWorker and a DecodeWorker
over real ZMQ and the tcp transfer backend (tests/disagg/handoff_helpers.py), tiny DeepSeek-V3 (MLA) and GLM-4.5
checkpoints whose MTP layer predicts its target (tests/model/moe_models.py):
  - the latent rows (DeepSeek) move in the page layout, one descriptor per page: whole pages with the MTP layer's
    rows in draft-on-both mode, the target's block of D's pages in decode-only mode (D runs the extend);
  - greedy output equals the unified engine's and the acceptance (verify rounds and accepted tokens, request by
    request) is the unified engine's with the pinned adaptive policy, in both draft modes; pages back on P and D;
  - a P whose page layout differs from D's is refused at bootstrap, both layouts named.
"""
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.disagg.messages import KV_LAYOUT, KVDestination
from specpd.engine.llm_engine import LLMEngine
from specpd.kv.latent_pool import LatentKVPool
from tests.disagg.handoff_helpers import run_pd
from tests.disagg.test_handoff import record_trees
from tests.model.moe_models import save_tiny_moe

PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), [7], list(range(1, 33))]  # 32: a page-aligned prompt
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PAGES = 96


@pytest.fixture(scope="module", params=["deepseek", "glm"])
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "-pd")
    save_tiny_moe(request.param, path, seed=1, nextn=1, predictable=0.3)
    return request.param, str(path)


def engine(path, spec=None, with_draft=True):
    return LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=4, num_pages=PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=8), spec=spec or SpecConfig()),
                     with_draft=with_draft)


def workers(path, spec):
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    decode_only = spec.draft_mode == "decode-only"
    return (PrefillWorker(engine(path, spec, with_draft=not decode_only), "tcp", bootstrap_port=0),
            DecodeWorker(engine(path, spec), "tcp"))


@pytest.mark.parametrize("policy", ["fixed", "pinned"])
@pytest.mark.parametrize("mode", ["both", "decode-only"])
def test_pd_equals_unified_with_the_checkpoints_mtp_layer(moe_dir, mode, policy):
    """fixed: every round at full depth, the prompts as one batch; pinned: the adaptive policy with its fixed cost
    table, one request at a time as a client sends them (a plan depends on the batch it is made for)."""
    family, path = moe_dir
    spec = SpecConfig("mtp", spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6, draft_mode=mode,
                      spec_adaptive=policy == "pinned", spec_adaptive_pinned=policy == "pinned", spec_ngram=False)
    unified = engine(path, spec)
    want_trees = record_trees(unified)
    batches = [PROMPTS] if policy == "fixed" else [[p] for p in PROMPTS]
    expected = [o for batch in batches for o in unified.generate(batch, GREEDY)]
    p, d = workers(path, spec)
    got_trees = record_trees(d.engine)
    try:
        pool = d.engine.runner.kv_pool
        assert isinstance(pool, LatentKVPool) == (family == "deepseek")
        assert (p.peer_config.kv_layout == pool.wire_layout) if family == "deepseek" else \
            p.peer_config.kv_layout == KV_LAYOUT
        assert d.engine.spec_runner.proposer.pool.parent is pool  # the MTP layer's rows in the target's pages
        d_page = d.backend.layouts[0].page_bytes
        assert d_page == pool.storage[0].numel() * pool.storage.element_size()
        if mode == "both":
            assert p.backend.layouts[0].page_bytes == d_page
        else:
            assert p.engine.spec_runner is None and p.backend.layouts[0].page_bytes < d_page
        assert sum(len(runs) for runs in p.kv.plan(KVDestination(0, tuple(d.kv.endpoints), [])).values()) == 1
        got = []
        for b, batch in enumerate(batches):
            final = run_pd(p, d, batch, GREEDY, room_base=1000 + 100 * b)
            got += [final[f"d{i}"] for i in range(len(batch))]
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [(o.spec_verify_count, o.spec_accepted_tokens) for o in got] == \
               [(o.spec_verify_count, o.spec_accepted_tokens) for o in expected]
        assert sum(o.spec_accepted_tokens for o in got) > sum(o.spec_verify_count for o in got) / 2  # tau > 1.5
        # every proposal: depth 1 from the first-round top-k, deeper nodes from the prompt's MTP rows and hidden
        assert {k: [t for t, _ in v] for k, v in got_trees.items()} == {k: [t for t, _ in v] for k, v in want_trees.items()}
        for prompt, rounds in want_trees.items():
            for (_, want_lp), (_, got_lp) in zip(rounds, got_trees[prompt]):
                assert torch.allclose(got_lp, want_lp, atol=1e-5), (prompt, got_lp, want_lp)
        assert p.free_pages == PAGES and d.free_pages == PAGES
    finally:
        p.close()
        d.close()


def test_a_prefill_with_another_page_layout_is_refused_naming_both(tmp_path):
    from specpd.core import InvalidRequest
    from specpd.disagg.decode import DecodeWorker
    from specpd.disagg.prefill import PrefillWorker
    from specpd.disagg.worker import BootstrapInfo
    save_tiny_moe("deepseek", tmp_path / "mla")
    save_tiny_moe("glm", tmp_path / "gqa")
    p = PrefillWorker(engine(str(tmp_path / "gqa")), "tcp", bootstrap_port=0)
    d = DecodeWorker(engine(str(tmp_path / "mla")), "tcp")
    try:
        latent = d.engine.runner.kv_pool.wire_layout
        with pytest.raises(InvalidRequest, match="kv_layout") as refused:
            d.bootstrap("d0", BootstrapInfo("127.0.0.1", p.bootstrap.port, 7))
        assert f"prefill={KV_LAYOUT!r} decode={latent!r}" in str(refused.value)
    finally:
        p.close()
        d.close()
