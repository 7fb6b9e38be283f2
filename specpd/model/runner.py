"""Model runner: owns the model, the KV pool, the attention backend and every tensor.

It turns a ScheduledBatch (plain Python) into input tensors and attention metadata, runs one
forward, and samples one token for each item that reached the end of its sequence. With CUDA graphs
(specpd/model/cuda_graphs.py) a forward whose batch fits a graph is replayed from it (`forward`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.config import EngineConfig, ModelConfig
from specpd.core import TokenLogprob  # noqa: F401  (SampledTokens field type)
from specpd.core import RequestFaults, ScheduledBatch, ScheduledItem
from specpd.grammar.matcher import mask_logits
from specpd.kernels.kv_compact import compact_pool
from specpd.kv.pool import DTYPES, KVPool
from specpd.machine import default_threads
from specpd.model.cuda_graphs import check_config as check_graph_config, graph_settings
from specpd.model.decoder import build_decoder
from specpd.model.loader import Checkpoint
from specpd.model.quant import resolve as resolve_quantization
from specpd.model.sampler import (SamplingRow, compute_logprobs, greedy_fast_path, greedy_tokens, process_logits,
                                  sample)


@dataclass
class SampledTokens:
    """What one batch item committed this step."""

    request_id: str
    token_ids: list[int]  # the sampled token; with speculation: accepted draft tokens + bonus
    logprobs: list[TokenLogprob | None]
    committed_slots: int  # slots from item.start that now hold valid KV
    num_accepted: int | None = None  # accepted draft tokens, when this came from a verify forward


# items in batch order; an item that did not reach the end of its sequence commits no tokens
StepResult = list[SampledTokens]


class StepRunner(ABC):
    """What the engine runs every step (LLMEngine.step_runner): plain decoding's ModelRunner, or speculation's
    SpecRunner (specpd/spec/runner.py), which drafts and verifies around the ModelRunner under it."""

    @property
    @abstractmethod
    def decode_width(self) -> int:
        """KV slots a decode step reserves past the committed length (the scheduler reserves them)."""

    @abstractmethod
    def execute(self, batch: ScheduledBatch, suppress: dict[str, tuple[int, ...]]) -> StepResult:
        """One forward over the batch; per item in batch order, what it committed. `suppress`: token ids an item
        may not sample yet (min_tokens), by request id."""

    @abstractmethod
    def release(self, request) -> None:
        """Drop what this runner keeps for a request that finished (its generator; a draft's state)."""


class ModelRunner(StepRunner):
    decode_width = 1  # a decode step writes the next token's KV only

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int, kv_extra_layers: int = 0,
                 pack: bool = True, pd_role: str | None = None, handoff_capture: tuple[int, ...] | None = None):
        """kv_extra_layers: room in every KV page for a draft's layers (KVPool.layers_of; docs/architecture.md §4).
        pack=False: keep nn.Linear layers (a frozen target that a draft trainer backpropagates through).
        pd_role ("prefill" / "decode"): a PD server (under tensor parallelism its page count is TP 1's).
        handoff_capture: PD prefill, draft-on-decode-only: keep the features the draft consumes (EAGLE-3: these
        target layers' inputs; (): the final hidden) of prefill-only requests for the handoff. None: keep nothing."""
        self.handoff_capture = handoff_capture
        config = config.resolved()
        check_graph_config(config)  # a configuration that cannot run is refused here, never inside a step
        config = replace(config, quantization=resolve_quantization(config, checkpoint.blocks, pack))
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model_config = ModelConfig.from_hf(checkpoint.hf_config)
        # process-wide (torch has no per-model setting); default: OMP_NUM_THREADS, else every core it may use
        self.num_threads = config.num_threads or default_threads()
        torch.set_num_threads(self.num_threads)
        torch.manual_seed(config.seed)
        self.tp = None
        self.graphs = self.graph_settings = None
        if config.tp_size != 1:
            self._init_tensor_parallel(config, checkpoint, max_model_len, kv_extra_layers, pd_role)
            return
        self.model, self.kv_pool, self.backend = build_decoder(
            config, self.model_config, checkpoint.weights, max_model_len, self.device, self.dtype, pack=pack,
            kv_extra_layers=kv_extra_layers, blocks=checkpoint.blocks)
        self._init_graphs(config, max_model_len)
        self._init_host_state(config)

    def _init_graphs(self, config: EngineConfig, max_model_len: int) -> None:
        """The decoder's graph runner: decode rows, and verify rows up to a tree's nodes (None: graphs off)."""
        spec = config.spec
        tree = spec.num_draft_tokens if spec.enabled else 1
        self.graph_settings = graph_settings(config, self.kv_pool, max_model_len,
                                             tree + (spec.num_steps * spec.topk if spec.enabled else 0))
        if self.graph_settings is not None:
            self.graphs = self.graph_settings.runner(self._graph_forward, self.backend, [1, tree], tree * tree)

    def _graph_forward(self, input_ids, positions, meta, hidden, rows, variant):
        hidden, captured = self.model(input_ids, positions, self.backend, meta, capture_layers=variant[0])
        return (hidden, *captured)

    def _init_tensor_parallel(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int,
                              kv_extra_layers: int, pd_role: str | None) -> None:
        """Rank 0 of `config.tp_size` (specpd/model/tp.py): this process holds shard 0 of the decoder and the KV
        pool (self.kv_pool: its heads of every page, no draft layers) and drives the worker ranks through
        self.model. A PD server's ranks each move their own heads (specpd/disagg/kv_sender.py)."""
        from specpd.model import tp
        tp.check_tp_size(self.model_config, config.tp_size)
        tp.check_devices(config.device, config.tp_size)
        tp.check_quantization(self.model_config, config.tp_size, config.quantization)
        self.num_threads = tp.rank_threads(config)
        torch.set_num_threads(self.num_threads)
        if pd_role is not None and config.cache.num_pages is None:  # TP 1's page count: P and D pages pair alike
            page = KVPool.page_bytes(self.model_config, config.cache.page_size, self.dtype, kv_extra_layers)
            config = replace(config, cache=replace(config.cache, num_pages=max(
                1, (config.cache.kv_cache_memory_mb << 20) // page)))
        scales = tp.row_parallel_scales(checkpoint.weights, self.model_config, config.quantization)
        group, conns, procs = tp.start_group(config, checkpoint.hf_config, checkpoint.weights, max_model_len, scales)
        weights = tp.shard_weights(checkpoint.weights, self.model_config, config.tp_size, 0)
        model, self.kv_pool, self.backend = build_decoder(config, tp.shard_config(self.model_config, config.tp_size),
                                                          weights, max_model_len, self.device, self.dtype,
                                                          row_scales=scales)
        tp.attach(model, group)
        self.model = self.tp = tp.TPModel(model, group, conns, procs)
        self._init_host_state(config)

    def compact_kv(self, moves) -> None:
        """Move KV slots inside the pool's pages (moves: path_slot_moves' lists: a verified tree path next to
        its root), here and on every other tensor-parallel rank."""
        compact_pool(self.kv_pool, moves)
        if self.tp is not None:
            self.tp.compact_kv(moves)

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks (nothing to do at TP 1)."""
        if self.tp is not None:
            self.tp.close()

    def _init_host_state(self, config: EngineConfig) -> None:
        self.shared_generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._generators: dict[str, torch.Generator] = {}
        # what one request's own parameters or data broke in a step: the engine fails that request alone
        self.faults = RequestFaults()

    def runtime_info(self) -> dict:
        """What this runner resolved from the machine and the flags (logged at start, in /server_info)."""
        from specpd.machine import isa
        from specpd.kernels.cpu_gemm_q import path
        return {"num_threads": self.num_threads, "tp_size": self.config.tp_size, "dtype": self.config.dtype,
                "device": str(self.device), "attention_backend": self.backend.name,
                "cuda_graphs": self.graph_settings is not None,
                "cpu_isa": isa() if self.device.type == "cpu" else None,
                # the resolved --quantization, and how many weights each format took (specpd/model/quant.py)
                "quantization": self.config.quantization, "weight_formats": dict(self.model.weight_formats),
                "quant_kernel": path() if self.model.weight_formats else None}

    # -- per-request state -----------------------------------------------------------------
    def generator_for(self, request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            with self.faults.guard(request.request_id, "seeding its generator"):
                gen = self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def release(self, request) -> None:
        self._generators.pop(request.request_id, None)

    @staticmethod
    def _keep_handoff_features(batch: ScheduledBatch, features: torch.Tensor) -> None:
        offset = 0
        for it in batch.items:
            req = it.request
            if req.prefill_only:
                # a recompute after preemption starts over; a prefix-cache hit starts from the cached
                # pages' features (the scheduler put them here at admission)
                if it.start == 0 or req.handoff_hidden is None:
                    req.handoff_hidden = []
                req.handoff_hidden.append(features[offset:offset + it.num_tokens].clone())
            offset += it.num_tokens

    # -- one step --------------------------------------------------------------------------
    def forward(self, ids: list[int], positions: list[int], q_lens: list[int], kv_lens: list[int],
                page_lists: list[list[int]], tree_masks=None, capture_layers: tuple[int, ...] = ()):
        """The decoder over one step's rows -> (hidden [N, H], the captured layers' inputs [N, H] each): replayed
        from a CUDA graph where one fits the batch, else eagerly."""
        if self.graphs is not None:
            out = self.graphs.run(ids, positions, q_lens, kv_lens, page_lists, tree_masks,
                                  variant=(tuple(capture_layers),))
            if out is not None:
                return out[0], list(out[1:])
        meta = AttentionMetadata.build(q_lens=q_lens, kv_lens=kv_lens, page_lists=page_lists,
                                       page_size=self.kv_pool.page_size, device=self.device, tree_masks=tree_masks)
        self.backend.plan(meta)
        return self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                          torch.tensor(positions, dtype=torch.long, device=self.device), self.backend, meta,
                          capture_layers=capture_layers)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, suppress: dict[str, tuple[int, ...]]) -> StepResult:
        items = batch.items
        capture = self.handoff_capture
        hidden, captured = self.forward(
            [t for it in items for t in it.request.all_token_ids[it.start:it.start + it.num_tokens]],
            [p for it in items for p in range(it.start, it.start + it.num_tokens)], [it.num_tokens for it in items],
            [it.start + it.num_tokens for it in items], [it.request.pages for it in items],
            capture_layers=capture or ())
        if capture is not None:
            self._keep_handoff_features(batch, torch.cat(captured, dim=-1) if capture else hidden)
        return self.sample_items(batch.items, [it.num_tokens for it in batch.items], hidden, suppress)

    def sample_items(self, items: list[ScheduledItem], q_lens: list[int], hidden: torch.Tensor,
                     suppress: dict[str, tuple[int, ...]]) -> StepResult:
        """One token for every item that samples, from its last row of `hidden` (items' rows in order,
        q_lens of them each); batched: one LM-head matmul, one argmax when every row is greedy."""
        rows_idx: list[int] = []
        rows: list[SamplingRow] = []
        offset = 0
        for it, q in zip(items, q_lens):
            offset += q
            if it.samples:
                req = it.request
                rows_idx.append(offset - 1)
                rows.append(SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids,
                                        self.generator_for(req), suppress.get(req.request_id, ()), req.request_id))
        if not rows:
            return [SampledTokens(it.request.request_id, [], [], q) for it, q in zip(items, q_lens)]
        logits = self.model.compute_logits(hidden[rows_idx])  # [num_rows, vocab] fp32
        # structured output: the grammar mask comes before every other logit processing and the greedy argmax
        sampling = [it.request for it in items if it.samples]
        mask_logits(logits, [r.grammar for r in sampling], self.faults, [r.request_id for r in sampling])
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw = logits.clone() if want_logprobs else logits
        if greedy_fast_path(rows):
            tokens = greedy_tokens(logits).tolist()
        else:
            tokens = sample(process_logits(logits, rows, self.faults), rows, self.shared_generator, self.faults)
        logprobs = compute_logprobs(raw, tokens, rows) if want_logprobs else [None] * len(rows)
        result, k = [], 0
        for it, q in zip(items, q_lens):
            if it.samples:
                result.append(SampledTokens(it.request.request_id, [tokens[k]], [logprobs[k]], q))
                k += 1
            else:
                result.append(SampledTokens(it.request.request_id, [], [], q))
        return result
