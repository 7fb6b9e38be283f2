"""A decoder layer's elementwise glue on CPU in one C pass each (csrc/cpu_ops.c): RMSNorm, the residual add
fused into the following RMSNorm, and SiLU(gate) * up. Each replaces two to five torch ops (and their
dispatch, which dominates at batch 1); math in fp32, one rounding at the store (the residual sum is rounded to
the dtype before it is normed, as torch's add then norm does). References: `rms_norm_ref`, `silu_mul_ref`
(tests/kernels/test_cpu_ops.py compares them over row counts, dtypes and widths)."""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from specpd.kernels.build import DTYPE_CODES, load
from specpd.kernels.build import INT64 as _I
from specpd.kernels.build import VOID_P as _P


@functools.cache
def _lib():
    lib = load("cpu_ops.c")
    if lib is None:
        return None
    lib.specpd_rmsnorm.argtypes = [ctypes.c_int, _P, _P, _P, _P, _P, _I, _I, ctypes.c_float]
    lib.specpd_rmsnorm.restype = ctypes.c_int
    lib.specpd_silu_mul.argtypes = [ctypes.c_int, _P, _P, _I, _I]
    lib.specpd_silu_mul.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _lib() is not None


def usable(x: torch.Tensor) -> bool:
    """The kernels take this tensor: CPU, a dtype they know, no autograd (they have no backward)."""
    return (x.device.type == "cpu" and x.dtype in DTYPE_CODES and not (torch.is_grad_enabled() and x.requires_grad)
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * weight, x + residual) with a residual, else (norm(x) * weight, None). x, residual
    [..., n] in weight's dtype."""
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty_like(x)
    rc = _lib().specpd_rmsnorm(DTYPE_CODES[x.dtype], x.data_ptr(), None if residual is None else residual.data_ptr(),
                               weight.data_ptr(), out.data_ptr(), None if summed is None else summed.data_ptr(),
                               rows, n, float(eps))
    if rc:
        raise ValueError(f"rms_norm: kernel error {rc}")
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * inter] (gate first) -> [..., inter]."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * inter)
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    if _lib().specpd_silu_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, inter):
        raise ValueError(f"silu_mul: width {inter} is over the kernel's limit")
    return out


def rms_norm_ref(x, weight, eps, residual=None):
    summed = None
    if residual is not None:
        x = summed = x + residual
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), summed


def silu_mul_ref(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)
