"""The few-row kernel on or off, side by side (`python evals/kernel_ab.py` -> evals/results/kernel_avx2_ab.json):
lockstep (spec_workloads.lockstep_run) of non-spec on torch matmuls, non-spec on the kernel and EAGLE-3
(defaults) on the kernel, chat prompts, 64 greedy tokens; ratios to non-spec on torch. "off" clears the
engine's packed weights, so the same process and weights run both paths."""
import os, sys, statistics
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
torch.set_num_threads(1)
from common import machine_info, versions, write_json
from spec_workloads import chat_prompts, lockstep_run
from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.kernels import cpu_gemm
from specpd.model.loader import load_checkpoint
from specpd.model.llama import MatmulLinear
ckpt = load_checkpoint("default")
def mk(s, kernel):
    e = LLMEngine(EngineConfig(model="default", dtype="float32", spec=s, num_threads=1,
                               cache=CacheConfig(page_size=16, num_pages=1024),
                               scheduler=SchedulerConfig(max_running_requests=16)), checkpoint=ckpt)
    if not kernel:
        for m in e.runner.model.modules():
            if isinstance(m, MatmulLinear):
                m.weight_packed = None
    return e
print("kernel available", cpu_gemm.available(), cpu_gemm._cpu_isa())
out = {"meta": {"machine": machine_info(), "versions": versions(), "isa": cpu_gemm._cpu_isa()}}
prompts = chat_prompts(ckpt.tokenizer, 40)
params = SamplingParams(max_tokens=64, temperature=0.0)
for b, reps in ((1, 3), (8, 2)):
    engines = {"non_torch": mk(SpecConfig(), False), "non_kernel": mk(SpecConfig(), True),
               "eagle3_kernel": mk(SpecConfig("eagle3", draft_model="default", spec_ngram=False), True)}
    rat = {n: [] for n in engines}
    for rep in range(reps):
        ps = prompts[rep * b:(rep + 1) * b] if b == 1 else prompts[10 + rep * b:10 + (rep + 1) * b]
        r = lockstep_run(engines, ps, params, f"{b}-{rep}")
        for n in engines:
            assert r[n]["tokens"] == r["non_torch"]["tokens"], n
            rat[n].append(r[n]["decode_tok_s"] / r["non_torch"]["decode_tok_s"])
        print(b, rep, {n: round(v[-1], 3) for n, v in rat.items()}, "non_torch tok/s", round(r["non_torch"]["decode_tok_s"], 2), flush=True)
    out[f"b{b}"] = {n: {"median": statistics.median(v), "reps": v} for n, v in rat.items()}
write_json(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kernel_avx2_ab.json"), out)
print(out)
