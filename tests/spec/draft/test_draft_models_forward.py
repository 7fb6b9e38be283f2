"""Draft families run over paged KV and match a dense oracle; a reduced draft vocabulary maps to the target's.

The oracle (`dense_draft`) recomputes each family from the published tensors alone, one sequence at
a time with a plain causal softmax: it checks the fused-weight mapping, the norm placement and the
paged attention together. (The published key layouts and checkpoint variants: test_draft_models_checkpoints.py.)
"""
import pytest
import torch
import torch.nn.functional as F

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.spec.draft.loader import load_draft_model, random_draft_checkpoint, read_draft_checkpoint, save_draft_model
from specpd.kv.pool import KVPool
from specpd.model.llama import OutputRows
from tests.spec.draft.draft_helpers import FAMILIES, draft_attention, make_draft, target  # noqa: F401


def features(draft, n, seed=2):
    width = draft.target_config.hidden_size * max(1, len(draft.aux_layer_ids))
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


# ---- dense oracle from the published tensors ----------------------------------------------------

def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, cfg):  # x [T, heads, D], positions 0..T-1
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(x.shape[0]).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def dense_attn(w, p, x, cfg):
    def proj(name, heads):
        y = x @ w[f"{p}self_attn.{name}_proj.weight"].T
        if f"{p}self_attn.{name}_proj.bias" in w:
            y = y + w[f"{p}self_attn.{name}_proj.bias"]
        y = y.view(x.shape[0], heads, cfg.head_dim)
        norm = w.get(f"{p}self_attn.{name}_norm.weight")  # qwen3 q/k norm
        return y if norm is None else rms(y, norm, cfg.rms_norm_eps)
    q, k, v = proj("q", cfg.num_heads), proj("k", cfg.num_kv_heads), proj("v", cfg.num_kv_heads)
    q, k = rope(q, cfg), rope(k, cfg)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / cfg.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
    return out @ w[f"{p}self_attn.o_proj.weight"].T


def dense_mlp(w, p, x):
    gate, up = x @ w[f"{p}mlp.gate_proj.weight"].T, x @ w[f"{p}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{p}mlp.down_proj.weight"].T


def dense_draft(draft, w, ids, hidden, step):
    """One sequence, positions 0..T-1 -> (draft hidden, logits over the draft vocab)."""
    cfg, eps, tgt = draft.config, draft.config.rms_norm_eps, draft.target
    emb = (w["embed_tokens.weight"] if "embed_tokens.weight" in w else tgt.model.embed_tokens.weight)[ids]
    head = tgt.head_weight
    if draft.algorithm == "eagle":
        x = torch.cat([emb, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
        x = x + dense_attn(w, "layers.0.", x, cfg)  # no input_layernorm on layer 0
        x = x + dense_mlp(w, "layers.0.", rms(x, w["layers.0.post_attention_layernorm.weight"], eps))
        return x, x @ head.T
    if draft.algorithm == "eagle3":
        h = hidden @ w["fc.weight"].T if hidden.shape[-1] != cfg.hidden_size else hidden
        a = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"], eps),
                       rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
        x = h + dense_attn(w, "midlayer.", a, cfg)
        x = x + dense_mlp(w, "midlayer.", rms(x, w["midlayer.post_attention_layernorm.weight"], eps))
        return x, rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    p = f"model.layers.{draft.first_layer_index + step % cfg.num_layers}."
    x = torch.cat([rms(emb, w[p + "enorm.weight"], eps), rms(hidden, w[p + "hnorm.weight"], eps)], -1)
    x = x @ w[p + "eh_proj.weight"].T
    x = x + dense_attn(w, p, rms(x, w[p + "input_layernorm.weight"], eps), cfg)
    x = x + dense_mlp(w, p, rms(x, w[p + "post_attention_layernorm.weight"], eps))
    return x, rms(x, w[p + "shared_head.norm.weight"], eps) @ head.T


# ---- forward ------------------------------------------------------------------------------------

SEQS = [7, 10, 1]
PAGES = [[3, 11], [7, 1, 14], [9]]  # scattered, crossing page boundaries (page_size 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_forward_matches_dense_oracle(tmp_path, target, family):
    draft, step = make_draft(tmp_path, target, family)
    _, weights = read_draft_checkpoint(str(tmp_path))
    _, backend = draft_attention(draft)
    ids = torch.randint(0, 320, (sum(SEQS),), generator=torch.Generator().manual_seed(3))
    hidden = features(draft, sum(SEQS))
    positions = torch.cat([torch.arange(n) for n in SEQS])
    meta = backend.plan(AttentionMetadata.build(SEQS, SEQS, PAGES, 4))
    with torch.no_grad():
        out = draft(ids, hidden, positions, backend, meta, step=step)
        logits = draft.compute_logits(out, step=step)
        start = 0
        for n in SEQS:
            ref_h, ref_logits = dense_draft(draft, weights, ids[start:start + n], hidden[start:start + n], step)
            torch.testing.assert_close(out[start:start + n], ref_h, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(logits[start:start + n], ref_logits, atol=2e-4, rtol=1e-4)
            start += n
    assert out.shape == (sum(SEQS), draft.config.hidden_size) and logits.dtype == torch.float32
    assert logits.shape == (sum(SEQS), draft.draft_vocab_size)


@pytest.mark.parametrize("family", list(FAMILIES) + ["eagle-2layer"])
def test_output_rows_write_every_row_and_match_the_full_forward(tmp_path, target, family):
    """OutputRows (a draft extend that reads only each item's last hidden): the same K/V in the pool at every
    row, and at the chosen rows the same hidden as the full forward; ragged, scattered pages, a 1-row item."""
    if family == "eagle-2layer":  # the layers before the last run every row
        random_draft_checkpoint(str(tmp_path), "eagle", target.config, seed=1, num_hidden_layers=2)
        draft, step = load_draft_model(str(tmp_path), "eagle", target, target.config), 0
        assert draft.config.num_layers == 2
    else:
        draft, step = make_draft(tmp_path, target, family)
    ids = torch.randint(0, 320, (sum(SEQS),), generator=torch.Generator().manual_seed(5))
    hidden = features(draft, sum(SEQS))
    positions = torch.cat([torch.arange(n) for n in SEQS])
    last = torch.tensor(SEQS).cumsum(0) - 1
    pool_full, backend_full = draft_attention(draft)
    pool_rows, backend_rows = draft_attention(draft)
    with torch.no_grad():
        full = draft(ids, hidden, positions, backend_full,
                     backend_full.plan(AttentionMetadata.build(SEQS, SEQS, PAGES, 4)), step=step)
        rows = OutputRows(last, backend_rows.plan(AttentionMetadata.build([1] * len(SEQS), SEQS, PAGES, 4)))
        out = draft(ids, hidden, positions, backend_rows,
                    backend_rows.plan(AttentionMetadata.build(SEQS, SEQS, PAGES, 4)), step=step, rows=rows)
    assert out.shape == (len(SEQS), draft.config.hidden_size)
    torch.testing.assert_close(out, full[last], atol=1e-5, rtol=1e-5)
    used = sorted({p for pages in PAGES for p in pages})
    torch.testing.assert_close(pool_rows.buffer[used], pool_full.buffer[used], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_then_tokens_equals_whole_sequence(tmp_path, target, family):
    """Draft KV written over several calls (extend, extend-after-prefix, decode) gives the same
    outputs as one call over the whole sequences: positions and causality line up."""
    draft, step = make_draft(tmp_path, target, family)
    lens = [7, 10]
    total = sum(lens)
    ids = torch.randint(0, 320, (total,), generator=torch.Generator().manual_seed(4))
    hidden = features(draft, total)
    rows = [torch.arange(0, 7), torch.arange(7, 17)]

    def run(chunks):  # chunks: list of per-sequence (start, end) position ranges per call
        _, backend = draft_attention(draft)
        outs = [[], []]
        for chunk in chunks:
            sel = torch.cat([rows[b][s:e] for b, (s, e) in enumerate(chunk)])
            pos = torch.cat([torch.arange(s, e) for s, e in chunk])
            meta = backend.plan(AttentionMetadata.build([e - s for s, e in chunk], [e for _, e in chunk], PAGES[:2], 4))
            with torch.no_grad():
                out = draft(ids[sel], hidden[sel], pos, backend, meta, step=step)
            offset = 0
            for b, (s, e) in enumerate(chunk):
                outs[b].append(out[offset:offset + e - s])
                offset += e - s
        return torch.cat([torch.cat(o) for o in outs])

    whole = run([[(0, 7), (0, 10)]])
    pieces = run([[(0, 4), (0, 6)], [(4, 6), (6, 9)], [(6, 7), (9, 10)]])
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


def test_eagle3_runs_on_captured_target_features_and_chains(tmp_path, target):
    draft, _ = make_draft(tmp_path, target, "eagle3")
    assert draft.aux_layer_ids == (1, 2, 3) and not draft.uses_target_final_hidden
    ids = torch.arange(5, 14)
    tpool = KVPool.for_model(target.config, 4, torch.float32, num_pages=8)
    tbackend = TorchAttentionBackend(tpool, target.config.num_heads, target.config.head_dim)
    _, backend = draft_attention(draft)
    with torch.no_grad():
        meta = tbackend.plan(AttentionMetadata.build([9], [9], [[2, 5, 6]], 4))
        _, captured = target(ids, torch.arange(9), tbackend, meta, capture_layers=draft.aux_layer_ids)
        fused = torch.cat(captured, dim=-1)  # [T, 3H], ascending layer order
        dmeta = backend.plan(AttentionMetadata.build([8], [8], [[2, 5]], 4))
        h = draft(ids[1:], fused[:-1], torch.arange(8), backend, dmeta)  # row p: token x_{p+1}, feature p
        top = draft.draft_to_target(draft.compute_logits(h[-1:]).argmax(-1))
        step_meta = backend.plan(AttentionMetadata.build([1], [9], [[2, 5, 6]], 4))
        h2 = draft(top, h[-1:], torch.tensor([8]), backend, step_meta, step=1)  # own hidden: fc skipped
    assert fused.shape == (9, 192) and h2.shape == (1, 64)
    assert torch.isfinite(draft.compute_logits(h2)).all()


# ---- vocabulary ---------------------------------------------------------------------------------

def test_eagle3_reduced_vocab_maps_through_d2t(tmp_path, target):
    draft, _ = make_draft(tmp_path, target, "eagle3-reduced")
    _, weights = read_draft_checkpoint(str(tmp_path))
    hot = torch.arange(96) + weights["d2t"]
    assert torch.equal(torch.nonzero(weights["t2d"]).flatten(), hot)  # t2d marks exactly the hot ids
    assert torch.equal(draft.draft_to_target(torch.arange(96)), hot)
    grid = torch.tensor([[0, 95], [3, 3]])  # any shape, e.g. [batch, topk]
    assert torch.equal(draft.draft_to_target(grid), hot[grid])
    h = torch.randn(4, 64)
    logits = draft.compute_logits(h)
    assert logits.shape == (4, 96)
    probs = logits.softmax(-1)
    full = draft.to_target_vocab(probs)
    assert full.shape == (4, 320) and torch.equal(full[:, hot], probs)
    assert full.sum(-1).allclose(torch.ones(4)) and (full[:, ~weights["t2d"]] == 0).all()


@pytest.mark.parametrize("family", ["eagle", "mtp", "eagle3"])
def test_restricted_vocab_keeps_hot_rows(tmp_path, target, family):
    draft, step = make_draft(tmp_path / "full", target, family)
    hot = torch.tensor([300, 4, 17, 250, 5, 99])  # unsorted on purpose
    reduced = load_draft_model(str(tmp_path / "full"), FAMILIES[family][0], target, target.config, hot_token_ids=hot)
    h = torch.randn(3, 64)
    with torch.no_grad():
        full_logits, small = draft.compute_logits(h, step), reduced.compute_logits(h, step)
    ids = reduced.draft_to_target(torch.arange(6))
    assert torch.equal(ids, hot.sort().values) and reduced.t2d.sum() == 6
    torch.testing.assert_close(small, full_logits[:, ids])
    # the reduced draft saves and reloads in the published layout (lm_head rows + d2t + t2d)
    save_draft_model(reduced, str(tmp_path / "small"))
    again = load_draft_model(str(tmp_path / "small"), FAMILIES[family][0], target, target.config)
    assert again.draft_vocab_size == 6 and torch.equal(again.draft_to_target(torch.arange(6)), ids)
    with torch.no_grad():
        torch.testing.assert_close(again.compute_logits(h, step), small)
