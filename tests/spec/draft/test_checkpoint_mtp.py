"""`--speculative-algorithm mtp` with no --draft-model: the target checkpoint's own NextN layers
(specpd/spec/draft/checkpoint_mtp.py) on tiny random DeepSeek-V3 (MLA) and GLM-4.5 (GQA) MoE checkpoints with random MTP
layers appended in the published layout (tests/model/moe_models.py):
  - the loaded draft computes the NextN math (a torch reference over transformers' own decoder layer) within 1e-4,
    over its latent (or K/V) rows inside the target's pages, on a ragged batch over scattered pages;
  - greedy speculation equals plain decoding token for token, chain and tree, one and two MTP layers, batched
    ragged prompts across page boundaries, every page back, with MTP layers that predict their target
    (save_tiny_moe's `predictable`: acceptance high, so accepted tree paths move their rows and the draft extends over
    them), and with the replay drafter putting the right token at sibling rank 1 (every round compacts a path);
  - a checkpoint with no MTP layers (or whose MTP weights were dropped) is refused, naming it.
"""
import random

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.kv.latent_pool import LatentKVPool
from tests.model.hf_models import save_tiny_model
from tests.model.moe_models import reference_mtp_logits, save_tiny_moe

PROMPTS = [[5, 17, 99, 3], list(range(40, 71)), [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SHAPES = {"chain": dict(spec_num_steps=3, spec_topk=1), "tree": dict(spec_num_steps=3, spec_topk=2,
                                                                     spec_num_draft_tokens=6)}


FAMILIES = ["deepseek", "deepseek-lite", "glm"]
PREDICTABLE = 0.3  # save_tiny_moe's damping: tau about 2 on these prompts


@pytest.fixture(scope="module", params=FAMILIES)
def moe_mtp(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "-mtp")
    model, mtp = save_tiny_moe(request.param, path, nextn=1, own_head=request.param != "glm")
    return request.param, str(path), model, mtp


@pytest.fixture(scope="module", params=FAMILIES)
def predictable_mtp(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "-predictable")
    save_tiny_moe(request.param, path, seed=1, nextn=1, predictable=PREDICTABLE)
    plain = LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(page_size=4, num_pages=160)))
    return request.param, str(path), [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def spec_engine(path, page_size=4, num_pages=160, chunk=512, **spec):
    return LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                                  scheduler=SchedulerConfig(chunked_prefill_size=chunk),
                                  spec=SpecConfig(speculative_algorithm="mtp", spec_ngram=False, **spec)))


def test_checkpoint_mtp_layer_computes_the_nextn_math(moe_mtp):
    family, path, model, mtp = moe_mtp
    engine = spec_engine(path, **SHAPES["chain"], spec_adaptive=False)
    proposer = engine.spec_runner.proposer
    draft = proposer.draft
    assert isinstance(proposer.pool, LatentKVPool) == family.startswith("deepseek")
    assert proposer.pool.storage is engine.runner.kv_pool.storage  # its layer is in the target's pages
    assert (draft.mtp[0].shared_head.head is not None) == (family != "glm")
    index = model.config.num_hidden_layers
    seqs = [list(range(40, 53)), [5, 17, 99, 3, 8, 250, 11]]
    allocator, page = proposer.pool.allocator, proposer.pool.page_size
    free = allocator.alloc(allocator.num_free)
    random.Random(5).shuffle(free)
    pages = [free[:4], free[4:6]]
    ids, hidden, positions, want = [], [], [], []
    for seq in seqs:
        with torch.no_grad():
            h = model.model(torch.tensor([seq])).last_hidden_state[0]  # the target's normed final hidden
        shifted = seq[1:] + [3]  # position p pairs x_{p+1} with h_p
        ids += shifted
        hidden.append(h)
        positions += list(range(len(seq)))
        want.append(reference_mtp_logits(family, model, mtp, index, shifted, h))
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata.build(lens, lens, pages, page)
    with torch.inference_mode():
        proposer.backend.plan(meta)
        out = draft(torch.tensor(ids), torch.cat(hidden), torch.tensor(positions), proposer.backend, meta)
        got = draft.compute_logits(out)
    want = torch.cat(want)
    assert (got - want).abs().max().item() <= 1e-4 and want.std().item() > 0.5
    allocator.free(free)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_speculation_equals_plain_decoding(predictable_mtp, shape):
    family, path, expected = predictable_mtp
    for page_size, chunk in ((4, 512), (16, 8)):
        engine = spec_engine(path, page_size=page_size, num_pages=640 // page_size, chunk=chunk, **SHAPES[shape],
                             spec_adaptive=False)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == expected, f"{family} {shape} page {page_size}"
        stats = engine.spec_stats
        assert stats.accepted_tokens / stats.verify_count > 0.5, "the MTP layer should predict its target"
        assert engine.free_pages == engine.total_pages


def test_replay_tree_paths_compact_the_rows(predictable_mtp):
    """The right token at sibling rank 1: every accepted path leaves the root's line, so its rows move."""
    family, path, expected = predictable_mtp
    engine = LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=4, num_pages=160),
                                    spec=SpecConfig("replay", spec_num_steps=3, spec_topk=3, spec_adaptive=False,
                                                    spec_num_draft_tokens=10)))
    proposer = engine.spec_runner.proposer
    proposer.right_rank = 1
    for i, (prompt, ref) in enumerate(zip(PROMPTS, expected)):
        proposer.references[f"r{i}"] = ref
        engine.add_request(f"r{i}", prompt, GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert [final[f"r{i}"].token_ids for i in range(len(PROMPTS))] == expected
    assert all(final[f"r{i}"].spec_accept_length > 3 for i in range(len(PROMPTS)))
    assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("family", ["deepseek", "glm"])
def test_two_mtp_layers_chain_through_their_modules(tmp_path, family):
    model, _ = save_tiny_moe(family, tmp_path, seed=3, nextn=2, predictable=PREDICTABLE)
    engine = spec_engine(str(tmp_path), **SHAPES["tree"], spec_adaptive=False)
    draft = engine.spec_runner.proposer.draft
    assert len(draft.mtp) == 2 and engine.runner.kv_pool.extra_layers == 2
    plain = LLMEngine(EngineConfig(model=str(tmp_path), cache=CacheConfig(page_size=4, num_pages=160)))
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert engine.spec_stats.accepted_tokens > engine.spec_stats.verify_count / 2
    assert engine.free_pages == engine.total_pages


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"has none \(num_nextn_predict_layers = 0\): pass --draft-model"):
        spec_engine(str(tmp_path / "llama"))
    save_tiny_moe("deepseek", tmp_path / "dropped")  # config.json says 1 layer, transformers wrote no weights
    with pytest.raises(ValueError, match=r"hold no model\.layers\.3\.\*"):
        spec_engine(str(tmp_path / "dropped"))


def test_the_served_defaults_calibrate_and_stay_lossless(predictable_mtp):
    """The adaptive policy as served (its cost model measured at start on an MLA / MoE target) and the hybrid
    n-gram tree (mtp's default shape): lossless, every page back."""
    family, path, expected = predictable_mtp
    engine = LLMEngine(EngineConfig(model=path, cache=CacheConfig(page_size=4, num_pages=160),
                                    spec=SpecConfig(speculative_algorithm="mtp")))
    assert engine.spec_runner.policy is not None and engine.config.spec.hybrid
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    assert engine.free_pages == engine.total_pages


def test_an_mtp_directory_given_as_draft_model_drafts_alike(predictable_mtp):
    """--draft-model DIR with the NextN layout (here the checkpoint itself, as an extracted NextN checkpoint carries the
    same keys): the same draft, so the same proposals and acceptance as the checkpoint's own layer."""
    family, path, expected = predictable_mtp
    own = spec_engine(path, **SHAPES["tree"], spec_adaptive=False)
    given = spec_engine(path, **SHAPES["tree"], spec_adaptive=False, draft_model=path)
    outs = [e.generate(PROMPTS, GREEDY) for e in (own, given)]
    assert [o.token_ids for o in outs[1]] == expected
    assert [(o.spec_verify_count, o.spec_accepted_tokens) for o in outs[1]] == \
        [(o.spec_verify_count, o.spec_accepted_tokens) for o in outs[0]]
    assert given.runner.kv_pool.extra_layers == 1 and given.free_pages == given.total_pages
