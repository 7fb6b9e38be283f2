"""The CPU paged-attention kernel alone, against an earlier version of its source, interleaved.

One "step" is 30 layer calls (SmolLM2-135M: 9 query heads over 3 KV heads, head dim 64, page 16) through the
backend's hot path (`Prepared.run`: the KV write of the step's rows, then attention), over the engine's pool (a
KVPool, on huge pages where Linux gives them) whose pages are shuffled, at the shapes a server meets: decode at
batch 1, 8, 32 with 300-800 tokens of context, and an 8-node tree verify per request at batch 8 and 32. The kernel
in the working tree runs against `--against REV`'s csrc/cpu_attention.c (compiled here with the same flags, its
bf16 paths switched as the engine's: common.kernel_at), in rotated order, rep by rep; the outputs are compared bit
for bit.

    .venv/bin/python -m evals.kernels_attention --against a3fe0bd     → evals/results/kernels_attention.json

Prefill chunks (512 rows after 512 or 1536 tokens) also time torch's SDPA on the same K/V gathered once (its
CPU flash attention, bf16 GEMMs): what a GEMM-based prefill path would cost, not what the engine runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
EVALS_DIR = os.path.dirname(os.path.abspath(__file__))

import torch

from evals.harness.results import REPO_ROOT, command_line, log, machine_info, versions, write_json
from evals.kernels_against import kernel_at
from specpd.kernels.cpu_attention import Prepared, _kernel
from specpd.kv.pool import KVPool
from specpd.machine import isa

LAYERS, HQ, HKV, D, PS = 30, 9, 3, 64, 16
CASES = {"decode_b1_ctx300": (1, 300, 1), "decode_b8_ctx300": (8, 300, 1), "decode_b32_ctx350": (32, 350, 1),
         "decode_b32_ctx800": (32, 800, 1), "verify_tree8_b8_ctx300": (8, 300, 8),
         "verify_tree8_b32_ctx350": (32, 350, 8), "prefill_chunk512_after512": (1, 512, 512),
         "prefill_chunk512_after1536": (1, 1536, 512)}
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4]  # an 8-node draft tree, two branches deep


def make_case(batch: int, ctx: int, q_len: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    pages_per = (ctx + q_len + PS - 1) // PS
    num_pages = batch * pages_per + 4
    # the engine's pool (specpd/kv/pool.py): its page layout, [kv heads, layers, K/V, page positions, head dim] in
    # memory read through the logical [pages, layers, K/V, positions, heads, head dim] view, and on huge pages where
    # Linux gives them (on 4 KB pages every 4 KB block of K and V a chunk reads was a TLB miss: on a Zen 4 EPYC a b8 /
    # b32 decode step's attention read ~8% / ~13% slower than over the engine's pool)
    pool = KVPool(num_pages, LAYERS, PS, HKV, D, dtype)
    pool.storage.copy_(torch.randn(pool.storage.shape, generator=gen))
    buf = pool.buffer
    table = torch.randperm(num_pages, generator=gen)[:batch * pages_per].view(batch, pages_per).to(torch.int32)
    kv_lens = torch.full((batch,), ctx + q_len, dtype=torch.int32)
    qo = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    pos = torch.arange(ctx, ctx + q_len).repeat(batch)
    slots = torch.tensor([int(table[b, (ctx + j) // PS]) * PS + (ctx + j) % PS
                          for b in range(batch) for j in range(q_len)], dtype=torch.long)
    tree = tree_indptr = None
    if 1 < q_len <= len(PARENTS):
        mask = torch.zeros(q_len, q_len, dtype=torch.bool)
        for i, p in enumerate(PARENTS[:q_len]):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        tree = mask.flatten().repeat(batch).contiguous()
        tree_indptr = torch.arange(0, (batch + 1) * q_len * q_len, q_len * q_len, dtype=torch.int32)
    prep = Prepared(buf, HQ, D ** -0.5, slots, qo, kv_lens, table.contiguous(), tree, tree_indptr)
    cos, sin = torch.randn(8192, D, generator=gen), torch.randn(8192, D, generator=gen)
    qkv = torch.randn(batch * q_len, HQ + 2 * HKV, D, generator=gen).to(dtype)
    step = lambda: [prep.run(qkv, pos, cos, sin, layer) for layer in range(LAYERS)]  # noqa: E731
    sdpa = None
    if batch == 1 and q_len > len(PARENTS):  # a prefill chunk: torch's SDPA over the same K/V, gathered once
        k = buf[table[0].long(), :, 0].permute(1, 2, 0, 3, 4).reshape(LAYERS, HKV, -1, D)[:, :, :ctx + q_len]
        v = buf[table[0].long(), :, 1].permute(1, 2, 0, 3, 4).reshape(LAYERS, HKV, -1, D)[:, :, :ctx + q_len]
        q = qkv[:, :HQ].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, q_len, D]
        visible = torch.arange(ctx + q_len).unsqueeze(0) <= torch.arange(ctx, ctx + q_len).unsqueeze(1)

        def sdpa():
            return [torch.nn.functional.scaled_dot_product_attention(
                q, k[layer].unsqueeze(0), v[layer].unsqueeze(0), attn_mask=visible, enable_gqa=True)
                for layer in range(LAYERS)]
    return step, prep, sdpa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="a git revision whose csrc/cpu_attention.c to compare with")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "evals", "results", "kernels_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result = {"benchmark": "attention", "command": command_line(), "machine": machine_info(),
              "versions": versions(), "isa": isa(), "args": vars(args), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        against = kernel_at(args.against, "cpu_attention.c", tmp).specpd_attention
        against.argtypes, against.restype = _kernel().argtypes, _kernel().restype
        kernels = {"current": _kernel(), "against": against}
        for name, (batch, ctx, q_len) in CASES.items():
            step, prep, sdpa = make_case(batch, ctx, q_len, dtype)
            outs, times = {}, {k: [] for k in kernels}
            for k, fn in kernels.items():
                prep.fn = fn
                outs[k] = step()  # warm-up, and the outputs compared
            order = list(kernels)
            # the steps of up to 64 rows take milliseconds, and this box's noise is as large: five times the pairs
            for rep in range(args.reps * (5 if batch * q_len <= 64 else 1)):
                for k in order[rep % 2:] + order[:rep % 2]:
                    prep.fn = kernels[k]
                    t = time.perf_counter()
                    step()
                    times[k].append(time.perf_counter() - t)
            ratios = [a / c for a, c in zip(times["against"], times["current"])]
            if sdpa is not None:  # what a GEMM-based attention (oneDNN / AMX in bf16) costs on the same chunk
                sdpa()
                times["torch_sdpa"] = []
                for _ in range(max(3, args.reps // 3)):
                    t = time.perf_counter()
                    sdpa()
                    times["torch_sdpa"].append(time.perf_counter() - t)
            cell = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}
            cell.update({f"{k}_ms_spread": [1e3 * min(v), 1e3 * max(v)] for k, v in times.items()})
            cell["speedup"] = statistics.median(ratios)
            cell["speedup_spread"] = [min(ratios), max(ratios)]
            cell["bit_identical"] = all(torch.equal(a, b) for a, b in zip(outs["current"], outs["against"]))
            result["cases"][name] = cell
            log(f"{name}: current {cell['current_ms']:.2f} ms, against {cell['against_ms']:.2f} ms, "
                f"x{cell['speedup']:.2f} [{cell['speedup_spread'][0]:.2f}, {cell['speedup_spread'][1]:.2f}], "
                f"bit-identical {cell['bit_identical']}"
                + (f", torch SDPA {cell['torch_sdpa_ms']:.2f} ms" if "torch_sdpa_ms" in cell else ""))
    write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
