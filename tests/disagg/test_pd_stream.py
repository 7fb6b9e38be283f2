"""KV streamed per prefill chunk (`--pd-stream-chunks`, on by default) over real processes on 127.0.0.1 (the tiny
random Llama, EAGLE in both draft modes, draft-on-decode-only over Mooncake where it loads; token-id prompts sent
to P and D by hand, chunks of 6 tokens over pages of 4; P waits for D's pages, `--no-pd-optimistic-prefill`, so
every chunk after the first streams):

- prompts of 6-7 chunks (one with a partial last page) through a streaming P and a non-streaming P into one D:
  tokens and acceptance equal the unified engine's; the streaming P wrote pages before the last chunk, the
  other none; draft-on-decode-only, D ran its draft extend over each streamed chunk's target features as they
  came, the last chunk's included (sent ahead of the record, all but the prompt's last position); the second
  prompt per P hits D's prefix cache (P sends only the pages after it); every page
  comes back on both Ps and D;
- a transfer that fails after the first chunk's write (an in-process P whose backend fails its second write
  call): D's request fails, the rest of the prompt is never sent, and every page comes back on P and D.
"""
import concurrent.futures
import time

import httpx
import pytest

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.disagg.transfer import TransferError, backend_available
from specpd.disagg.worker import BootstrapInfo
from specpd.engine.llm_engine import LLMEngine
from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import eagle_dir, engine_args, model_dir, servers, tiny  # noqa: F401
from tests.disagg.test_pd_optimistic import info, tokens_of, wait_pages_back

CHUNK = 6  # not a multiple of the page size: a chunk may end inside a page (not final then)
PROMPTS = [[(5 * i + 3) % 300 + 10 for i in range(38)],  # 7 chunks, 10 pages (the last one partial)
           [(11 * i + 7) % 300 + 10 for i in range(32)]]  # 6 chunks, 8 full pages
MAX_TOKENS = 10


def spec_args(eagle_dir, mode) -> list[str]:
    return ["--speculative-algorithm", "eagle", "--draft-model", eagle_dir, "--spec-num-steps", "3",
            "--draft-mode", mode, "--no-spec-adaptive", "--chunked-prefill-size", str(CHUNK),
            "--spec-ngram-store-tokens", "0"]  # hybrid (the default) without the shared store: D sees each prompt twice


def body(prompt: list[int], boot: int, room: int) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}


def handoff(p_url: str, d_url: str, prompt: list[int], boot: int, room: int) -> httpx.Response:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prefill = pool.submit(httpx.post, p_url + "/v1/completions", json=body(prompt, boot, room), timeout=60)
        resp = httpx.post(d_url + "/v1/completions", json=body(prompt, boot, room), timeout=60)
        prefill.result(timeout=30)
    return resp


@pytest.mark.parametrize("mode,backend", [("both", "tcp"),
                                          ("decode-only", "mooncake" if backend_available("mooncake")[0] else "tcp")])
def test_streamed_chunks_match_unified(model_dir, eagle_dir, mode, backend):  # noqa: F811
    boots = [free_port(), free_port()]
    both = ["--transfer-backend", backend, *engine_args(model_dir), *spec_args(eagle_dir, mode)]
    specs = [["--role", "prefill", "--bootstrap-port", str(boots[0]), "--no-pd-optimistic-prefill", *both],
             ["--role", "prefill", "--bootstrap-port", str(boots[1]), "--no-pd-optimistic-prefill",
              "--no-pd-stream-chunks", *both],
             ["--role", "decode", "--pd-local-prefill-tokens", "0", *both]]
    spec = SpecConfig("eagle", draft_model=eagle_dir, spec_num_steps=3, draft_mode=mode, spec_adaptive=False,
                      spec_ngram_store_tokens=0)
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=128), spec=spec,
                                    scheduler=SchedulerConfig(chunked_prefill_size=CHUNK)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [(o.token_ids, (o.spec_verify_count, o.spec_accepted_tokens)) for o in engine.generate(PROMPTS, params)]
    with servers(specs) as (p_on, p_off, d_url):
        # each prompt once through either P: the second time D's cache holds all but its last page
        for room, (which, p) in enumerate([(0, 0), (0, 1), (1, 1), (1, 0)]):
            resp = handoff((p_on, p_off)[p], d_url, PROMPTS[which], boots[p], 100 + room)
            usage = resp.json()["usage"] if resp.status_code == 200 else {}
            assert (tokens_of(resp), (usage["spec_verify_count"], usage["spec_accepted_tokens"])) == want[which]
        for url in (p_on, p_off, d_url):
            wait_pages_back(url)
        on, off = info(p_on), info(p_off)
        assert on["kv_streamed_pages"] > 0 and off["kv_streamed_pages"] == 0, (on, off)
        assert on["kv_transfers"] == off["kv_transfers"] == 2
        # decode-only: D drafted the streamed chunks' positions from their TargetFeatures before the commit
        # (the streaming P's two rooms; the second after D's cached prefix), not all at commit
        # and the last chunk's ahead of the record but its last position (whose draft input is y0): 37 positions
        # of the first prompt, 3 of the second after D's 28 cached tokens
        assert info(d_url)["pd_draft_streamed_tokens"] == (40 if mode == "decode-only" else 0)


def test_transfer_failing_mid_stream_leaks_nothing(model_dir):  # noqa: F811
    """An in-process P (its backend's second write call fails) and a real D: the first chunk's pages were
    written, then the write fails; P stops sending, waits for its writes, tells D, and both free every page."""
    from specpd.disagg.prefill import PrefillWorker
    boot = free_port()
    with servers([["--role", "decode", "--transfer-backend", "tcp", *engine_args(model_dir),
                   "--chunked-prefill-size", str(CHUNK)]]) as (d_url,):
        engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=128),
                                        scheduler=SchedulerConfig(chunked_prefill_size=CHUNK)))
        worker = PrefillWorker(engine, "tcp", bootstrap_port=boot, optimistic_prefill=False)
        calls = []
        write = worker.backend._write

        def failing_write(*args):
            calls.append(len(args[1]))
            if len(calls) >= 2:
                raise TransferError("tcp: injected failure")
            write(*args)

        worker.backend._write = failing_write
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                worker.expect("r0", BootstrapInfo("127.0.0.1", boot, 7))
                worker.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
                decode = pool.submit(httpx.post, d_url + "/v1/completions", json=body(PROMPTS[0], boot, 7),
                                     timeout=60)
                final, deadline = None, time.monotonic() + 30
                while final is None and time.monotonic() < deadline:
                    final = next((o for o in worker.step() if o.request_id == "r0" and o.finished), None)
                resp = decode.result(timeout=30)
            assert final is not None and final.error and "injected failure" in final.error, final
            assert resp.status_code >= 400 and "injected failure" in resp.text, resp.text
            assert calls[0] == 1 and len(calls) >= 2, calls  # chunk 1's one full page streamed, then a write failed
            assert worker.free_pages == worker.total_pages and not worker.inflight
            wait_pages_back(d_url)
        finally:
            worker.close()


def test_features_from_equals_the_whole_concatenation_sliced():
    """P sends each streamed chunk's and the record's target features by concatenating only the chunks that
    hold them: the same tensor as concatenating every chunk and slicing, at every start (chunk edges included)."""
    import torch

    from specpd.disagg.prefill_send import _features_from
    parts = [torch.randn(n, 3) for n in (5, 1, 4, 6)]
    full = torch.cat(parts)
    for start in range(len(full) + 1):
        assert torch.equal(_features_from(parts, start), full[start:]), start
