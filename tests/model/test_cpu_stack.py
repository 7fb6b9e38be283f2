"""The C decoder stack (specpd/model/cpu_stack.py) against the per-layer Python path it replaces, bit for bit:
the same greedy tokens and logprobs, the same EAGLE-3 aux features (captured layers) and the same KV pool bytes,
over ragged prompts across page boundaries, batched decode and tree verify (an EAGLE-3 engine, pinned policy),
and a long prompt chunk (its step takes SDPA and the Python path). Dense weights: bf16 on a CPU with AVX512-BF16,
fp32 on one with AVX-512 (the dtypes the project has a dense GEMM kernel for there); the GGUF's blocks
(quantization gguf, the quantized kernel) in both dtypes on any CPU with AVX2, and in the AVX2 build
(x86-64-v3, in a child process) on this one."""
import os
import subprocess
import sys

import pytest
import torch

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.kernels import cpu_gemm_bf16, cpu_gemm_f32, cpu_gemm_q
from specpd.model import cpu_stack
from specpd.model.loader import load_checkpoint
from tests.spec.test_smollm2 import collect_logprobs

pytestmark = pytest.mark.skipif(cpu_stack._fn() is None, reason="no C compiler (SPECPD_C_KERNELS=0)")
# each dtype where the project's GEMM kernel for it runs (else the stack never builds)
DTYPES = [pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_gemm_bf16.available(), reason="no AVX512-BF16")),
          pytest.param("float32", marks=pytest.mark.skipif(not cpu_gemm_f32.available(), reason="no AVX-512"))]
NO_Q = pytest.mark.skipif(not cpu_gemm_q.available(), reason="no quantized kernel (AVX2)")
# (dtype, quantization): the dense kernels' dtypes, and the GGUF's blocks in both
CASES = [pytest.param(p.values[0], "none", marks=p.marks, id=f"{p.values[0]}-dense") for p in DTYPES] + [
    pytest.param(dtype, "gguf", marks=NO_Q, id=f"{dtype}-gguf") for dtype in ("float32", "bfloat16")]

NUM_PAGES = 96
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("default")


def _prompts(tok):
    texts = ["What is the capital of France?", "Write a haiku about rain on a tin roof, then explain it.",
             "Name three prime numbers."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in texts]
    return prompts + [prompts[1] * 9]  # a long prompt: its chunk attends through SDPA, the step in Python


def _run(checkpoint, prompts, spec, stack: bool, dtype: str, quantization: str = "none"):
    engine = LLMEngine(EngineConfig(model="default", dtype=dtype, spec=spec, quantization=quantization,
                                    cache=CacheConfig(page_size=16, num_pages=NUM_PAGES)), checkpoint=checkpoint)
    model = engine.runner.model
    calls = {"stack": 0, "features": []}
    if not stack:
        model.cpu_stack = None
    else:
        assert model.cpu_stack is not None
        run = model.cpu_stack.run

        def counted(*a, **k):
            out = run(*a, **k)
            if out is not None:
                calls["stack"] += 1
                calls["features"].extend(c.clone() for c in out[1])
            return out
        model.cpu_stack.run = counted
    outs = [[(lp.token_id, lp.logprob, lp.top) for lp in r] for r in collect_logprobs(engine, prompts, params=PARAMS)]
    assert engine.free_pages == NUM_PAGES
    return outs, engine.runner.kv_pool.buffer.clone(), calls


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("eagle3", draft_model="default", spec_num_steps=3,
                                                           spec_topk=2, spec_num_draft_tokens=6,
                                                           spec_adaptive_pinned=True)], ids=["plain", "eagle3"])
@pytest.mark.parametrize("dtype,quantization", CASES)
def test_stack_equals_python_path(checkpoint, spec, dtype, quantization):
    prompts = _prompts(checkpoint.tokenizer)
    want, want_kv, _ = _run(checkpoint, prompts, spec, stack=False, dtype=dtype, quantization=quantization)
    got, got_kv, calls = _run(checkpoint, prompts, spec, stack=True, dtype=dtype, quantization=quantization)
    assert calls["stack"] > 0
    if spec.speculative_algorithm != "none":
        assert calls["features"], "the EAGLE-3 target's aux layers were captured by the stack"
    assert got == want  # every request's tokens, logprobs and top-2, bit for bit
    assert all(len(g) == 16 for g in got)
    assert torch.equal(got_kv, want_kv)  # every K/V byte, target and draft layers


@pytest.mark.parametrize("dtype", DTYPES)
def test_stack_declines_what_it_does_not_run(checkpoint, dtype):
    engine = LLMEngine(EngineConfig(model="default", dtype=dtype,
                                    cache=CacheConfig(page_size=16, num_pages=NUM_PAGES)), checkpoint=checkpoint)
    stack = engine.runner.model.cpu_stack
    h = torch.zeros(2, stack.hidden, dtype=stack.dtype)
    with torch.enable_grad():
        assert stack.run(h, None, engine.runner.backend, None, ()) is None  # autograd: the Python path
    other = torch.float32 if stack.dtype == torch.bfloat16 else torch.bfloat16
    assert stack.run(h.to(other), None, engine.runner.backend, None, ()) is None  # not the weights' dtype
    fp16 = LLMEngine(EngineConfig(model="default", dtype="float16", cache=CacheConfig(page_size=16, num_pages=8)),
                     checkpoint=checkpoint)
    assert fp16.runner.model.cpu_stack is None  # no GEMM kernel of the project's for fp16


@NO_Q
def test_the_avx2_build_runs_the_quantized_stack():
    """On an AVX2 box (x86-64-v3, built here in a child process) the dense kernels are off but a model in GGUF
    blocks still runs its stack, equal to the Python path bit for bit."""
    from specpd.machine import cpu_flags
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    probe = ("from specpd.kernels import cpu_gemm_f32, cpu_gemm_q; from specpd.model import cpu_stack; "
             "assert cpu_gemm_q.path() == 'avx2' and not cpu_gemm_f32.available() and cpu_stack._fn() is not None")
    env = {**os.environ, "SPECPD_KERNEL_MARCH": "x86-64-v3"}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-x", "-k",
                           "stack_equals_python_path and gguf"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
