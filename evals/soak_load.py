"""The load evals/soak.py sends through the router: Poisson arrivals, at most --max-inflight at once, each one
a completion request (streamed or not), a client disconnect, an abort, a malformed request or an oversized
body, recorded with its outcome.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from evals.harness.results import log

EXPECTED = ("disconnect", "abort", "bad", "oversize")


def err_head(resp_text: str, status: int | None) -> str:
    msg = resp_text
    try:
        j = json.loads(resp_text)
        msg = j.get("error", {}).get("message", resp_text) if isinstance(j, dict) else resp_text
    except (ValueError, AttributeError):
        pass
    return f"{status} {str(msg)[:120]}"


def bad_bodies(prompt: list[int], vocab: int) -> list[tuple[str, str, bytes | dict]]:
    """(name, path, body) of requests the API must refuse with 400."""
    return [
        ("negative max_tokens", "/v1/completions", {"prompt": prompt, "max_tokens": -5}),
        ("max_tokens string", "/v1/completions", {"prompt": prompt, "max_tokens": "ten"}),
        ("prompt int", "/v1/completions", {"prompt": 12345, "max_tokens": 8}),
        ("temperature string", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": "hot"}),
        ("missing prompt", "/v1/completions", {"max_tokens": 8}),
        ("out-of-vocab id", "/v1/completions", {"prompt": [vocab + 1000], "max_tokens": 8}),
        ("invalid JSON", "/v1/completions", b'{"prompt": [1, 2, '),
        ("messages not a list", "/v1/chat/completions", {"messages": "hello", "max_tokens": 8}),
        ("negative top_p", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "top_p": -1}),
    ]


async def expect_status(rec: dict, request, status: int, what: str) -> None:
    """Await `request` (a client call): `status` is the expected refusal; any other answer, or a transport error,
    is a failure, named after `what`."""
    try:
        resp = await request
    except httpx.HTTPError as e:
        rec.update(outcome="failed", reason=f"{what}: transport {e!r}"[:160])
        return
    if resp.status_code == status:
        rec.update(outcome="expected", reason=str(status))
    else:
        rec.update(outcome="failed", reason=f"{what} answered {err_head(resp.text, resp.status_code)}")


class Load:
    def __init__(self, args, router: str, short: list, long: list, vocab: int, t0: float):
        self.args, self.router, self.short, self.long, self.vocab, self.t0 = args, router, short, long, vocab, t0
        self.records: list[dict] = []
        self.rng = random.Random(args.seed)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def pick(self) -> str:
        a, x = self.args, self.rng.random()
        for kind, frac in (("disconnect", a.disconnect_frac), ("abort", a.abort_frac), ("bad", a.bad_frac),
                           ("oversize", a.oversize_frac)):
            if x < frac:
                return kind
            x -= frac
        return "ok"

    def body(self) -> tuple[dict, bool]:
        long = self.rng.random() < self.args.long_frac
        prompt = self.rng.choice(self.long if long else self.short)
        body = {"prompt": prompt, "max_tokens": self.args.max_tokens_long if long else self.args.max_tokens,
                "ignore_eos": True, "temperature": 0 if self.rng.random() < 0.7 else 0.8}
        return body, long

    async def run_one(self, client: httpx.AsyncClient, kind: str) -> None:
        rec = {"kind": kind, "t_start": round(self.now(), 3)}
        self.records.append(rec)
        try:
            await asyncio.wait_for(self._do(client, kind, rec), self.args.lost_after)
        except asyncio.TimeoutError:
            rec.update(outcome="lost", reason=f"no answer within {self.args.lost_after} s")
        except Exception as e:  # noqa: BLE001 -- a client-side bug is recorded, never stops the soak
            rec.update(outcome="failed", reason=f"client exception {e!r}"[:160])
        rec["t_end"] = round(self.now(), 3)

    async def _do(self, client: httpx.AsyncClient, kind: str, rec: dict) -> None:
        url = self.router
        if kind == "bad":
            name, path, body = self.rng.choice(bad_bodies(self.rng.choice(self.short)[:16], self.vocab))
            rec["case"] = name
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            await expect_status(rec, client.post(url + path, **kw), 400, f"bad input '{name}'")
            return
        if kind == "oversize":
            n = int(self.args.max_request_bytes * 1.25)
            data = b'{"max_tokens": 4, "prompt": "' + b"a" * n + b'"}'
            # a transport error counts as failed: a server may close the socket after its 413 while we still send
            await expect_status(rec, client.post(url + "/v1/completions", content=data,
                                                 headers={"content-type": "application/json"}), 413, "oversize")
            return
        body, long = self.body()
        rec.update(long=long, prompt_tokens=len(body["prompt"]))
        if kind == "abort":
            give_up = self.rng.uniform(0.3, 3.0)
            rec["give_up_s"] = round(give_up, 2)
            try:
                resp = await client.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(give_up))
            except httpx.TimeoutException:
                rec.update(outcome="expected", reason="client timeout")
                return
            except httpx.HTTPError as e:
                rec.update(outcome="failed", reason=f"abort: transport {e!r}"[:160])
                return
            rec.update(outcome="completed" if resp.status_code == 200 else "failed",
                       reason=None if resp.status_code == 200 else err_head(resp.text, resp.status_code))
            if resp.status_code == 200:
                rec["note"] = "answered before the client gave up"
            return
        stream = kind == "disconnect" or self.rng.random() < self.args.stream_frac
        rec["stream"] = stream
        if not stream:
            t0 = time.perf_counter()
            try:
                resp = await client.post(url + "/v1/completions", json=body)
            except httpx.HTTPError as e:
                rec.update(outcome="failed", reason=f"transport {e!r}"[:160])
                return
            rec["e2e_s"] = round(time.perf_counter() - t0, 3)
            if resp.status_code == 200:
                rec.update(outcome="completed", completion_tokens=resp.json()["usage"]["completion_tokens"])
            else:
                rec.update(outcome="failed", reason=err_head(resp.text, resp.status_code))
            return
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        cut_after = self.rng.randint(1, 3) if kind == "disconnect" else None
        t0 = time.perf_counter()
        t_first = t_last = None
        chunks = tokens = 0
        done = False
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.update(outcome="failed", reason=err_head(text, resp.status_code))
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.update(outcome="failed",
                                   reason=f"stream error event: {str(obj['error'].get('message'))[:120]}")
                        return
                    if obj.get("usage") and not obj.get("choices"):
                        tokens = obj["usage"]["completion_tokens"]
                        continue
                    if obj.get("choices"):
                        t = time.perf_counter()
                        t_first = t_first or t
                        t_last = t
                        chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        rec.update(outcome="expected", reason="client disconnected mid-stream", chunks=chunks)
                        return  # leaving the block closes the connection
        except httpx.HTTPError as e:
            rec.update(outcome="failed", reason=f"stream transport {e!r}"[:160])
            return
        if cut_after is not None:
            rec.update(outcome="expected", reason="stream ended before the client disconnected", chunks=chunks)
            return
        if not done:
            rec.update(outcome="failed", reason="stream ended without [DONE]")
            return
        rec.update(outcome="completed", chunks=chunks, completion_tokens=tokens, e2e_s=round(time.perf_counter() - t0, 3))
        if t_first is not None:
            rec["ttft_s"] = round(t_first - t0, 4)
            if tokens > 1:
                rec["tpot_s"] = round((t_last - t_first) / (tokens - 1), 5)

    async def run(self, load_seconds: float) -> dict:
        sem = asyncio.Semaphore(self.args.max_inflight)
        tasks: set[asyncio.Task] = set()
        waited = 0
        limits = httpx.Limits(max_connections=self.args.max_inflight + 4, max_keepalive_connections=self.args.max_inflight)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.lost_after), limits=limits) as client:
            async def guarded(kind):
                try:
                    await self.run_one(client, kind)
                finally:
                    sem.release()
            next_t = self.now()
            while True:
                next_t += self.rng.expovariate(self.args.rate)
                if next_t >= load_seconds:
                    break
                await asyncio.sleep(max(0.0, next_t - self.now()))
                if sem.locked():
                    waited += 1
                await sem.acquire()
                if self.now() >= load_seconds:
                    sem.release()
                    break
                task = asyncio.create_task(guarded(self.pick()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            t_drain = self.now()
            log(f"deadline: arrivals stopped at {t_drain:.0f} s, {len(tasks)} in flight, draining")
            if tasks:
                await asyncio.wait(set(tasks), timeout=self.args.lost_after + 30)
        return {"arrivals_waited_for_slot": waited, "load_end_s": round(t_drain, 1),
                "drain_s": round(self.now() - t_drain, 1)}
