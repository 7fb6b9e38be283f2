"""What the prefill and decode workers share: the engine interface AsyncEngine drives, the transfer backend,
the PeerConfig, and the bootstrap fields the router put in the request body.

A worker wraps an LLMEngine and is driven exactly like one (add_request / abort_request / step /
has_unfinished_requests / stats) from AsyncEngine's engine thread, so every queue, socket poll and page
operation happens on that one thread. The HTTP handler (loop thread) only calls `expect` before submit.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import zmq

from specpd.core import InvalidRequest, RequestOutput
from specpd.disagg.messages import PeerConfig
from specpd.disagg.transfer import create_backend

IDLE_POLL_S = 0.002  # how long an idle step waits on the control sockets (the engine thread spins on us)


@dataclass(frozen=True)
class BootstrapInfo:
    """The router's injected fields: where P's bootstrap server is, and the room that pairs P and D."""

    host: str
    port: int
    room: int

    @classmethod
    def from_body(cls, body: dict) -> "BootstrapInfo":
        for name, kind in (("bootstrap_host", str), ("bootstrap_port", int), ("bootstrap_room", int)):
            if not isinstance(body.get(name), kind) or isinstance(body.get(name), bool):
                raise InvalidRequest(name, f"a {kind.__name__} is required on a prefill/decode server "
                                     f"(send requests through `specpd serve --role router`)")
        return cls(body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"])


def draft_mode(config) -> str:
    """PeerConfig.draft_mode: where the draft extend over the prompt runs (messages.DRAFT_MODES).

    "none" without a draft model (no speculation, or the replay drafter, which keeps no per-prompt state)."""
    spec = config.spec
    if not spec.enabled or spec.speculative_algorithm == "replay":
        return "none"
    return "both" if spec.draft_mode == "both" else "decode_only"


def page_pools(engine) -> list:
    """Pools moved per page id: the target pool, whose pages also hold the draft's layers when the draft's KV
    geometry matches (one descriptor per page); else, draft-on-both, the draft's own pool (same page ids).
    In draft-on-decode-only mode P's pages hold no draft layers: P writes the prefix of D's pages."""
    pools = [engine.runner.kv_pool.buffer]  # [num_pages, layers, 2, page_size, kv_heads, head_dim]
    draft_pool = getattr(engine.spec_runner.proposer, "pool", None) if engine.spec_runner else None
    if draft_pool is not None and draft_pool.parent is None and draft_mode(engine.config) == "both":
        pools.append(draft_pool.buffer)  # a draft with its own KV geometry: a second descriptor per page
    return pools


def peer_config(engine) -> PeerConfig:
    cfg = engine.config
    return PeerConfig(model=cfg.model, draft_model=cfg.spec.draft_model, page_size=cfg.cache.page_size,
                      dtype=cfg.dtype, spec_algorithm=cfg.spec.speculative_algorithm, draft_mode=draft_mode(cfg))


class DisaggWorker:
    role = "worker"

    def __init__(self, engine, transfer_backend: str, host: str = "127.0.0.1"):
        self.engine = engine
        self.transfer_backend = transfer_backend
        self.host = host
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.peer_config = peer_config(engine)
        self.backend = create_backend(transfer_backend, host)
        self.backend.register(page_pools(engine))
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self._expected: dict[str, BootstrapInfo] = {}  # request id -> room; written by the loop thread
        self._lock = threading.Lock()
        self._outputs: list[RequestOutput] = []  # produced by the disagg stages, returned by the next step

    # -- loop thread -----------------------------------------------------------------------
    def expect(self, request_id: str, info: BootstrapInfo) -> None:
        with self._lock:
            self._expected[request_id] = info

    def _take_expected(self, request_id: str) -> BootstrapInfo:
        with self._lock:
            info = self._expected.pop(request_id, None)
        if info is None:
            raise InvalidRequest("bootstrap_room", "missing (send requests through the router)")
        return info

    # -- engine thread: the LLMEngine interface --------------------------------------------
    @property
    def free_pages(self) -> int:
        return self.engine.free_pages

    @property
    def total_pages(self) -> int:
        return self.engine.total_pages

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.queue_sizes(), "transfer_backend": self.transfer_backend,
                "peer_config": dataclasses.asdict(self.peer_config)}

    def queue_sizes(self) -> dict:
        return {}

    def disagg_busy(self) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or self.disagg_busy() or bool(self._outputs)

    def step(self) -> list[RequestOutput]:
        engine_busy = self.engine.has_unfinished_requests()
        self.poll_control(timeout_ms=0 if engine_busy else int(IDLE_POLL_S * 1000))
        outputs = self.engine.step() if engine_busy else []
        outputs = self.on_engine_outputs(outputs)
        self.advance()
        outputs, self._outputs = self._outputs + outputs, []
        return outputs

    def poll_control(self, timeout_ms: int) -> None:
        raise NotImplementedError

    def on_engine_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        return outputs

    def advance(self) -> None:
        pass

    def close(self) -> None:
        self.backend.close()

    def _final(self, request_id: str, num_prompt_tokens: int, reason: str, error: str | None = None,
               token_ids: list[int] | None = None) -> None:
        ids = token_ids or []
        self._outputs.append(RequestOutput(request_id, ids, "", ids, "", True, reason, num_prompt_tokens,
                                           error=error))
