"""Prefix-affinity routing: the real router process in front of two P and two D stand-ins (the scripted
servers of test_router_passthrough). A conversation's turns go to the same P and D (their prefix caches hit),
distinct conversations spread, a server that is full sends the request to the least loaded one; /flush_cache
on the router reaches every backend."""
import concurrent.futures
import time

import httpx

from specpd.disagg.affinity import AffinityPicker, prefix_key, prefix_text
from tests.disagg.test_router_passthrough import StandIn, serving
from tests.server.launcher import launch_servers


def chat(*turns):
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)],
            "max_tokens": 4}


def test_key_is_the_leading_text():
    a = chat("Plan a trip to Kyoto.")
    b = chat("Plan a trip to Kyoto.", "Day 1: temples.", "And day 2?")
    assert prefix_key(a) != prefix_key(chat("Plan a trip to Oslo."))
    assert prefix_key(a) == prefix_key(b)  # every turn of a conversation
    system = {"role": "system", "content": "You are terse."}
    assert prefix_text({"messages": [system, *b["messages"]]}) == "<system>You are terse.<user>Plan a trip to Kyoto."
    assert prefix_key({"prompt": [1, 2, 3] * 60}) == prefix_key({"prompt": [1, 2, 3] * 70})
    assert prefix_key({"prompt": "x" * 300}) == prefix_key({"prompt": "x" * 300 + "more turns"})


def test_picker_sticks_then_spills_to_the_least_loaded():
    picker = AffinityPicker(["http://a", "http://b", "http://c"])
    key = prefix_key(chat("hello"))
    home = picker.pick(key)
    assert all(picker.pick(key) == home for _ in range(5))
    for _ in range(4):  # the home server fills up: 4 more in flight than the least loaded
        picker.acquire(home)
    other = picker.pick(key)
    assert other != home and picker.inflight[other] == 0
    picker.release(home)
    picker.acquire(other)
    assert picker.pick(key) == home  # 3 vs 1 (and 0): not full
    keys = [prefix_key(chat(f"conversation {i}")) for i in range(60)]
    fresh = AffinityPicker(["http://a", "http://b", "http://c"])
    assert len({fresh.pick(k) for k in keys}) == 3


class Recorder(StandIn):
    def __init__(self, role):
        super().__init__(role)
        self.app.post("/v1/chat/completions")(self.completions)
        self.flushed = 0

        def flush():
            self.flushed += 1
            return {"flushed_pages": 3}
        self.app.post("/flush_cache")(flush)


def test_router_sends_a_conversation_to_the_same_servers():
    ps, ds = [Recorder("prefill"), Recorder("prefill")], [Recorder("decode"), Recorder("decode")]
    with serving(*ps, *ds):
        with launch_servers([["--role", "router", "--prefill", ",".join(p.url for p in ps),
                              "--decode", ",".join(d.url for d in ds), "--log-level", "warning"]]) as [(_, router, _)]:
            with httpx.Client(base_url=router, timeout=30) as client:
                convs = [[f"Question {i}: tell me about topic {i} in detail."] for i in range(12)]
                for turn in range(3):
                    for conv in convs:
                        resp = client.post("/v1/chat/completions", json=chat(*conv))
                        assert resp.status_code == 200, resp.text
                        conv += ["an answer", f"follow-up {turn}"]
                time.sleep(0.5)  # P's answers may land after D's

                def where(servers):
                    out = {}
                    for i, s in enumerate(servers):
                        for call in s.calls:
                            out.setdefault(call["body"]["messages"][0]["content"], set()).add(i)
                    return out
                for servers in (ps, ds):
                    placed = where(servers)
                    assert len(placed) == 12 and all(len(v) == 1 for v in placed.values()), placed
                    assert {next(iter(v)) for v in placed.values()} == {0, 1}  # spread over both
                flushed = client.post("/flush_cache").json()
                assert flushed["flushed_pages"] == 12 and all(s.flushed == 1 for s in ps + ds)


def test_a_full_server_spills_over():
    ps, ds = [Recorder("prefill"), Recorder("prefill")], [Recorder("decode"), Recorder("decode")]
    for d in ds:
        d.script = {"status": 200, "delay": 1.5}
    with serving(*ps, *ds):
        with launch_servers([["--role", "router", "--prefill", ",".join(p.url for p in ps),
                              "--decode", ",".join(d.url for d in ds), "--log-level", "warning"]]) as [(_, router, _)]:
            body = chat("The same long system prompt for everyone " * 40)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(lambda _: httpx.post(router + "/v1/chat/completions", json=body,
                                                           timeout=30).status_code, range(8)))
            assert codes == [200] * 8
            counts = sorted(len(d.calls) for d in ds)
            assert counts[0] >= 2, counts  # the home D took its share, the rest spilled to the other
