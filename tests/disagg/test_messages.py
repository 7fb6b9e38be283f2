"""Every control message survives encode -> frames -> decode, over a real zmq socket too."""
import dataclasses
import math

import pytest
import torch
import zmq

from specpd.core import SamplingParams
from specpd.disagg.messages import (MESSAGE_TYPES, PROTOCOL_VERSION, Abort, AbortAck, ConfigMismatch, DecodeRegister,
                                    HandoffRecord, Heartbeat, KVDestination, KVEndpoint, MessageError, PeerConfig,
                                    PoolLayout, PoolPlacement, TargetFeatures, TransferDone, TransferFailed,
                                    check_compatible, decode, encode, recv_message, send_message)

CFG = PeerConfig(model="smollm2-135m", draft_model="eagle3-smollm2", page_size=16, dtype="bfloat16",
                 spec_algorithm="eagle3", draft_mode="decode-only")
PARAMS = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1234, stop=("\n\n",),
                        stop_token_ids=(2, 7), logprobs=3)


def _handoff_both() -> HandoffRecord:
    return HandoffRecord(
        room=7, request_id="req-1", prompt_len=5, handoff_token=42, handoff_logprob=-0.25,
        sampling_params=PARAMS, draft_mode="both",
        top_logprob_ids=torch.tensor([42, 3, 9]), top_logprobs=torch.tensor([-0.25, -2.0, -float("inf")]),
        draft_topk_ids=torch.tensor([5, 6, 7, 8], dtype=torch.int64),
        draft_topk_probs=torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float32),
        draft_hidden=torch.randn(64, dtype=torch.bfloat16))


def _handoff_decode_only(n: int, dtype: torch.dtype) -> HandoffRecord:
    return HandoffRecord(room=8, request_id="req-2", prompt_len=n, handoff_token=0, handoff_logprob=None,
                         sampling_params=SamplingParams(), draft_mode="decode-only",
                         target_hidden=torch.randn(n, 3 * 32).to(dtype))


ALL_MESSAGES = [
    DecodeRegister(room=1, decode_endpoint="tcp://127.0.0.1:7100", config=CFG),
    KVDestination(room=1, endpoints=(
        KVEndpoint(0, "127.0.0.1:15000", (PoolLayout(140000000000, 737280, 512), PoolLayout(14010000000, 24576, 512)),
                   (PoolPlacement(0, 0, 0, 1, 0, 30, 4096), PoolPlacement(1, 0, 0, 3, 30, 1, 4096))),
        KVEndpoint(1, "127.0.0.1:15002", (PoolLayout(140200000000, 737280, 512),),
                   (PoolPlacement(0, 0, 1, 1, 0, 30, 4096),))),
        dst_page_ids=[3, 9, 1, 0]),
    KVDestination(room=2, endpoints=(), dst_page_ids=[]),
    _handoff_both(),
    _handoff_decode_only(5, torch.float32),
    _handoff_decode_only(5, torch.bfloat16),
    _handoff_decode_only(4, torch.float16),
    _handoff_decode_only(0, torch.bfloat16),  # empty [0, H] tensor
    HandoffRecord(room=9, request_id="r", prompt_len=1, handoff_token=1, handoff_logprob=float("-inf"),
                  sampling_params=PARAMS),
    TargetFeatures(room=8, start=12, hidden=torch.randn(6, 24).to(torch.bfloat16)),  # a decode-only chunk
    TransferDone(room=1, num_pages=4, num_bytes=4 * 737280),
    TransferFailed(room=1, reason="page size differs: prefill=16 decode=32"),
    Abort(room=1, reason="client disconnected"),
    AbortAck(room=1),
    Heartbeat(sender="tcp://127.0.0.1:7100", seq=12, timestamp=1700000000.5),
    Heartbeat(sender="tcp://127.0.0.1:7101", seq=13, timestamp=1700000001.0, rooms_queued=9, rooms_inflight=2,
              step_s=11.25),  # P's reply: busy, not dead
]


def assert_same(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x, y), f.name
        elif isinstance(x, float) and math.isnan(x):
            assert math.isnan(y)
        else:
            assert x == y and type(x) is type(y), (f.name, x, y)


def test_every_message_type_is_covered():
    assert {type(m) for m in ALL_MESSAGES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    assert_same(msg, decode(frames))
    assert_same(msg, decode([bytes(f) for f in frames]))  # as a peer receives them


def test_decoded_tensors_own_their_memory():
    msg = _handoff_both()
    frames = [bytearray(f) for f in encode(msg)]
    out = decode(frames)
    for frame in frames[1:]:
        frame[:] = b"\0" * len(frame)
    assert torch.equal(out.draft_hidden, msg.draft_hidden)


def test_handoff_tensor_shapes_and_dtypes():
    out = decode(encode(_handoff_decode_only(0, torch.bfloat16)))
    assert out.target_hidden.shape == (0, 96) and out.target_hidden.dtype == torch.bfloat16
    scalar = HandoffRecord(room=1, request_id="x", prompt_len=1, handoff_token=1, handoff_logprob=0.0,
                           sampling_params=PARAMS, draft_hidden=torch.tensor(2.5, dtype=torch.bfloat16))
    assert decode(encode(scalar)).draft_hidden.shape == ()
    strided = HandoffRecord(room=1, request_id="x", prompt_len=4, handoff_token=1, handoff_logprob=0.0,
                            sampling_params=PARAMS, draft_mode="decode-only",
                            target_hidden=torch.arange(32.0).view(8, 4).t()[:, :4].t())
    assert torch.equal(decode(encode(strided)).target_hidden, strided.target_hidden)


def test_over_zmq():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://messages")
    b.connect("inproc://messages")
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        for msg in ALL_MESSAGES:
            send_message(a, msg)
            assert_same(msg, recv_message(b))
        send_message(dealer, ALL_MESSAGES[3])
        identity, got = recv_message(router, with_identity=True)
        assert_same(ALL_MESSAGES[3], got)
        send_message(router, AbortAck(room=3), identity=identity)
        assert_same(AbortAck(room=3), recv_message(dealer))
    finally:
        for s in (a, b, router, dealer):
            s.close(linger=0)
        ctx.term()


def test_malformed_frames_raise_message_error():
    header, *tensors = encode(_handoff_both())
    with pytest.raises(MessageError, match="missing"):
        decode([header, *tensors[:-1]])
    with pytest.raises(MessageError, match="bytes"):
        decode([header, *tensors[:-1], b"\0\0\0"])
    with pytest.raises(MessageError, match="version"):
        decode([b'{"v": 99, "type": "AbortAck", "body": {"room": 1}}'])
    with pytest.raises(MessageError, match="unknown message type"):
        decode([b'{"v": %d, "type": "Pickle", "body": {}}' % PROTOCOL_VERSION])
    with pytest.raises(MessageError, match="unknown nested"):
        decode([b'{"v": %d, "type": "AbortAck", "body": {"room": {"__dataclass__": "os", "fields": {}}}}'
                % PROTOCOL_VERSION])
    with pytest.raises(MessageError, match="fields"):
        decode([b'{"v": %d, "type": "AbortAck", "body": {"rooom": 1}}' % PROTOCOL_VERSION])
    with pytest.raises(MessageError, match="JSON"):
        decode([b"\xff"])
    with pytest.raises(TypeError):
        encode(PARAMS)


@pytest.mark.parametrize("name,value", [("model", "llama-7b"), ("draft_model", None), ("page_size", 32),
                                        ("dtype", "float32"), ("spec_algorithm", "eagle"), ("draft_mode", "both"),
                                        ("transfer_backend", "mooncake"),
                                        ("kv_layout", "page[layer][k|v][slot][kv_head][dim], all heads"),
                                        ("kv_heads", 4),
                                        ("draft_shape", "3,4,8")])
def test_check_compatible_names_both_values(name, value):
    check_compatible(CFG, CFG)
    other = dataclasses.replace(CFG, **{name: value})
    with pytest.raises(ConfigMismatch) as err:
        check_compatible(CFG, other)
    text = str(err.value)
    assert f"{name}: prefill={getattr(CFG, name)!r} decode={value!r}" in text


def test_check_compatible_takes_different_tp_sizes_and_refuses_one_that_cannot_split_the_heads():
    check_compatible(dataclasses.replace(CFG, tp_size=1, kv_heads=6), dataclasses.replace(CFG, tp_size=3, kv_heads=6))
    with pytest.raises(ConfigMismatch, match="decode tp_size 4 cannot hold the 6 KV heads in equal head ranges "
                                             r"\(prefill tp_size=2, decode tp_size=4\)"):
        check_compatible(dataclasses.replace(CFG, tp_size=2, kv_heads=6),
                         dataclasses.replace(CFG, tp_size=4, kv_heads=6))


def test_check_compatible_lists_every_difference():
    other = dataclasses.replace(CFG, page_size=64, dtype="float16")
    with pytest.raises(ConfigMismatch, match="page_size: prefill=16 decode=64; dtype: prefill='bfloat16' "
                                             "decode='float16'"):
        check_compatible(CFG, other)


def test_handoff_validate():
    _handoff_both().validate()
    _handoff_decode_only(3, torch.float32).validate()
    with pytest.raises(ValueError, match="target_hidden"):
        dataclasses.replace(_handoff_decode_only(3, torch.float32), target_hidden=None).validate()
    with pytest.raises(ValueError, match="draft_hidden"):
        dataclasses.replace(_handoff_both(), draft_hidden=None).validate()
    with pytest.raises(ValueError, match="rows"):
        dataclasses.replace(_handoff_decode_only(3, torch.float32), prompt_len=4).validate()
    with pytest.raises(ValueError, match="draft_mode"):
        dataclasses.replace(_handoff_both(), draft_mode="p_only").validate()


def test_heartbeat_reply_says_busy_or_idle():
    assert Heartbeat("tcp://p", 1).load == "idle"
    busy = decode(encode(Heartbeat("tcp://p", 2, rooms_queued=8, rooms_inflight=1, step_s=10.3)))
    assert busy.load == "busy with 8 rooms queued, 1 in flight, 10.3 s into an engine step"


def test_draft_on_both_pairs_only_the_same_tree_shape():
    """P drafts D's first round in draft-on-both mode: a P and D that resolve different tree shapes (an explicit
    --spec-topk on one, the hybrid's default on the other) are refused naming both; decode-only pairs them (D
    alone drafts)."""
    from types import SimpleNamespace

    from specpd.config import DEFAULT_SHAPES, EngineConfig, SpecConfig
    from specpd.disagg.worker import peer_config

    def side(mode, **spec):
        cfg = EngineConfig(spec=SpecConfig(speculative_algorithm="eagle3", draft_model="default", draft_mode=mode,
                                           **spec))
        return peer_config(SimpleNamespace(config=cfg, model_config=SimpleNamespace(num_kv_heads=3)), "tcp")

    check_compatible(side("both"), side("both"))
    default = ",".join(map(str, DEFAULT_SHAPES["hybrid"]))
    assert side("both").draft_shape == default  # the hybrid's default shape
    with pytest.raises(ConfigMismatch, match=rf"draft_shape: prefill='{default}' decode='3,4,8'"):
        check_compatible(side("both"), side("both", spec_num_steps=3, spec_topk=4, spec_num_draft_tokens=8))
    check_compatible(side("decode-only"), side("decode-only", spec_num_steps=3, spec_topk=4, spec_num_draft_tokens=8))
