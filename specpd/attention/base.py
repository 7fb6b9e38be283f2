"""Attention backend interface and registry.

A backend is planned once per batch (`plan`) and then called once per layer (`forward`). `forward`
writes the new tokens' K/V into the pool, then attends over the paged KV. A backend may also take the
layer's unrotated fused qkv and the step's RopeBatch (`attend(qkv, rope, layer_id, meta, rows)`), to fuse
RoPE and the KV write into its kernel (the cpu backend); the model uses `attend` where a backend has it. Heavy backends are imported
lazily so that `--attention-backend torch` never imports triton or flashinfer.

A backend whose kernel cannot run in this process (`unavailable()` says why: the C kernel did not build) is
replaced, when it names a `fallback`, by that backend as the decoder or the draft is built, with one warning
naming the reason; without one it is refused there. Never inside a step.

Capabilities, read at start-up (specpd/model/cuda_graphs.py `check_config` refuses a configuration that needs
one its backend lacks, naming both settings): `tree_masks`, attention with a speculative tree's mask;
`static_plan`, `plan_static(meta, max_kv_len)`, which plans a padded batch whose tensors are fixed buffers
(specpd/attention/static.py) so that everything its forward reads is the same storage on every step for the
same shape, with no host value that changes between steps of that shape: what a CUDA graph replays.
"""
from __future__ import annotations

import functools
import importlib
import logging
from abc import ABC, abstractmethod

import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.kv.pool import KVPool

logger = logging.getLogger(__name__)


class AttentionBackend(ABC):
    name: str = ""
    fallback: str | None = None  # the backend that serves in its place where this one is unavailable
    tree_masks: bool = True  # attends with AttentionMetadata's tree masks (speculative trees)
    static_plan: bool = False  # implements plan_static (CUDA graphs)

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run in this process, or None: it can."""
        return None

    def __init__(self, kv_pool: KVPool, num_q_heads: int, head_dim: int, sm_scale: float | None = None):
        self.kv_pool = kv_pool
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale if sm_scale is not None else head_dim ** -0.5

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Prepare per-batch state (index tensors, kernel workspaces). Returns meta with `plan` set."""
        return meta

    def plan_static(self, meta: AttentionMetadata, max_kv_len: int) -> AttentionMetadata:
        """Plan a padded batch (every request `meta.max_q_len` rows) whose tensors are a graph's fixed buffers,
        into fixed buffers of this backend's, from host values that depend only on the batch's shape
        (max_kv_len: the longest KV any of its requests may have)."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot plan into static buffers")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> out [T, Hq, D]."""


_BACKENDS = {
    "torch": "specpd.attention.torch_backend:TorchAttentionBackend",
    "cpu": "specpd.attention.cpu_backend:CpuAttentionBackend",
    "triton": "specpd.attention.triton_backend:TritonAttentionBackend",
    "flashinfer": "specpd.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    """The backend registered as `name`, or its fallback where it cannot run here (module docstring)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    why = backend.unavailable()
    if why is None:
        return backend
    if backend.fallback is None:
        raise RuntimeError(f"attention backend {name!r} cannot run here: {why}")
    _warn_fallback(name, backend.fallback, why)
    return get_backend_class(backend.fallback)


@functools.cache
def _warn_fallback(name: str, fallback: str, why: str) -> None:
    """Once a process: the target's and the draft's backends fall back alike."""
    logger.warning("attention backend %r unavailable, using %r: %s", name, fallback, why)
