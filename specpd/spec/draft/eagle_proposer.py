"""EAGLE-family proposer (EAGLE-1, EAGLE-3, MTP): drives a DraftModel over its own paged KV pool.

The draft's KV has the target's page ids: its layers live in the target's page blocks after the target's
layers (KVPool.layers_of) when the geometry matches, else in a parallel pool sharing the allocator. Either
way one page list covers both.
Draft slots during drafting are scratch past the committed length; the extend after each verify
rewrites the committed positions with the target's real hidden states.

Drafting, per round (S = num_steps, K = topk):
  step 0   expand the root with the top-k kept from the last extend (no forward);
  step s   run the draft on the frontier nodes (each paired with the draft hidden that predicted
           it) at draft position start + s - 1, take each node's top-k; a chain (K = 1) writes slot
           start + s - 1 with plain causal attention, a tree writes frontier f at slot
           start + (s-1)K + f and sees only its ancestors' scratch slots.
With CUDA graphs (specpd/model/cuda_graphs.py) an extend of up to a tree's rows per request and every draft step
are replayed from graphs of the draft's own (`_run`); longer extends run eagerly.
"""
from __future__ import annotations

import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.core import Request
from specpd.spec.draft.base import DraftModel
from specpd.spec.draft.eagle3_stack import Eagle3Stack
from specpd.spec.draft.proposer import DraftExtend, DraftState, Proposer
from specpd.grammar.matcher import mask_after
from specpd.kernels.cpu_linear import pack_linears, weights_on_huge_pages
from specpd.kv.pool import KVPool
from specpd.model.cuda_graphs import GraphSettings
from specpd.model.llama import OutputRows
from specpd.model.moe_lm import make_backend, make_kv_like
from specpd.model.quant import quantize_draft
from specpd.spec.tree import DraftTree, TreeBuilder, draft_logp, root_only


class EagleProposer(Proposer):
    def __init__(self, draft: DraftModel, target_pool: KVPool, attention_backend: str,
                 num_steps: int, topk: int, num_draft_tokens: int, pool: KVPool | None = None,
                 graphs: GraphSettings | None = None, quantize: bool = False):
        """`pool`: the draft's layers inside the target's pages (KVPool.layers_of); None: a parallel pool.
        `graphs`: the engine's CUDA graph settings (None: every forward eager). `quantize`: the draft's linears
        in int8 blocks on CPU (SpecConfig.spec_draft_quantization)."""
        super().__init__(num_steps, topk, num_draft_tokens)
        self.draft = draft
        cfg = draft.config
        self.device = target_pool.buffer.device
        self.pool = pool or make_kv_like(cfg, target_pool)
        self.backend = make_backend(attention_backend, self.pool, cfg)  # MLA drafts: the latent backend
        if self.device.type == "cpu":
            if quantize:
                quantize_draft(draft)
            pack_linears(draft)  # serving only: prepacked for oneDNN, as the target's (no autograd after this)
            draft.cpu_stack = Eagle3Stack.build(draft)  # EAGLE-3's forward in one C call where it applies
            weights_on_huge_pages(draft)
        self._draft_ids: torch.Tensor | None = None  # [draft vocab] target ids (d2t), built when a grammar needs it
        self.graphs = None
        if graphs is not None:  # extends of up to a tree's rows, steps of a frontier (K rows, sK mask columns)
            self.graphs = graphs.runner(self._graph_forward, self.backend, [1, topk, num_draft_tokens],
                                        max(num_draft_tokens, topk * topk * max(1, num_steps - 1)))

    def _graph_forward(self, input_ids, positions, meta, hidden, rows, variant):
        return (self.draft(input_ids, hidden, positions, self.backend, meta, step=variant[0], rows=rows),)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.draft.aux_layer_ids

    @property
    def scratch_slots(self) -> int:
        """Draft slots past the root a round needs."""
        return max(1, (self.num_steps - 1) * self.topk)

    def _run(self, token_ids, hidden, positions, q_lens, kv_lens, pages, step, tree_masks=None,
             last_only: bool = False):
        """The draft forward -> hidden [T, H]; last_only: [len(q_lens), H] at each item's last row (every
        row's K/V is still written; the draft's last layer attends and projects only those rows)."""
        if self.graphs is not None:
            out = self.graphs.run(token_ids, positions, q_lens, kv_lens, pages, tree_masks, hidden=hidden,
                                  last_only=last_only, variant=(step,))
            if out is not None:
                return out[0]
        meta = AttentionMetadata.build(q_lens=q_lens, kv_lens=kv_lens, page_lists=pages,
                                       page_size=self.pool.page_size, device=self.device,
                                       tree_masks=tree_masks)
        self.backend.plan(meta)
        rows = None
        if last_only and tree_masks is None and max(q_lens) > 1:
            last = torch.tensor(q_lens).cumsum(0) - 1
            rows_meta = AttentionMetadata.build(q_lens=[1] * len(q_lens), kv_lens=kv_lens, page_lists=pages,
                                                page_size=self.pool.page_size, device=self.device)
            rows = OutputRows(last.to(self.device), self.backend.plan(rows_meta))
        out = self.draft(torch.tensor(token_ids, device=self.device), hidden,
                         torch.tensor(positions, device=self.device), self.backend, meta, step=step, rows=rows)
        if last_only and rows is None:
            out = out[torch.tensor(q_lens).cumsum(0) - 1]
        return out

    def _topk(self, draft_hidden: torch.Tensor, step: int,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """bias [rows, draft vocab] (0 / -inf): structured output, -inf where the grammar forbids the token."""
        logits = self.draft.compute_logits(draft_hidden, step=step)
        if bias is not None:
            logits = logits + bias
        vals, ids = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)  # [rows, K]
        return self.draft.draft_to_target(ids), vals

    def _grammar_bias(self, requests, builders, level, frontiers) -> torch.Tensor | None:
        """[sum of frontier sizes, draft vocab] 0 / -inf, or None when no request in `level` has a grammar:
        -inf where the grammar forbids the token after the committed output plus the path root..node.
        Masking the draft costs one grammar walk per frontier node and keeps acceptance up on constrained
        text; verify masks the target itself, so this changes speed, never output."""
        if all(requests[i].grammar is None for i in level):
            return None
        if self._draft_ids is None:
            self._draft_ids = self.draft.draft_to_target(torch.arange(self.draft.draft_vocab_size)).cpu()
        parts = []
        for i in level:
            grammar, nodes = requests[i].grammar, frontiers[i]
            if grammar is None:
                parts.append(torch.zeros(len(nodes), self.draft.draft_vocab_size))
                continue
            paths = [[] if builders is None else _path_tokens(builders[i], n) for n in nodes]
            bias = mask_after(grammar, paths).index_select(1, self._draft_ids)
            bias[torch.isinf(bias).all(dim=1)] = 0.0  # nothing allowed in the draft vocab (say only EOS)
            parts.append(bias)
        return torch.cat(parts).to(self.device)

    def extend(self, extends: list[DraftExtend]) -> None:
        ids, positions, q_lens, kv_lens, pages = [], [], [], [], []
        for ex in extends:
            n = len(ex.token_ids)
            ids.extend(ex.token_ids)
            positions.extend(range(ex.start, ex.start + n))
            q_lens.append(n)
            kv_lens.append(ex.start + n)
            pages.append(ex.request.pages)
        hidden = torch.cat([ex.hidden for ex in extends]).to(self.pool.dtype)
        out = self._run(ids, hidden, positions, q_lens, kv_lens, pages, step=0, last_only=True)  # [items, H]
        for i, ex in enumerate(extends):
            ex.request.draft_kv_len = ex.start + q_lens[i]  # draft KV valid below (a prefix cache reads it)
        # the head and top-k only where a proposal is refreshed: a mid-prompt chunk writes KV alone (the head is
        # half of a one-layer draft's weights)
        ends = [i for i, ex in enumerate(extends) if ex.at_end]
        if ends:
            top_ids, top_probs = self._topk(out[ends], step=0)
            ids, probs, logp, rows = top_ids.tolist(), top_probs.tolist(), draft_logp(top_probs), out.unbind(0)
            for j, i in enumerate(ends):
                extends[i].request.spec_state = DraftState(ids[j], probs[j], rows[i], logp[j])

    def propose(self, requests: list[Request], starts: list[int], plans=None) -> list[DraftTree]:
        """plans: (num_steps, num_draft_tokens) per request (adaptive speculation; 0 steps = root only)."""
        if not requests:
            return []
        k = self.topk
        plans = plans or [(self.num_steps, self.num_draft_tokens)] * len(requests)
        trees: list[DraftTree | None] = [root_only(r.all_token_ids[-1]) if steps == 0 else None
                                         for r, (steps, _) in zip(requests, plans)]
        active = [i for i, t in enumerate(trees) if t is None]
        builders, pred_hidden, slots = {}, {}, {}
        for i in active:
            state: DraftState = requests[i].spec_state
            b = TreeBuilder(requests[i].all_token_ids[-1], k, plans[i][0], plans[i][1])
            if requests[i].grammar is not None:  # the extend's top-k was unmasked: redo it from its hidden
                bias = self._grammar_bias(requests, None, [i], {i: [0]})
                top_ids, top_probs = self._topk(state.hidden.unsqueeze(0), 0, bias)
                new = b.expand_logp(top_ids.tolist(), draft_logp(top_probs))
            else:
                new = b.expand_logp([state.topk_ids], [state.logp()])
            builders[i] = b
            pred_hidden[i] = dict.fromkeys(new, state.hidden)  # node -> draft hidden that predicted it
            slots[i] = {}  # node -> scratch slot offset from the root's position
        for s in range(1, max((plans[i][0] for i in active), default=0)):
            level = [i for i in active if plans[i][0] > s]
            frontiers = {i: builders[i].frontier_ids() for i in level}
            ids, positions, q_lens, kv_lens, masks, hidden = [], [], [], [], [], []
            for i in level:
                b, fr, start, ph, slot_of = builders[i], frontiers[i], starts[i], pred_hidden[i], slots[i]
                ids.extend(b.token_ids[n] for n in fr)
                positions.extend([start + s - 1] * len(fr))
                hidden.extend(ph[n] for n in fr)
                q_lens.append(len(fr))
                if k == 1:
                    kv_lens.append(start + s)
                else:
                    for f, node in enumerate(fr):
                        slot_of[node] = (s - 1) * k + f
                    kv_lens.append(start + (s - 1) * k + len(fr))
                    masks.append(self._scratch_mask(b, fr, slot_of, (s - 1) * k + len(fr)))
            out = self._run(ids, torch.stack(hidden), positions, q_lens, kv_lens,
                            [requests[i].pages for i in level], step=s, tree_masks=masks or None)
            bias = self._grammar_bias(requests, builders, level, frontiers)
            top_ids, top_probs = self._topk(out, step=s, bias=bias)
            ids, logp = top_ids.tolist(), draft_logp(top_probs)  # the level's at once, each request its rows
            row, out_rows = 0, out.unbind(0)  # one op for every row's view (indexing made one per row)
            for i in level:
                fr, ph = frontiers[i], pred_hidden[i]
                new = builders[i].expand_logp(ids[row:row + len(fr)], logp[row:row + len(fr)])
                for j in range(len(fr)):
                    for child in new[j * k:(j + 1) * k]:
                        ph[child] = out_rows[row + j]
                row += len(fr)
        for i in active:
            trees[i] = builders[i].finalize()
        return trees

    @staticmethod
    def _scratch_mask(builder: TreeBuilder, frontier: list[int], slot_of: dict[int, int],
                      width: int) -> torch.Tensor:
        """[F, width] bool over this round's scratch slots: each frontier node sees the slots of its
        ancestors drafted at earlier steps, and its own."""
        rows = [[False] * width for _ in frontier]  # one tensor at the end, not an indexed write per slot
        parents = builder.parent_ids
        for f, node in enumerate(frontier):
            n = node
            while n > 0:
                if n in slot_of:
                    rows[f][slot_of[n]] = True
                n = parents[n]
        return torch.tensor(rows, dtype=torch.bool).reshape(len(frontier), width)


def _path_tokens(builder: TreeBuilder, node: int) -> list[int]:
    """Draft tokens root (excluded) .. node."""
    parents, tokens, path = builder.parent_ids, builder.token_ids, []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]
