"""EAGLE-3's CPU draft forward in one C call, bf16 or fp32 (csrc/cpu_stack.c, specpd_eagle3): no per-op Python.

A speculating round runs the one-layer draft two or three times (the catch-up extend, a forward per draft level
past the first). Its weights are a small fraction of the target's, but its Python path makes a call into C or
torch per op (norms, a concat, five GEMMs, attention, adds), whose overhead rivals the GEMMs themselves and at
batch 1 is a large share of what speculating adds to a round (issue 32; evals/spec_round_cost.py times a
round's parts). `Eagle3Stack.run` makes one call
through the same kernels in the same order; its output equals the Python path's bit for bit
(tests/spec/draft/test_eagle3_stack.py), K/V included.

It runs where the target's stack would (specpd/model/cpu_stack.py): bf16 or fp32, every linear on the project's
GEMM kernel for that dtype at this row count, the C attention backend with no long prompt chunk, no autograd.
Anything else, and SPECPD_CPU_STACK=0: `run` returns None and the draft takes its Python path.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from specpd.attention.cpu_backend import CpuAttentionBackend
from specpd.kernels.build import DTYPE_CODES
from specpd.kernels.build import INT64 as _I
from specpd.kernels.build import VOID_P as _P
from specpd.kernels.build import load
from specpd.model import cpu_stack


@functools.cache
def _fn():
    if cpu_stack._fn() is None:  # the same library and switches as the target's stack
        return None
    fn = load("cpu_stack.c").specpd_eagle3
    _f = ctypes.c_float
    fn.argtypes = [ctypes.c_int, _I, _I, _I, _I, _I, _f, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P,
                   _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _I, _f]
    fn.restype = ctypes.c_int
    return fn


class Eagle3Stack:
    """The C forward of one packed Eagle3Draft (`build`), its weights' pointers gathered once."""

    def __init__(self, draft, fn):
        self.fn = fn
        layer = draft.midlayer
        self.dtype = layer.input_layernorm.weight.dtype  # the activations' (build checks every linear takes it)
        attn, mlp = layer.self_attn, layer.mlp
        self.hidden = draft.config.hidden_size
        self.fc_in = draft.fc.in_features
        self.nqkv, self.q_width, self.inter = attn.qkv_proj.out_features, attn.q_size, mlp.intermediate
        self.eps = layer.input_layernorm.eps
        self.norm_before_residual = int(layer.norm_before_residual)
        self.max_rows = min(getattr(lin, "few_rows", cpu_stack.ANY_WIDTH) for lin in _linears(draft))
        (fc, fc_bias, f_fc), (qkv, qkv_bias, f_qkv), (o, _, f_o), (gu, _, f_gu), (down, _, f_down) = \
            map(cpu_stack._packed, _linears(draft))
        ptrs = [fc.data_ptr(), 0 if fc_bias is None else fc_bias.data_ptr(),
                layer.input_layernorm.weight.data_ptr(), layer.hidden_norm.weight.data_ptr(),
                qkv.data_ptr(), 0 if qkv_bias is None else qkv_bias.data_ptr(),
                o.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), gu.data_ptr(), down.data_ptr()]
        self.weights = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self.formats = (ctypes.c_int32 * 5)(f_fc, f_qkv, f_o, f_gu, f_down)  # ggml's type id, 0: dense
        self.weights_no_fc = (ctypes.c_void_p * len(ptrs))(0, 0, *ptrs[2:])

    @classmethod
    def build(cls, draft) -> "Eagle3Stack | None":
        """The stack for `draft` (its linears packed), or None where the C path does not apply."""
        fn = _fn()
        layer = getattr(draft, "midlayer", None)
        if fn is None or layer is None:
            return None
        dtype = layer.input_layernorm.weight.dtype
        if not all(cpu_stack._kernel_linear(m, dtype) for m in _linears(draft)):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None or attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None \
                or mlp.down_proj.bias is not None:
            return None
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
        if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms) \
                or len({n.eps for n in norms}) != 1:
            return None
        return cls(draft, fn)

    def run(self, hidden: torch.Tensor, embeds: torch.Tensor, rope, backend, meta, rows=None) -> torch.Tensor | None:
        """Eagle3Draft.forward's result from `hidden` (the fused target features [T, 3H] or a draft hidden [T, H])
        and the token embeddings [T, H]; None: take the Python path."""
        t = hidden.shape[0]
        if (t > self.max_rows or t == 0 or hidden.dtype != self.dtype or embeds.dtype != self.dtype
                or torch.is_grad_enabled() or not isinstance(backend, CpuAttentionBackend)):
            return None
        plan = backend._plan(meta)
        if plan.long:
            return None
        fused = hidden.shape[-1] != self.hidden
        hidden, embeds = hidden.contiguous(), embeds.contiguous()
        new, width = hidden.new_empty, self.hidden
        h = new(t, width) if fused else hidden
        x, res, qkv = new(t, 2 * width), new(t, width), new(t, self.nqkv)
        tmp, gu, act = new(t, width), new(t, 2 * self.inter), new(t, self.inter)
        p = plan.prepared
        if rows is None:
            r, index, qg, qpos, tail = t, None, None, None, p.tail
        else:  # only these rows attend and go on (their own metadata, as CpuAttentionBackend.attend takes it)
            index = rows.index.contiguous()
            r = index.shape[0]
            qg, qpos = new(r, self.q_width), torch.empty(r, dtype=torch.int64)
            tail = backend.rows_prepared(plan, rows.meta).tail
        attn, out = new(r, self.q_width), new(r, width)
        rc = self.fn(DTYPE_CODES[self.dtype], t, width, self.fc_in, self.nqkv, self.inter, self.eps,
                     self.norm_before_residual,
                     self.weights if fused else self.weights_no_fc, self.formats, hidden.data_ptr() if fused else None,
                     h.data_ptr(), embeds.data_ptr(), x.data_ptr(), res.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                     tmp.data_ptr(), gu.data_ptr(), act.data_ptr(), None if index is None else index.data_ptr(), r,
                     None if qg is None else qg.data_ptr(), None if qpos is None else qpos.data_ptr(),
                     out.data_ptr(), rope.positions.data_ptr(), p.w_slots, rope.cos.data_ptr(),
                     rope.signed_sin.data_ptr(), p.pool_args[0], p.pool_args[1], p.kv_half, *tail)
        if rc != 0:
            raise ValueError(f"eagle3 cpu stack: kernel error {rc}")
        return out


def _linears(draft):
    layer = draft.midlayer
    return (draft.fc, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
