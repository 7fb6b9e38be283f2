"""Compile the paged-attention and KV-compaction kernels for sm_90 (Hopper) without a GPU, to catch
codegen errors that the interpreter cannot see (tl.dot shape limits, layouts, register/shared-memory
blow-ups).

Runs in a subprocess without TRITON_INTERPRET (the interpreter replaces the JIT and cannot compile).
The constexprs come from the same helpers the launchers use, so the launched configurations are the
ones compiled. triton.compile goes source -> TTIR -> TTGIR -> LLVM IR -> PTX -> cubin; the PTX step
already needs ptxas (for its version), so without triton's bundled ptxas nothing can be compiled and
the test skips.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# name -> (kernel, dtype, constexpr helper args); defaults mirror the launchers and the backend
VARIANTS = {
    "extend_bf16_d128_gqa4_p16": ("extend", "bfloat16", dict(head_dim=128, group=4, page_size=16)),
    "extend_fp16_d64_mha_p1": ("extend", "float16", dict(head_dim=64, group=1, page_size=1)),
    "extend_fp32_d64_gqa2_p4": ("extend", "float32", dict(head_dim=64, group=2, page_size=4)),
    "extend_bf16_d8_small_blocks": ("extend", "bfloat16", dict(head_dim=8, group=2, page_size=4,
                                                               block_m=16, block_n=16)),
    "extend_tree_bf16_d128_gqa4_p16": ("extend", "bfloat16", dict(head_dim=128, group=4, page_size=16, tree=True)),
    "extend_tree_fp16_d64_mha_p1": ("extend", "float16", dict(head_dim=64, group=1, page_size=1, tree=True)),
    "extend_tree_fp32_d64_gqa2_p4_small": ("extend", "float32", dict(head_dim=64, group=2, page_size=4,
                                                                     block_m=16, block_n=16, tree=True)),
    "decode_fp16_d128_gqa4_p16": ("decode", "float16", dict(head_dim=128, group=4, page_size=16)),
    "decode_bf16_d64_gqa8_p1": ("decode", "bfloat16", dict(head_dim=64, group=8, page_size=1)),
    "decode_fp32_d128_mha_p64": ("decode", "float32", dict(head_dim=128, group=1, page_size=64)),
    "reduce_bf16_d128_1split": ("reduce", "bfloat16", dict(head_dim=128, num_splits=1)),
    "reduce_fp16_d64_13splits": ("reduce", "float16", dict(head_dim=64, num_splits=13)),
    "compact_gather_bf16_h8_d128": ("compact", "bfloat16", dict(kv_heads=8, head_dim=128, gather=True)),
    "compact_scatter_bf16_h8_d128": ("compact", "bfloat16", dict(kv_heads=8, head_dim=128, gather=False)),
    "compact_gather_fp32_h3_d24": ("compact", "float32", dict(kv_heads=3, head_dim=24, gather=True)),
    "compact_scatter_fp16_h1_d64": ("compact", "float16", dict(kv_heads=1, head_dim=64, gather=False)),
}
DTYPE_FREE = ("reduce", "compact")  # constexpr helpers that take no dtype; neither kernel has a dot

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    try:
        import triton
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.backends.nvidia.compiler import get_ptxas
        if "nvidia" not in backends:
            raise ImportError(f"triton backends are {sorted(backends)}")
    except Exception as e:  # noqa: BLE001 - any failure to load the backend means: cannot run here
        print(json.dumps({"skip": f"triton nvidia backend cannot be loaded: {e!r}"}))
        sys.exit(0)
    try:
        ptxas = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"skip": f"triton's bundled ptxas is missing, cannot compile for sm_90: {e!r}"}))
        sys.exit(0)

    from specpd.kernels import kv_compact as kc
    from specpd.kernels import paged_attention as pa

    KERNELS = {
        "extend": (pa._extend_kernel, pa.extend_constexprs, ("Q", "K", "V", "Out")),
        "decode": (pa._decode_split_kernel, pa.decode_constexprs, ("Q", "K", "V")),
        "reduce": (pa._decode_reduce_kernel, pa.reduce_constexprs, ("Out",)),
        "compact": (kc._move_slots_kernel, kc.compact_constexprs, ("Pool", "Staging")),
    }
    TY = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
    I32_POINTERS = ("QoIndptr", "KvLens", "PageTable", "TreeMaskIndptr")
    I64_POINTERS = ("Pages", "Offsets")
    F32_POINTERS = ("PartialOut", "PartialLse")
    BOOL_POINTERS = ("TreeMask",)

    def signature(fn, dtype_ty, data_pointers, constexprs):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                sig[name] = "constexpr"
                continue
            if name in data_pointers:
                sig[name] = "*" + dtype_ty
            elif name in I32_POINTERS:
                sig[name] = "*i32"
            elif name in I64_POINTERS:
                sig[name] = "*i64"
            elif name in BOOL_POINTERS:
                sig[name] = "*i1"
            elif name in F32_POINTERS:
                sig[name] = "*fp32"
            else:
                sig[name] = "fp32" if name == "sm_scale_log2" else "i32"
                continue
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        return sig, attrs

    results = {"ptxas": ptxas}
    variants, dtype_free = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for name, (kind, dtype, args) in variants.items():
        fn, make_constexprs, data_pointers = KERNELS[kind]
        constexprs = make_constexprs(**args) if kind in dtype_free else make_constexprs(getattr(torch, dtype), **args)
        sig, attrs = signature(fn, TY[dtype], data_pointers, constexprs)
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 64))
        except Exception as e:  # noqa: BLE001 - reported per variant
            results[name] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            continue
        ptx = kernel.asm.get("ptx", "")
        results[name] = {
            "ptx_target": next((ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".target")), None),
            "ptx_chars": len(ptx),
            "cubin_bytes": len(kernel.asm.get("cubin", b"")),
            "tensor_core": "mma" in ptx,
            "shared_bytes": kernel.metadata.shared,
            "num_warps": kernel.metadata.num_warps,
        }
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a triton 3.9 deprecation warning
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-c", SCRIPT, json.dumps(VARIANTS), json.dumps(DTYPE_FREE)]
    proc = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"compile subprocess failed:\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_to_sm90_cubin(compiled, name):
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["ptx_target"] in ("sm_90", "sm_90a")
    assert result["ptx_chars"] > 0
    assert result["cubin_bytes"] > 0, f"ptxas at {compiled['ptxas']} produced no cubin"
    assert result["shared_bytes"] <= 227 * 1024  # Hopper's per-block shared memory limit
    kind, dtype, _ = VARIANTS[name]
    if kind not in DTYPE_FREE and dtype != "float32":
        assert result["tensor_core"], "fp16/bf16 dots should lower to mma/wgmma"
