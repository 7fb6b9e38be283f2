#!/usr/bin/env bash
# One pass of the GPU checks, for a session that is lent a GPU machine (see the developers' guide):
# the CUDA tests (Triton kernels and backends against the torch reference, the engine and speculation on
# the device), the sm_90 compile test, then evals/bench_gpu.py. Writes logs and gpu.json under $1
# (default evals/results). Uses the machine's own python3 (torch with CUDA, triton, transformers, pytest).
set -u
out="${1:-evals/results}"
mkdir -p "$out"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py="${PYTHON:-python3}"
{ nvidia-smi -L; $py -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } 2>&1 | tee "$out/gpu_env.txt"
timeout "${TEST_TIMEOUT:-300}" $py -m pytest -q -p no:cacheprovider -rfEs --durations=10 \
  tests/gpu tests/kernels/test_compile_sm90.py tests/attention/test_flashinfer_backend.py \
  --junitxml="$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1
echo "tests rc=$?" | tee -a "$out/gpu_env.txt"
grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3
timeout "${BENCH_TIMEOUT:-220}" $py evals/bench_gpu.py --out "$out/gpu.json" > "$out/gpu_bench.log" 2>&1
echo "bench rc=$?" | tee -a "$out/gpu_env.txt"
tail -25 "$out/gpu_bench.log"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -40
