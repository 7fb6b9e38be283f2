"""FlashInfer attention backend: GPU only, behind the same plan/forward interface as the torch path.

1. plan(meta), once per batch: `flashinfer_plan_inputs` turns AttentionMetadata into FlashInfer's
   paged inputs (CSR page lists + last-page lengths), and one wrapper is planned with them:
   BatchDecodeWithPagedKVCacheWrapper when every sequence has one query, otherwise
   BatchPrefillWithPagedKVCacheWrapper (ragged queries over paged KV, causal). FlashInfer's causal
   mask is bottom-right aligned, i.e. query j of a sequence sits at kv_len - q_len + j, exactly the
   reference semantics. Both wrappers share one float workspace: only one runs per batch. A batch with tree
   masks (speculative verify, tree draft steps) takes the prefill wrapper with FlashInfer's custom mask
   (`flashinfer_custom_mask`: each sequence's [q_len, kv_len] visibility, row-major, the prefix visible and
   the tree block over the last positions, causal for a sequence without one), which FlashInfer then reads
   instead of its causal flag.
2. forward(q, k, v, layer), once per layer: write this step's K/V into the pool, then run the
   planned wrapper on that layer's K and V.

The pool is page-major (docs/architecture.md §4), so a layer's K (or V) is a strided view
`[num_pages, page_size, kv_heads, head_dim]` whose page stride is num_layers*2*page_size*Hkv*D
elements. It is passed as-is, as a (k, v) tuple in NHD layout, with no copy: FlashInfer reads the
page / token / head strides from the tensors (`paged_kv_t` in include/flashinfer/page.cuh takes
`strides()`; offsets are computed in size_t; the SM90 sparse mainloop keeps an int64 page stride)
and only requires K and V to have identical strides, which two views of one buffer do. The
cuDNN / trtllm-gen kernels that `backend="auto"` may pick on Blackwell were not checked for
strided pages, so there we pin FlashInfer's own "fa2" kernels.

Not graph-capturable here (`static_plan` is False): FlashInfer's wrappers keep the plan in buffers of their own
and need `use_cuda_graph=True` wrappers per batch size; `--cuda-graphs` with this backend is refused at start-up.

flashinfer is imported inside __init__ only: `--attention-backend torch` never imports it, and on
CPU this module is importable for the plan-input checks (docs/gpu.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.kv.pool import KVPool

# The release this backend was written and read against (PyPI wheel, py3-none-any). It is not in
# requirements.txt: it pulls ~1.7 GB of CUDA Python packages and JIT-compiles its kernels with nvcc.
FLASHINFER_PIN = "flashinfer-python==0.7.4"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k float workspace
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_plan_inputs(meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """AttentionMetadata -> FlashInfer paged-KV plan inputs (all int32).

    qo_indptr [batch+1] and paged_kv_indptr [batch+1] and paged_kv_last_page_len [batch] are built
    on the host from the host lists (FlashInfer reads the indptrs on the host anyway);
    paged_kv_indices [paged_kv_indptr[-1]] is gathered on page_table's device without a sync.
    A sequence uses its first ceil(kv_len / page_size) pages; pages past that (scratch pages
    reserved for drafts) and the table's zero padding are left out. last_page_len is in
    [1, page_size] for kv_len > 0.
    """
    page_size = meta.page_size
    table = meta.page_table  # [batch, max_pages]
    num_pages = [(kv_len + page_size - 1) // page_size for kv_len in meta.kv_lens_host]
    for b, (q_len, kv_len, n) in enumerate(zip(meta.q_lens_host, meta.kv_lens_host, num_pages)):
        if q_len > kv_len:
            raise ValueError(f"sequence {b}: q_len {q_len} > kv_len {kv_len}")
        if n > table.shape[1]:
            raise ValueError(f"sequence {b}: kv_len {kv_len} needs {n} pages of {page_size} "
                             f"but page_table has {table.shape[1]} columns")
    kv_indptr = list(accumulate(num_pages, initial=0))
    last_page_len = [kv_len - (n - 1) * page_size if n else 0
                     for kv_len, n in zip(meta.kv_lens_host, num_pages)]

    device = table.device
    total_pages = kv_indptr[-1]
    counts = torch.tensor(num_pages, dtype=torch.int64, device=device)  # [batch]
    starts = torch.tensor(kv_indptr[:-1], dtype=torch.int64, device=device)  # [batch]
    rows = torch.repeat_interleave(torch.arange(len(num_pages), device=device), counts,
                                   output_size=total_pages)  # [total_pages] sequence of each page
    cols = torch.arange(total_pages, device=device) - torch.repeat_interleave(
        starts, counts, output_size=total_pages)  # [total_pages] page's slot in its sequence
    i32 = dict(dtype=torch.int32)
    return {
        "qo_indptr": torch.tensor(list(accumulate(meta.q_lens_host, initial=0)), **i32),
        "paged_kv_indptr": torch.tensor(kv_indptr, **i32),
        "paged_kv_indices": table[rows, cols].to(torch.int32),
        "paged_kv_last_page_len": torch.tensor(last_page_len, **i32),
    }


def flashinfer_custom_mask(meta: AttentionMetadata) -> torch.Tensor | None:
    """[sum over sequences of q_len * kv_len] bool on page_table's device: what each query sees, row-major per
    sequence, sequences concatenated (FlashInfer's custom mask layout); None without tree masks."""
    if meta.tree_mask is None:
        return None
    tree, indptr = meta.tree_mask.cpu(), meta.tree_mask_indptr.tolist()
    parts = []
    for b, (q_len, kv_len) in enumerate(zip(meta.q_lens_host, meta.kv_lens_host)):
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)  # [q_len, kv_len]
        if indptr[b + 1] > indptr[b]:
            block = tree[indptr[b]:indptr[b + 1]].view(q_len, -1)  # [q_len, width] over the last width positions
        else:
            block = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        visible[:, kv_len - block.shape[1]:] = block
        parts.append(visible.reshape(-1))
    return torch.cat(parts).to(meta.page_table.device)


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError(
            f"flashinfer backend needs the flashinfer package (pip install {FLASHINFER_PIN}, on a "
            f"CUDA machine), which is not importable here ({e}); "
            "use --attention-backend torch or triton") from e
    return flashinfer


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError("flashinfer backend needs a CUDA device; use --attention-backend "
                           f"torch or triton (the KV pool is on {device})")


def _kernel_backend(device: torch.device) -> str:
    major, _ = torch.cuda.get_device_capability(device)
    return "auto" if major < 10 else "fa2"  # see the module docstring: strided pages


@dataclass
class _FlashInferPlan:
    wrapper: Any  # the planned BatchDecode... or BatchPrefill...WithPagedKVCacheWrapper
    inputs: dict[str, torch.Tensor]  # flashinfer_plan_inputs(meta), kept alive for the batch


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_pool: KVPool, num_q_heads: int, head_dim: int, sm_scale: float | None = None):
        super().__init__(kv_pool, num_q_heads, head_dim, sm_scale)
        device = kv_pool.buffer.device
        _require_cuda(device)
        if kv_pool.dtype not in SUPPORTED_DTYPES:
            raise RuntimeError(f"flashinfer backend needs a float16 or bfloat16 KV pool, got "
                               f"{kv_pool.dtype}; use --attention-backend torch or triton")
        if head_dim != kv_pool.head_dim:
            raise ValueError(f"head_dim {head_dim} != KV pool head_dim {kv_pool.head_dim}")
        if num_q_heads % kv_pool.kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of kv_heads {kv_pool.kv_heads}")
        flashinfer = _import_flashinfer()
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # decode wants zeros
        backend = _kernel_backend(device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        # Tensor-core decode pays off once several q heads share a kv head (same rule as sglang).
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=num_q_heads // kv_pool.kv_heads >= 4, backend=backend)
        # The wrappers hold the plan, so only the most recently planned batch can run.
        self._active_plan: _FlashInferPlan | None = None

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        pool = self.kv_pool
        inputs = flashinfer_plan_inputs(meta)
        shape = (self.num_q_heads, pool.kv_heads, self.head_dim, meta.page_size)
        dtypes = dict(q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=self.sm_scale)
        custom_mask = flashinfer_custom_mask(meta)
        if custom_mask is not None:  # a tree: FlashInfer reads the mask, not the causal flag
            inputs["custom_mask"] = custom_mask
            wrapper = self._prefill
            wrapper.plan(inputs["qo_indptr"], inputs["paged_kv_indptr"], inputs["paged_kv_indices"],
                         inputs["paged_kv_last_page_len"], *shape, custom_mask=custom_mask, causal=False, **dtypes)
        elif meta.is_decode:
            wrapper = self._decode
            wrapper.plan(inputs["paged_kv_indptr"], inputs["paged_kv_indices"],
                         inputs["paged_kv_last_page_len"], *shape, **dtypes)
        else:
            wrapper = self._prefill
            wrapper.plan(inputs["qo_indptr"], inputs["paged_kv_indptr"], inputs["paged_kv_indices"],
                         inputs["paged_kv_last_page_len"], *shape, causal=True, **dtypes)
        meta.plan = self._active_plan = _FlashInferPlan(wrapper, inputs)
        return meta

    def forward(self, q, k, v, layer_id, meta):
        pool = self.kv_pool
        if meta.plan is None or meta.plan is not self._active_plan:
            raise RuntimeError("flashinfer backend: this batch is not the one last planned on this "
                               "backend; call plan(meta) again before forward")
        pool.write(layer_id, k, v, meta.write_pages, meta.write_offsets)
        q_in = q.to(pool.dtype)
        if q_in.stride(-1) != 1:  # FlashInfer takes token/head strides of q but not a feature stride
            q_in = q_in.contiguous()
        out = meta.plan.wrapper.run(q_in, (pool.k_cache(layer_id), pool.v_cache(layer_id)))
        return out.to(q.dtype)  # [T, Hq, D]
