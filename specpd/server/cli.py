"""The `specpd` command (also `python -m specpd`).

  specpd serve    --model default --port 8000 [engine flags]   OpenAI-compatible HTTP server
  specpd serve    --role prefill --port 8100 --bootstrap-port 8998 --transfer-backend tcp
  specpd serve    --role decode  --port 8200 --transfer-backend tcp
  specpd serve    --role router  --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
  specpd serve    --disagg 1p1d --port 8000 [engine flags]        P, D and the router as child processes
  specpd generate --model default --prompt TEXT [--chat] [--json] [engine flags]
                                                                one request, in-process, then exit
  specpd train-draft --target MODEL --algorithm eagle3 --out DIR  train a draft (specpd/train/cli.py)

Engine flags are generated from the fields of EngineConfig (specpd/server/engine_args.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from specpd.server.engine_args import add_engine_args, config_from_args
from specpd.server.ready import ready_message

logger = logging.getLogger("specpd")

ROLES = ("unified", "prefill", "decode", "router")  # PD roles: specpd/disagg
PD_SWITCH_INTERVAL_S = 0.0005  # a transfer thread waits at most this long for the GIL (default 5 ms)


# -- serve -----------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    from specpd.admission import api_key_of, warn_if_open
    args.api_key = api_key_of(args.api_key, args.api_key_file, args.argv)  # every role takes it (a bad file exits)
    if args.disagg:  # a whole PD cluster as child processes (no torch in this one)
        from specpd.server.cluster import run_cluster
        return run_cluster(args, args.argv)
    import uvicorn

    if args.role == "router":  # no torch in this process
        from specpd.disagg.router import create_router_app
        if not args.prefill or not args.decode:
            print("specpd serve --role router needs --prefill URL and --decode URL", file=sys.stderr)
            return 2
        warn_if_open(args.host, args.api_key, "the router")
        app = create_router_app(args.prefill, args.decode, args.bootstrap_port,
                                max_request_bytes=args.max_request_bytes, api_key=args.api_key,
                                cluster_ready_file=args.cluster_ready_file, restart_wait_s=args.pd_restart_wait)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_graceful_shutdown=5))
        asyncio.run(_serve(server, args.host, args.port, "router", role="router"))
        return 0

    from specpd.engine.llm_engine import LLMEngine
    from specpd.server.api_server import create_app
    from specpd.server.async_engine import EngineThread

    config = config_from_args(args)
    if args.role in ("prefill", "decode"):
        # KV moves in transfer threads (P: the backend's writers; D with --transfer-backend tcp: its
        # receiver) that must take the GIL back from the engine thread after every transfer call; at the
        # default 5 ms switch interval that wait can exceed a whole multi-MB write over loopback
        sys.setswitchinterval(PD_SWITCH_INTERVAL_S)
        from specpd.disagg.transfer import default_backend
        transfer_backend = args.transfer_backend or default_backend()
        if transfer_backend == "mooncake" or args.transfer_protocol != "tcp" or args.rdma_devices:
            from specpd.disagg.transfer.mooncake import use_transport
            try:
                use_transport(args.transfer_protocol, args.rdma_devices, transfer_backend)
            except ValueError as e:
                raise SystemExit(f"specpd serve --role {args.role}: {e}") from e
    advertise = args.advertise_host or args.host
    if args.role in ("prefill", "decode") and advertise in ("0.0.0.0", "::", ""):
        raise SystemExit(f"specpd serve --role {args.role}: --host {args.host!r} binds every interface, so peers "
                         f"need an address to reach this server: give --advertise-host (e.g. this host's IP)")

    def build():
        logger.info("loading %s", config.model)
        # draft-on-decode-only: the prefill server runs no draft, it hands D the target features instead
        # a model-free drafter (ngram) lives on D only
        engine = LLMEngine(config, with_draft=not (args.role == "prefill" and (
            config.spec.draft_mode == "decode-only" or config.spec.model_free)),
            pd_role=args.role if args.role in ("prefill", "decode") else None)
        if args.role == "prefill":
            from specpd.disagg.prefill import PrefillWorker
            engine = PrefillWorker(engine, transfer_backend, args.host, args.bootstrap_port,
                                   bootstrap_timeout_s=args.pd_bootstrap_timeout,
                                   optimistic_prefill=args.pd_optimistic_prefill, advertise_host=advertise,
                                   stream_chunks=args.pd_stream_chunks)
        elif args.role == "decode":
            from specpd.disagg.decode import DecodeWorker
            engine = DecodeWorker(engine, transfer_backend, args.host, abort_timeout_s=args.pd_abort_timeout,
                                  prefill_timeout_s=args.pd_prefill_timeout,
                                  transfer_timeout_s=args.pd_transfer_timeout,
                                  heartbeat_timeout_s=args.pd_heartbeat_timeout,
                                  local_prefill_tokens=args.pd_local_prefill_tokens, advertise_host=advertise)
        return engine

    # loaded, calibrated and stepped on one thread: the engine's torch ops never leave it (EngineThread)
    engine_thread = EngineThread(args.engine_priority)
    engine = engine_thread.run(build)
    warn_if_open(args.host, args.api_key, f"the {args.role} server")
    app = create_app(engine, role=args.role, engine_priority=args.engine_priority, engine_thread=engine_thread,
                     max_request_bytes=args.max_request_bytes, max_queued_requests=args.max_queued_requests,
                     api_key=args.api_key, served_model_names=args.served_model_name)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    asyncio.run(_serve(server, args.host, args.port, (args.served_model_name or [engine.model_name])[0],
                       role=args.role))
    return 0


async def _serve(server, host: str, port: int, model_name: str, role: str = "unified") -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:  # the curl only where clients go: a unified server (or --disagg's router, cluster.py)
        print(ready_message(host, port, model_name) if role == "unified"
              else f"specpd {role} ready on http://{host}:{port}", flush=True)
    await task


# -- generate --------------------------------------------------------------------------------
def generate(args: argparse.Namespace) -> int:
    from specpd.core import InvalidRequest, SamplingParams
    from specpd.engine.llm_engine import LLMEngine

    config = config_from_args(args)
    t_load = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t_load
    tokenizer = engine.tokenizer
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text)
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=getattr(args, "engine.seed"),
                                ignore_eos=args.ignore_eos).validate()
        start = time.perf_counter()
        engine.add_request("generate-0", prompt_ids, params)
    except InvalidRequest as err:
        print(f"specpd generate: invalid request: {err}", file=sys.stderr)
        return 2
    first_token_at = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first_token_at is None and out.new_token_ids:
                first_token_at = time.perf_counter()
            if out.finished:
                final = out
    end = time.perf_counter()
    if not args.json:
        print(final.text)
        return 0
    n = final.num_output_tokens
    ttft = (first_token_at or end) - start
    # Decode rate: tokens after the first over the time after the first (TTFT covers the prefill).
    tokens_per_s = (n - 1) / (end - first_token_at) if n > 1 and end > first_token_at else n / (end - start)
    print(json.dumps({
        "model": engine.model_name, "text": final.text, "token_ids": final.token_ids,
        "finish_reason": final.finish_reason, "prompt_tokens": len(prompt_ids), "completion_tokens": n,
        "ttft_s": ttft, "e2e_s": end - start, "tokens_per_s": tokens_per_s, "load_s": load_s,
        "spec_verify_count": final.spec_verify_count, "spec_accepted_tokens": final.spec_accepted_tokens,
        "spec_accept_length": final.spec_accept_length,
        "stats": engine.stats(),
    }, default=str))
    return 0


# -- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpd", description="specpd LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    p.add_argument("--role", choices=ROLES, default="unified", help="what this process serves (default: unified)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model name(s) requests may give and /v1/models lists; responses carry the first "
                        "(default: --model as given)")
    p.add_argument("--engine-priority", choices=("normal", "low"), default="normal",
                   help="low: the engine thread runs under SCHED_IDLE, so this process's HTTP and KV "
                        "transfer threads preempt it the moment they wake (a CPU server whose core also "
                        "moves its KV). Only on a box dedicated to serving: any other busy process "
                        "starves a low-priority engine (default: normal)")
    adm = p.add_argument_group("admission (every role; --disagg passes the key to its children)")
    adm.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on all but /health, "
                     "/metrics, /server_info (401); ps shows it: use $SPECPD_API_KEY or --api-key-file (default: none)")
    adm.add_argument("--api-key-file", metavar="PATH", help="read the key from PATH (refused if group/others may)")
    adm.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, metavar="N",
                     help="larger request bodies get HTTP 413 before they are parsed (default: 8 MiB)")
    adm.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                     help="with N requests waiting for their first token, more get HTTP 503 with Retry-After "
                          "(default: no limit)")
    pd = p.add_argument_group("disaggregation (--role prefill / decode / router)")
    pd.add_argument("--transfer-backend", choices=("mooncake", "tcp"), default=None,
                    help="KV page transfer engine, the same on P and D (default: mooncake where its engine "
                         "loads, else tcp, with a log line saying why; --disagg decides once for all children)")
    pd.add_argument("--transfer-protocol", choices=("tcp", "rdma"), default="tcp",
                    help="mooncake's transport, the same on P and D: tcp (one host, or hosts without RDMA NICs) or "
                         "rdma (P and D on different hosts with RDMA NICs; refused where this machine has none) "
                         "(default: tcp)")
    pd.add_argument("--rdma-devices", default="", metavar="NAMES",
                    help="with --transfer-protocol rdma: the RDMA NICs mooncake may use, comma-separated (e.g. "
                         "mlx5_0,mlx5_1; default: mooncake picks)")
    pd.add_argument("--bootstrap-port", type=int, default=8998,
                    help="prefill: the bootstrap registry's port (/route, /health); router: P's (default: 8998)")
    pd.add_argument("--prefill", metavar="URL", help="router: the prefill server, e.g. http://127.0.0.1:8100")
    pd.add_argument("--decode", metavar="URL", help="router: the decode server, e.g. http://127.0.0.1:8200")
    pd.add_argument("--disagg", metavar="NpMd",
                    help="run a PD cluster: N prefill + M decode servers and a router on --port (e.g. 1p1d)")
    pd.add_argument("--pd-restart-wait", type=float, default=15.0, metavar="S", help="router: a request waits up to S "
                    "s for a P or D that is down (restarting), then gets 503 + Retry-After (default: 15)")
    pd.add_argument("--cluster-ready-file", metavar="PATH",
                    help="router: /health answers 503 until PATH exists (--disagg sets it: the router's /health "
                         "is 200 only once the launcher has printed its ready line and supervises the cluster)")
    pd.add_argument("--prefill-tp", type=int, metavar="N", help="--disagg: the prefill servers' --tp-size (default: "
                    "--tp-size); P and D of any two sizes that divide the KV heads pair (each P rank writes its heads "
                    "into the D ranks holding them)")
    pd.add_argument("--decode-tp", type=int, metavar="N", help="--disagg: the decode servers' --tp-size (default: "
                    "--tp-size)")
    pd.add_argument("--prefill-port", type=int, help="--disagg: first prefill server's port (default: --port+1)")
    pd.add_argument("--decode-port", type=int, help="--disagg: first decode server's port (default: --port+1+N)")
    pd.add_argument("--pd-bootstrap-timeout", type=float, default=300.0, metavar="S",
                    help="prefill: fail a request no decode server claims, or whose D is silent, S s (default: 300)")
    pd.add_argument("--pd-optimistic-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill: start a request's prefill before its decode server offered pages (rooms "
                         "without them hold at most half of P's pool and wait --pd-bootstrap-timeout at most)")
    pd.add_argument("--pd-stream-chunks", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill: with chunked prefill, write each chunk's full KV pages to the decode server "
                         "while the next chunk computes (the handoff record and the last pages follow the last "
                         "chunk)")
    pd.add_argument("--pd-prefill-timeout", type=float, default=300.0, metavar="S",
                    help="decode: fail a request waiting for its handoff record once neither it nor its prefill "
                         "server made progress for S seconds (default: 300)")
    pd.add_argument("--pd-transfer-timeout", type=float, default=60.0, metavar="S",
                    help="decode: fail a request waiting for its KV once neither it nor its prefill server made "
                         "progress (no KV write ended) for S seconds (default: 60)")
    pd.add_argument("--pd-heartbeat-timeout", type=float, default=10.0, metavar="S",
                    help="decode: a prefill server silent for S seconds while it owes rooms is dead (default: 10)")
    pd.add_argument("--advertise-host", metavar="HOST",
                    help="prefill / decode: the address peers reach this server at (its bootstrap route, control "
                         "socket and transfer session), when it is not --host (--host 0.0.0.0, NAT) "
                         "(default: --host)")
    pd.add_argument("--pd-local-prefill-tokens", type=int, default=128, metavar="N",
                    help="decode: when its prefix cache holds all of a prompt but at most N tokens (a multi-turn "
                         "chat's new message), D prefills them itself instead of a round trip to P; 0: never "
                         "(default: 128)")
    pd.add_argument("--pd-abort-timeout", type=float, default=30.0, metavar="S",
                    help="decode: free an aborted room's pages after S seconds without the prefill server's "
                         "confirmation (a frozen P could still write) (default: 30)")
    add_engine_args(p)
    p.set_defaults(func=serve)

    g = sub.add_parser("generate", help="generate for one prompt in-process and exit")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    g.add_argument("--top-k", type=int, default=-1, help="(default: -1, off)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, ttft_s, tokens_per_s = decode rate, ...)")
    g.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    add_engine_args(g)
    g.set_defaults(func=generate)

    from specpd.train.cli import add_arguments as add_train_draft_args  # argparse only; torch loads on run
    add_train_draft_args(sub.add_parser("train-draft", help="train an EAGLE / EAGLE-3 / MTP draft for a target"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[argv.index("serve") + 1:] if "serve" in argv else argv
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
