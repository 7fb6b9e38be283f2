"""A CPU forward's decoder layers in one C call, bf16 or fp32 (specpd/kernels/csrc/cpu_stack.c): no per-layer
Python.

The per-layer Python path makes ~10 calls into C per layer (norms, four GEMMs, attention, SiLU x up), each a
ctypes call with its argument conversion and a tensor allocation: a sizeable share of a small model's
decode step once the GEMMs stream at the memory bandwidth. `Stack.run` makes one call for the whole stack,
through the same kernels in the same order (its output equals the Python path's bit for bit:
tests/model/test_cpu_stack.py), and releases the GIL for all of it.

It runs where every kernel it chains would run anyway: a CausalLM packed for CPU in bf16 or fp32 whose every
linear takes one of the project's GEMM kernels at this row count: the dense one for that dtype (cpu_gemm_bf16 on
AVX512-BF16: every width, on AMX tiles where the CPU has them, up to 16 rows with SPECPD_GEMM_AMX=0 there;
cpu_gemm_f32 on AVX-512: every width) or the quantized one for a linear in GGUF blocks (cpu_gemm_q, QuantLinear:
every width, AVX2 too, so a quantized model runs its stack on AVX2 boxes), a mix of both included;
the C attention backend with no long prompt chunk in the step (those take SDPA), no tensor parallelism (an
all-reduce sits between layers), no q/k norms, no autograd. Anything else: `run` returns None and the caller
takes the Python path. SPECPD_CPU_STACK=0 turns it off (benchmarks A/B it that way).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from specpd.attention.cpu_backend import CpuAttentionBackend
from specpd.kernels.build import DTYPE_CODES
from specpd.kernels.build import INT64 as _I
from specpd.kernels.build import VOID_P as _P
from specpd.kernels.build import load
from specpd.kernels.cpu_gemm_bf16 import ANY_WIDTH
from specpd.kernels.cpu_gemm_q import FORMATS
from specpd.kernels.cpu_linear import PackedLinear, QuantLinear

WEIGHTS_PER_LAYER = 7  # csrc/cpu_stack.c's order: ln1, qkv, qkv bias, o, ln2, gate_up, down


@functools.cache
def _fn():
    if os.environ.get("SPECPD_CPU_STACK", "1") == "0":
        return None
    lib = load("cpu_stack.c")
    if lib is None:
        return None
    fn = lib.specpd_stack
    _f = ctypes.c_float
    fn.argtypes = [ctypes.c_int, _I, _I, _I, _I, _I, _f, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P,
                   _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _I, _f]
    fn.restype = ctypes.c_int
    return fn


def _kernel_linear(m, dtype: torch.dtype) -> bool:
    """`m` runs on one of the project's GEMM kernels: the dense one for `dtype` (its weight packed in that
    kernel's layout) or the quantized one (its blocks packed)."""
    if isinstance(m, QuantLinear):
        return m.packed is not None
    return isinstance(m, PackedLinear) and m.few_rows > 0 and m.dtype == dtype


def _packed(m):
    """(the packed weight, its fp32 bias or None, its format code: ggml's type id, 0 for a dense weight)."""
    if isinstance(m, QuantLinear):
        return m.packed, m.bias, FORMATS[m.fmt]
    return m.few_packed, m.few_bias, 0


class Stack:
    """The C stack of one packed CausalLM (`build`), its weights' pointers gathered once."""

    def __init__(self, model, fn):
        self.model, self.fn = model, fn
        self.dtype = model.embed_tokens.weight.dtype
        cfg = model.config
        self.hidden, self.layers = cfg.hidden_size, len(model.layers)
        first = model.layers[0]
        self.nqkv = first.self_attn.qkv_proj.out_features
        self.q_width = cfg.num_heads * cfg.head_dim
        self.inter = first.mlp.intermediate
        self.eps = first.input_layernorm.eps
        self.max_rows = min(getattr(lin, "few_rows", ANY_WIDTH) for layer in model.layers for lin in _linears(layer))
        ptrs, fmts = [], []
        for layer in model.layers:
            (qkv, bias, f_qkv), (o, _, f_o), (gu, _, f_gu), (down, _, f_down) = map(_packed, _linears(layer))
            ptrs += [layer.input_layernorm.weight.data_ptr(), qkv.data_ptr(), 0 if bias is None else bias.data_ptr(),
                     o.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), gu.data_ptr(), down.data_ptr()]
            fmts += [f_qkv, f_o, f_gu, f_down]
        self.weights = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self.formats = (ctypes.c_int32 * len(fmts))(*fmts)  # per layer: qkv, o, gate_up, down
        self.final_norm = model.norm.weight.data_ptr()

    @classmethod
    def build(cls, model) -> "Stack | None":
        """The stack for `model` (after pack_for_cpu), or None where the C path does not apply."""
        fn = _fn()
        dtype = model.embed_tokens.weight.dtype
        if fn is None or not model.layers or dtype not in (torch.float32, torch.bfloat16):
            return None
        eps = {model.norm.eps}
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or not all(_kernel_linear(m, dtype) for m in _linears(layer)):
                return None
            if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
                return None
            eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
        if len(eps) != 1 or model.norm.weight.dtype != dtype:
            return None
        return cls(model, fn)

    def run(self, h: torch.Tensor, rope, backend, meta, capture_layers: tuple[int, ...]
            ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """CausalLM.forward's result from the embeddings `h` [T, H] (overwritten), or None: take the Python path."""
        t = h.shape[0]
        if (t > self.max_rows or t == 0 or h.dtype != self.dtype or torch.is_grad_enabled()
                or not isinstance(backend, CpuAttentionBackend) or self.model.layers[0].self_attn.tp is not None):
            return None
        plan = backend._plan(meta)
        if plan.long or plan.rows is not None:
            return None
        h = h.contiguous()
        hidden, new = self.hidden, h.new_empty
        res, normed, out = new(t, hidden), new(t, hidden), new(t, hidden)
        qkv, attn, gu, act = new(t, self.nqkv), new(t, self.q_width), new(t, 2 * self.inter), new(t, self.inter)
        caps = sorted({i for i in capture_layers if 0 <= i < self.layers})
        captured = [new(t, hidden) for _ in caps]
        cap_ids = (ctypes.c_int64 * max(len(caps), 1))(*caps)
        cap_ptrs = (ctypes.c_void_p * max(len(caps), 1))(*[c.data_ptr() for c in captured])
        p = plan.prepared
        positions = rope.positions
        rc = self.fn(DTYPE_CODES[self.dtype], t, hidden, self.layers, self.nqkv, self.inter, self.eps, self.weights,
                     self.formats, self.final_norm, h.data_ptr(), res.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                     gu.data_ptr(), act.data_ptr(), out.data_ptr(), cap_ids, len(caps), cap_ptrs,
                     positions.data_ptr(), p.w_slots, rope.cos.data_ptr(), rope.signed_sin.data_ptr(),
                     p.pool_args[0], p.pool_args[1], p.layer_stride, p.kv_half, *p.tail)
        if rc != 0:
            raise ValueError(f"cpu stack: kernel error {rc}")
        return out, captured


def _linears(layer):
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
