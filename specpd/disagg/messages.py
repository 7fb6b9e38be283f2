"""Control-plane messages between a prefill server (P) and a decode server (D), and their one codec.

One request's handoff, keyed by `bootstrap_room` (the router draws it and sends it to both sides):

1. D -> P `DecodeRegister`: room, D's control endpoint, D's `PeerConfig`, as D admits the request (before
   its pages: P knows the room is claimed). P runs `check_compatible` and answers a mismatch with
   `TransferFailed` naming both values; D refuses a mismatched P the same way from P's `/route` config.
2. D -> P `KVDestination`: room, every D rank's transfer endpoint (session, page pools and the KV heads and
   layers each holds), the destination page ids (D allocated them in its prealloc queue). P's sender is now
   WaitingForInput -> Transferring.
3. Each P rank writes its heads of the prompt's KV pages (target, and the draft's layers in draft-on-both
   mode) into the D ranks that hold them through its own transfer backend (data plane,
   `specpd.disagg.transfer`), one descriptor per page and overlapping head range (specpd/disagg/kv_layout.py).
4. P -> D `HandoffRecord`: y0 and everything D needs to run its first forward (docs/architecture.md §3). P may send
   it as soon as y0 is sampled, before the KV writes finish.
5. P -> D `TransferDone` once every page write of every P rank completed (or `TransferFailed` with the reason:
   one rank's failed write fails the room, after the other ranks' writes ended). D's receiver
   reaches Success only when it holds both 4 and 5. P frees its own pages after sending 5.
6. Abort: D -> P `Abort` (client gone, timeout). P stops issuing writes for the room and answers `AbortAck`
   once no write into D's pages is in flight; only then does D free the destination pages (or after a hard
   timeout if P is dead). P -> D `Abort` means P dropped the request and has no write in flight.
7. `Heartbeat`: D -> P on a fixed interval while D holds rooms of P's; P's control thread answers at once with
   its load (rooms queued, rooms in flight, how long its engine has been in the current step) and its progress
   (engine steps finished, KV writes ended), so D tells a busy P from a dead one: a P that answers is
   alive however slow, and the prefill / transfer timeouts count only time in which it made no progress.
   Silence (measured by D's control thread, never by D's engine step) marks P dead.

Wire format (ZMQ multipart): frame 0 is a JSON header `{"v": 1, "type": <class name>, "body": {...}}`,
frames 1.. are the raw bytes of the tensors the body refers to as `{"__tensor__": i, "dtype", "shape"}`.
Nested dataclasses are `{"__dataclass__": name, "fields": {...}}`; tuples `{"__tuple__": [...]}`.
No pickle: a peer can only make us build the dataclasses registered below.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from specpd.config import DRAFT_MODES as SPEC_DRAFT_MODES
from specpd.core import SamplingParams

PROTOCOL_VERSION = 2
DRAFT_MODES = ("none", *SPEC_DRAFT_MODES)  # where the prompt's draft extend runs; "none": no draft model

# what a page holds in memory (specpd/kv/pool.py); a peer with another layout is refused at bootstrap naming both
KV_LAYOUT = "page[kv_head][layer][k|v][slot][dim], per-rank head ranges"


@dataclass(frozen=True)
class PeerConfig:
    """What P and D must agree on. `draft_mode`: one of DRAFT_MODES ("both": P runs the draft extend)."""

    model: str
    draft_model: str | None
    page_size: int
    dtype: str  # KV / model dtype, e.g. "float32", "bfloat16"
    spec_algorithm: str  # SpecConfig.speculative_algorithm
    draft_mode: str = "none"
    transfer_backend: str = "tcp"  # specpd.disagg.transfer.TRANSFER_BACKENDS: both sides must move pages alike
    # structured outputs: P masks y0 and D every later token, so both must compile grammars alike
    grammar_backend: str = ""  # specpd.grammar.backend_id(), e.g. "xgrammar==0.2.9"
    # how a page holds its KV (heads outside layers and positions): a server with another layout is refused
    kv_layout: str = KV_LAYOUT
    # draft-on-both: P drafts D's first round (its top-k over the prompt), so both must draft the same tree
    # shape, "num_steps,topk,num_draft_tokens" as each resolved it ("" in the other modes: D alone drafts)
    draft_shape: str = ""
    # each side's own (they may differ): the KV heads a rank holds are a contiguous 1/tp_size of `kv_heads`
    tp_size: int = 1
    kv_heads: int = 0


_OWN_FIELDS = ("tp_size",)  # may differ between P and D


class ConfigMismatch(ValueError):
    """P and D disagree on a field of `PeerConfig`; the message names every differing field and both values."""


def check_compatible(p_cfg: PeerConfig, d_cfg: PeerConfig) -> None:
    diffs = [f"{f.name}: prefill={getattr(p_cfg, f.name)!r} decode={getattr(d_cfg, f.name)!r}"
             for f in dataclasses.fields(PeerConfig)
             if f.name not in _OWN_FIELDS and getattr(p_cfg, f.name) != getattr(d_cfg, f.name)]
    for side, cfg in (("prefill", p_cfg), ("decode", d_cfg)):
        if cfg.tp_size < 1 or (cfg.kv_heads and cfg.kv_heads % cfg.tp_size):
            diffs.append(f"{side} tp_size {cfg.tp_size} cannot hold the {cfg.kv_heads} KV heads in equal head ranges "
                         f"(prefill tp_size={p_cfg.tp_size}, decode tp_size={d_cfg.tp_size})")
    if diffs:
        raise ConfigMismatch("prefill and decode servers are incompatible: " + "; ".join(diffs))


@dataclass(frozen=True)
class PoolLayout:
    """One registered page pool as a peer sees it: page i lives at `base_address + i * page_bytes`."""

    base_address: int  # 0 for backends that address pages by pool index (tcp)
    page_bytes: int
    num_pages: int


@dataclass(frozen=True)
class PoolPlacement:
    """What a block of every page of registered pool `pool` holds (specpd/disagg/kv_layout.py): KV heads
    [head_start, +num_heads) of layers [layer_start, +num_layers) (target layers first, then the draft's), laid
    out [num_heads, num_layers, 2, page_size, head_dim] from byte `page_offset` of the page: one (head, layer)
    is `block_bytes`."""

    pool: int
    page_offset: int
    head_start: int
    num_heads: int
    layer_start: int
    num_layers: int
    block_bytes: int

    def holds(self, head: int, layer: int) -> bool:
        return (self.head_start <= head < self.head_start + self.num_heads
                and self.layer_start <= layer < self.layer_start + self.num_layers)

    def offset(self, head: int, layer: int) -> int:
        return self.page_offset + ((head - self.head_start) * self.num_layers + layer - self.layer_start) * \
            self.block_bytes


@dataclass(frozen=True)
class KVEndpoint:
    """One rank's transfer endpoint: its backend session, its registered pools and what their pages hold."""

    rank: int
    session: str  # TransferBackend.session_id
    pools: tuple[PoolLayout, ...]
    placements: tuple[PoolPlacement, ...]


# ---------------------------------------------------------------------------------------------- messages


@dataclass
class DecodeRegister:
    """D -> P, step 1."""

    room: int
    decode_endpoint: str  # D's control socket, e.g. "tcp://10.0.0.2:7100"
    config: PeerConfig


@dataclass
class KVDestination:
    """D -> P, step 2. `endpoints[r]`: D's rank r (its pools hold its heads); one page id list moves all."""

    room: int
    endpoints: tuple[KVEndpoint, ...]
    dst_page_ids: list[int]  # pages from cached_tokens / page_size on: len == ceil(N / ps) - cached_tokens / ps
    # D's prefix cache already holds KV (target and draft) for positions < cached_tokens (whole pages): P sends
    # only the pages after them and, draft-on-decode-only, only the target features from cached_tokens on
    cached_tokens: int = 0
    # D holds so much of the prompt that it prefills the rest itself: P drops the room and answers at once
    prefill_locally: bool = False


@dataclass
class HandoffRecord:
    """P -> D, step 4 (docs/architecture.md §3). y0 (`handoff_token`) has no KV yet: D writes it first."""

    room: int
    request_id: str
    prompt_len: int  # N; KV for positions 0..N-1 was transferred
    handoff_token: int  # y0, sampled from the logits at N-1
    handoff_logprob: float | None
    sampling_params: SamplingParams  # seed included
    draft_mode: str = "none"
    top_logprob_ids: torch.Tensor | None = None  # [num_top] int64, when logprobs were asked for
    top_logprobs: torch.Tensor | None = None  # [num_top] float32
    sampler_state: torch.Tensor | None = None  # uint8: the seeded request generator's state after y0
    # draft-on-both: P ran the draft extend over the prompt
    draft_topk_ids: torch.Tensor | None = None  # [topk] int64, first-round proposal
    draft_topk_probs: torch.Tensor | None = None  # [topk] float32
    draft_hidden: torch.Tensor | None = None  # [H_draft] draft recurrent hidden at position N-1
    # draft-on-decode-only: D runs the draft extend from these
    target_hidden: torch.Tensor | None = None  # [N - hidden_start, H_in] (EAGLE-3: fused low/mid/high aux layers)
    # the first position target_hidden covers: D has the draft KV before it (its cached prefix, then what D
    # extended from the TargetFeatures streamed before this record)
    hidden_start: int = 0

    def validate(self) -> "HandoffRecord":
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        need = {"both": ("draft_topk_ids", "draft_topk_probs", "draft_hidden"),
                "decode-only": ("target_hidden",), "none": ()}[self.draft_mode]
        missing = [name for name in need if getattr(self, name) is None]
        if missing:
            raise ValueError(f"handoff record for room {self.room} in draft_mode={self.draft_mode!r} lacks {missing}")
        if self.target_hidden is not None and self.target_hidden.shape[0] != self.prompt_len - self.hidden_start:
            raise ValueError(f"target_hidden has {self.target_hidden.shape[0]} rows for positions "
                             f"{self.hidden_start}..{self.prompt_len - 1}")
        if (self.draft_topk_ids is None) != (self.draft_topk_probs is None):
            raise ValueError("draft_topk_ids and draft_topk_probs come together")
        if (self.top_logprob_ids is None) != (self.top_logprobs is None):
            raise ValueError("top_logprob_ids and top_logprobs come together")
        return self


@dataclass
class TargetFeatures:
    """P -> D, draft-on-decode-only with KV streamed per chunk: the target features of positions start.. of a
    prefill chunk P just computed (never the last), sent with that chunk's pages, so D runs its draft extend
    over them while P computes the next chunk; the record then carries the features from there on."""

    room: int
    start: int
    hidden: torch.Tensor  # [n, H_in]


@dataclass
class TransferDone:
    """P -> D, step 5: every KV page write for the room completed."""

    room: int
    num_pages: int
    num_bytes: int


@dataclass
class TransferFailed:
    """Either way: the room's handoff failed (config mismatch, transfer error, timeout)."""

    room: int
    reason: str


@dataclass
class Abort:
    """D -> P: stop writing for `room` and AbortAck when drained. P -> D: P dropped the room, no write in flight."""

    room: int
    reason: str = ""


@dataclass
class AbortAck:
    """P -> D: no write into D's pages for `room` is in flight any more; D may free them."""

    room: int


@dataclass
class Heartbeat:
    """D -> P ping (load fields 0); P -> D reply carrying P's load, the same `seq`."""

    sender: str  # the sender's control endpoint
    seq: int
    timestamp: float = field(default=0.0)  # sender's time.time()
    rooms_queued: int = 0  # P: rooms waiting for their D or for / inside a prefill
    rooms_inflight: int = 0  # P: rooms whose KV is being written
    step_s: float = 0.0  # P: how long its engine has been inside the current step (0 when between steps)
    steps: int = 0  # P's progress since it started: engine steps finished (prefill chunks, any room's)
    writes: int = 0  # P's progress since it started: KV writes ended (each chunk's streamed pages, each rest)

    @property
    def load(self) -> str:
        if not (self.rooms_queued or self.rooms_inflight or self.step_s):
            return "idle"
        return (f"busy with {self.rooms_queued} rooms queued, {self.rooms_inflight} in flight, "
                f"{self.step_s:.1f} s into an engine step")


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    DecodeRegister, KVDestination, HandoffRecord, TargetFeatures, TransferDone, TransferFailed, Abort, AbortAck,
    Heartbeat)}
_NESTED_TYPES: dict[str, type] = {cls.__name__: cls for cls in (PeerConfig, PoolLayout, PoolPlacement, KVEndpoint,
                                                                 SamplingParams)}
_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


# ---------------------------------------------------------------------------------------------- codec


class MessageError(ValueError):
    """A frame sequence that is not a valid message of this protocol version."""


def encode(msg: Any) -> list[bytes | memoryview]:
    """Message dataclass -> ZMQ multipart frames (header + one frame per tensor, zero-copy where possible)."""
    if type(msg).__name__ not in MESSAGE_TYPES or MESSAGE_TYPES[type(msg).__name__] is not type(msg):
        raise TypeError(f"not a control message: {type(msg).__name__}")
    frames: list[bytes | memoryview] = []
    body = {f.name: _encode_value(getattr(msg, f.name), frames) for f in dataclasses.fields(msg)}
    header = json.dumps({"v": PROTOCOL_VERSION, "type": type(msg).__name__, "body": body}).encode()
    return [header, *frames]


def decode(frames: Sequence[bytes | memoryview | Any]) -> Any:
    """Frames from `encode` (zmq.Frame, bytes or memoryview) -> a new message; tensors own their memory."""
    if not frames:
        raise MessageError("empty message")
    try:
        header = json.loads(bytes(_buffer(frames[0])))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MessageError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {header.get('v') if isinstance(header, dict) else None!r} "
                           f"!= {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(header.get("type"))
    if cls is None:
        raise MessageError(f"unknown message type {header.get('type')!r}")
    tensors = frames[1:]
    body = {k: _decode_value(v, tensors) for k, v in header["body"].items()}
    try:
        return cls(**body)
    except TypeError as e:
        raise MessageError(f"bad {cls.__name__} fields: {e}") from None


def _encode_value(value: Any, frames: list) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        frames.append(memoryview(raw.numpy()))
        return {"__tensor__": len(frames) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if _NESTED_TYPES.get(name) is not type(value):
            raise TypeError(f"cannot encode nested dataclass {name}")
        return {"__dataclass__": name,
                "fields": {f.name: _encode_value(getattr(value, f.name), frames) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_value(v, frames) for v in value]}
    if isinstance(value, list):
        return [_encode_value(v, frames) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("dict keys must be str")
        return {k: _encode_value(v, frames) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot encode {type(value).__name__}")


def _decode_value(value: Any, tensors: Sequence[Any]) -> Any:
    if isinstance(value, list):
        return [_decode_value(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return _decode_tensor(value, tensors)
    if "__tuple__" in value:
        return tuple(_decode_value(v, tensors) for v in value["__tuple__"])
    if "__dataclass__" in value:
        cls = _NESTED_TYPES.get(value["__dataclass__"])
        if cls is None:
            raise MessageError(f"unknown nested type {value['__dataclass__']!r}")
        try:
            return cls(**{k: _decode_value(v, tensors) for k, v in value["fields"].items()})
        except TypeError as e:
            raise MessageError(f"bad {cls.__name__} fields: {e}") from None
    return {k: _decode_value(v, tensors) for k, v in value.items()}


def _decode_tensor(ref: dict, tensors: Sequence[Any]) -> torch.Tensor:
    index, dtype_name, shape = ref["__tensor__"], ref["dtype"], ref["shape"]
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise MessageError(f"unsupported tensor dtype {dtype_name!r}")
    if not isinstance(index, int) or not 0 <= index < len(tensors):
        raise MessageError(f"tensor frame {index!r} missing ({len(tensors)} frames)")
    raw = np.frombuffer(_buffer(tensors[index]), dtype=np.uint8)
    numel = int(np.prod(shape)) if shape else 1
    if raw.size != numel * torch.empty((), dtype=dtype).element_size():
        raise MessageError(f"tensor frame {index} has {raw.size} bytes, {dtype_name}{shape} needs "
                           f"{numel * torch.empty((), dtype=dtype).element_size()}")
    out = torch.empty(raw.size, dtype=torch.uint8)
    if raw.size:
        out.numpy()[:] = raw  # copy: the frame's memory belongs to zmq
    return out.view(dtype).reshape(shape)


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


# ---------------------------------------------------------------------------------------------- sockets


def send_message(sock, msg: Any, identity: bytes | None = None, flags: int = 0) -> None:
    """Send on a zmq socket; `identity` prefixes the ROUTER routing frame."""
    frames = encode(msg)
    sock.send_multipart([identity, *frames] if identity is not None else frames, flags=flags, copy=False)


def recv_message(sock, with_identity: bool = False, flags: int = 0):
    """Receive one message; with_identity=True (ROUTER) returns (identity, msg)."""
    frames = sock.recv_multipart(flags=flags, copy=False)
    if with_identity:
        return bytes(frames[0].buffer), decode(frames[1:])
    return decode(frames)
