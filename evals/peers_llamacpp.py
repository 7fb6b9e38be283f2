"""llama.cpp's HTTP server (OpenAI-compatible /v1/completions, /health, /metrics) from the xllamacpp wheel.

Run by evals/peers.py with .peers/llamacpp/bin/python (imports nothing from specpd). Left at
llama.cpp's defaults except what serving N requests at once needs (N slots of --ctx-per-slot tokens each)
and the n-gram drafter's sizes where given.
"""
import argparse
import signal
import sys
import time

import xllamacpp

SPEC_TYPES = {"ngram-simple": xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parallel", type=int, default=1, help="slots: requests served at once")
    ap.add_argument("--ctx-per-slot", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=None, help="default: llama.cpp's")
    ap.add_argument("--spec-type", choices=sorted(SPEC_TYPES), default=None)
    ap.add_argument("--ngram-size-n", type=int, default=None, help="ngram-simple: tokens looked up (llama.cpp: 12)")
    ap.add_argument("--ngram-size-m", type=int, default=None, help="ngram-simple: tokens drafted (llama.cpp: 48)")
    args = ap.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.port = args.port
    params.n_parallel = args.parallel
    params.n_ctx = args.parallel * args.ctx_per_slot
    params.endpoint_metrics = True
    if args.threads:
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    if args.spec_type:
        params.speculative.types = [SPEC_TYPES[args.spec_type]]
    if args.ngram_size_n:
        params.speculative.ngram_simple.size_n = args.ngram_size_n
    if args.ngram_size_m:
        params.speculative.ngram_simple.size_m = args.ngram_size_m
    server = xllamacpp.Server(params)  # serves HTTP on its own threads
    print(f"llama.cpp server on {server.listening_address}; {xllamacpp.get_system_info()}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
