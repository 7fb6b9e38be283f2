#!/usr/bin/env bash
# The one prepared GPU check (issue 67), for a session lent a GPU machine: it installs nothing from the network.
#
#   bash evals/gpu_check.sh [OUT]      the check; logs, test results and gpu.json under OUT (default evals/results)
#   bash evals/gpu_check.sh stage N    append part N of .gpu_stage/ (evals/gpu_stage.py) under /tmp/specpd-stage
#
# The check, in order, each step under its own timeout so that one run fits in about 8 minutes:
#   1. the parts staged by earlier calls (if all are there): the tar reassembled and its sha256 checked, its wheels
#      installed offline into /tmp/site (gguf; pyzmq and Mooncake's CUDA build when packed), the default model and
#      the prompts handed to the bench;
#   2. the GPU tests (tests/gpu: Triton kernels and backends against the torch reference, captured CUDA graphs
#      against eager forward by forward and token for token, speculation exact on the device, PD with KV in GPU
#      memory over Mooncake where staged; the sm_90 compile test; FlashInfer where installed) with
#      TRITON_INTERPRET=0 (TEST_TIMEOUT, default 270 s);
#   3. evals/gpu.py (BENCH_TIMEOUT, default 210 s): decode steps b1 / b32 with and without graphs, a verify
#      forward, EAGLE-3 chat c1 and n-gram grounded c1 against plain (staged weights only), PD against unified,
#      graphs against eager tokens, each target judged -> OUT/gpu.json (written cell by cell: a timeout keeps
#      what was measured).
# Uses the machine's own python3 (torch with CUDA, triton, transformers, pytest); PYTHON overrides it.
set -u
stage=/tmp/specpd-stage
if [ "${1:-}" = stage ]; then
  part=$(printf 'part%02d' "$2")
  mkdir -p "$stage" && cp .gpu_stage/manifest.json "$stage/" && cp ".gpu_stage/$part" "$stage/$part" || exit 1
  ls -la "$stage"
  exit 0
fi
out="${1:-evals/results}"
mkdir -p "$out"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
bench_args=()

if [ -f "$stage/manifest.json" ]; then  # 1. what the earlier calls staged
  missing=$($py -c "import json, os; m = json.load(open('$stage/manifest.json')); print(' '.join(p for p in m['parts'] if not os.path.exists('$stage/' + p)))")
  if [ -n "$missing" ]; then
    echo "staged parts missing: $missing (the staged cells will say why they were not measured)" | tee "$out/gpu_stage.txt"
  else
    parts=$($py -c "import json; print(' '.join(json.load(open('$stage/manifest.json'))['parts']))")
    want=$($py -c "import json; print(json.load(open('$stage/manifest.json'))['sha256'])")
    (cd "$stage" && cat $parts > stage.tar)
    if [ "$(sha256sum "$stage/stage.tar" | cut -d' ' -f1)" = "$want" ]; then
      mkdir -p "$stage/payload" && tar -xf "$stage/stage.tar" -C "$stage/payload"
      if ls "$stage/payload/wheels/"*.whl > /dev/null 2>&1; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "$stage/payload/wheels/"*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
      fi
      model=$($py -c "import json; print(json.load(open('$stage/manifest.json'))['model'] or '')")
      [ -n "$model" ] && bench_args+=(--model "$stage/payload/$model")
      bench_args+=(--prompts "$stage/payload/prompts.json")
      echo "staged: $(ls "$stage/payload" "$stage/payload/wheels" | tr '\n' ' ')" | tee "$out/gpu_stage.txt"
    else
      echo "staged tar's sha256 differs from the manifest's: not used" | tee "$out/gpu_stage.txt"
    fi
  fi
fi

{ nvidia-smi -L; $py -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } 2>&1 | tee "$out/gpu_env.txt"

# 2. the GPU tests
timeout "${TEST_TIMEOUT:-270}" $py -m pytest -q -p no:cacheprovider -rfEs --durations=15 \
  tests/gpu tests/kernels/test_compile_sm90.py tests/attention/test_flashinfer_backend.py \
  --junitxml="$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1
echo "tests rc=$?" | tee -a "$out/gpu_env.txt"
grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3

# 3. the bench
# BENCH_EXTRA: more flags (a dry run of this script on a CPU: BENCH_EXTRA=--smoke PYTHON=.venv/bin/python)
timeout "${BENCH_TIMEOUT:-210}" $py -m evals.gpu ${bench_args[@]+"${bench_args[@]}"} ${BENCH_EXTRA:-} \
  --out "$out/gpu.json" > "$out/gpu_bench.log" 2>&1
echo "bench rc=$?" | tee -a "$out/gpu_env.txt"
tail -40 "$out/gpu_bench.log"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -40
