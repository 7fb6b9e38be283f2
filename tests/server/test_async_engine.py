"""AsyncEngine (engine thread <-> event loop) against a tiny fake engine: no model, fast."""
import asyncio
import os
import threading
import time

import pytest

from specpd.core import InvalidRequest, RequestOutput, SamplingParams
from specpd.server.async_engine import AsyncEngine, EngineDeadError


class FakeEngine:
    """Emits token 7 once per step per request; context of 10 tokens; one page per request."""

    max_model_len = 10
    total_pages = 4

    def __init__(self, fail_on_step: int | None = None):
        self.reqs: dict[str, list] = {}  # id -> [prompt_len, params, outputs]
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.thread_ids: set[int] = set()

    @property
    def free_pages(self):
        return self.total_pages - len(self.reqs)

    def stats(self):
        return {"num_running": len(self.reqs), "num_waiting": 0, "free_pages": self.free_pages,
                "total_pages": self.total_pages}

    def add_request(self, rid, prompt, params):
        self.thread_ids.add(threading.get_ident())
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", "over the context")
        self.reqs[rid] = [len(prompt), params, []]

    def abort_request(self, rid):
        self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        time.sleep(0.002)
        outs = []
        for rid, (n, params, toks) in list(self.reqs.items()):
            if rid in self.aborted:
                del self.reqs[rid]
                outs.append(RequestOutput(rid, [], "", toks, "x" * len(toks), True, "abort", n))
                continue
            toks.append(7)
            done = len(toks) >= params.max_tokens
            if done:
                del self.reqs[rid]
            outs.append(RequestOutput(rid, [7], "x", list(toks), "x" * len(toks), done,
                                      "length" if done else None, n))
        self.aborted.clear()
        return outs


def _run(coro):
    return asyncio.run(coro)


def test_outputs_arrive_in_order_and_engine_stays_on_its_thread():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        streams = [await engine.submit(f"r{i}", [1, 2], SamplingParams(max_tokens=3 + i)) for i in range(3)]
        results = []
        for s in streams:
            results.append([o async for o in s])
        engine.stop()
        return results, engine.stats()

    results, stats = _run(main())
    for i, outs in enumerate(results):
        assert [o.num_output_tokens for o in outs] == list(range(1, 4 + i))
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert stats["free_pages"] == FakeEngine.total_pages
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids


def test_admission_error_is_raised_to_the_caller():
    async def main():
        engine = AsyncEngine(FakeEngine())
        engine.start()
        with pytest.raises(InvalidRequest) as info:
            await engine.submit("r", [1] * 8, SamplingParams(max_tokens=5))
        assert info.value.field == "max_tokens"
        stream = await engine.submit("ok", [1], SamplingParams(max_tokens=2))  # still serving
        assert [o.num_output_tokens async for o in stream] == [1, 2]
        engine.stop()

    _run(main())


def test_abort_ends_the_stream_with_abort():
    async def main():
        engine = AsyncEngine(FakeEngine())
        engine.start()
        stream = await engine.submit("r", [1], SamplingParams(max_tokens=9))
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                engine.abort("r")
        engine.stop()
        return outs, engine.stats()

    outs, stats = _run(main())
    assert outs[-1].finish_reason == "abort" and len(outs) < 9
    assert stats["free_pages"] == FakeEngine.total_pages


def test_engine_failure_fails_requests_and_marks_dead():
    async def main():
        engine = AsyncEngine(FakeEngine(fail_on_step=2))
        engine.start()
        stream = await engine.submit("r", [1], SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.alive
        with pytest.raises(EngineDeadError):
            await engine.submit("r2", [1], SamplingParams(max_tokens=2))

    _run(main())


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_low_priority_puts_only_the_engine_thread_in_sched_idle():
    class Recording(FakeEngine):
        policies: set[int] = set()

        def step(self):
            self.policies.add(os.sched_getscheduler(0))
            return super().step()

    fake = Recording()

    async def main():
        engine = AsyncEngine(fake, priority="low")
        engine.start()
        stream = await engine.submit("r", [1], SamplingParams(max_tokens=3))
        outs = [o async for o in stream]
        engine.stop()
        return outs

    assert _run(main())[-1].num_output_tokens == 3
    assert fake.policies == {os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the loop (HTTP) thread keeps its policy
    with pytest.raises(ValueError, match="engine priority"):
        AsyncEngine(FakeEngine(), priority="lowest")
