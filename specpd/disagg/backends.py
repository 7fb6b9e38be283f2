"""The PD router's prefill and decode servers as it sees them, and one exchange with one of them (no torch).

A backend's life in the router:
  1. At start the router reads each P's /server_info for its bootstrap address (where D finds P's route).
  2. A request's exchange with a backend runs on a connection of its own (`Exchange`): whatever ends it (an
     answer read, a stream relayed, a drop mid-connect), `close()` closes that connection. A shared pool
     leaked one: httpcore keeps a connection cancelled between its connect and its request in the pool for
     good, and a streamed answer dropped unread holds one, so a cluster that lost P or D a few times ran out
     of connections and every later request waited for one forever.
  3. A connection refused or cut before the answer, an answer saying the server cannot generate (503
     without Retry-After: its engine is dead), or (a P) D's 502 saying it cannot reach P's bootstrap server,
     marks the backend down (`mark_down`). While it is down a probe
     asks its /health (a P: also its bootstrap server's, which D needs) every PROBE_INTERVAL_S; at the first
     200 the backend is up again, a P's bootstrap address re-read (a restarted P may have moved it).
  4. A request for a backend that is down waits for it (`wait_up`) until its deadline, then is refused
     with 503 and Retry-After (router.py), never a 502.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from urllib.parse import urlparse

import httpx

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # between health probes of a backend that is down
PROBE_TIMEOUT_S = 5.0
_WILDCARDS = ("0.0.0.0", "::", "")  # bind-everything addresses: not where a peer can reach a server
# one TLS context for every exchange's client (httpx builds one per client otherwise, loading the CA bundle each
# time); the backends are plain http, so it is never used to connect
_TLS = ssl.create_default_context()


class Backend:
    """One prefill or decode server: up or down (module docstring, step 3); a P's bootstrap address."""

    def __init__(self, url: str, role: str):
        self.url, self.role = url, role
        self.name = f"{role} server {url}"
        self.bootstrap: tuple[str, int] | None = None  # P: (host, port) of its bootstrap server, once known
        self.down_since: float | None = None
        self.why = ""
        self.came_up = asyncio.Event()  # set while up: requests for it wait on this
        self.came_up.set()

    @property
    def up(self) -> bool:
        return self.down_since is None


class Backends:
    """Every P and D of a router, the router's shared client (health, info and admin fan-outs), the probes."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], bootstrap_port: int,
                 bootstrap_host: str | None, api_key: str | None):
        self.prefill = {u: Backend(u, "prefill") for u in prefill_urls}
        self.decode = {u: Backend(u, "decode") for u in decode_urls}
        self.all = {**self.prefill, **self.decode}
        self.bootstrap_port, self.bootstrap_host = bootstrap_port, bootstrap_host
        # P and D take the cluster's key too (admission.py): every request to them carries it
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: httpx.AsyncClient | None = None
        self._probes: dict[str, asyncio.Task] = {}

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), headers=self.headers,
                                        verify=_TLS)
        await asyncio.gather(*(self._learn_bootstrap(b) for b in self.prefill.values()))

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        await self.client.aclose()

    def exchange(self) -> "Exchange":
        return Exchange(self.headers)

    # -- bootstrap addresses ---------------------------------------------------------------
    async def bootstrap_address(self, url: str) -> tuple[str, int]:
        backend = self.prefill[url]
        if backend.bootstrap is None:
            await self._learn_bootstrap(backend)
        return backend.bootstrap or (self.bootstrap_host or urlparse(url).hostname, self.bootstrap_port)

    async def _learn_bootstrap(self, backend: Backend) -> bool:
        """Read P's bootstrap address from its /server_info: False when P does not answer (asked again later)."""
        try:
            resp = await self.client.get(backend.url + "/server_info", timeout=10.0)
            info = resp.json()
            port = int(info.get("bootstrap_port") or self.bootstrap_port)
            told = info.get("bootstrap_host")  # P's --advertise-host: where D reaches it
        except (httpx.HTTPError, ValueError, AttributeError, TypeError):
            return False
        host = told if self.bootstrap_host is None and told and told not in _WILDCARDS else None
        backend.bootstrap = (host or self.bootstrap_host or urlparse(backend.url).hostname, port)
        return True

    # -- up and down -----------------------------------------------------------------------
    def mark_down(self, url: str, why: str) -> None:
        backend = self.all[url]
        if backend.up:
            logger.warning("%s is down (%s): requests for it wait for it to come back", backend.name, why)
            backend.down_since, backend.why = time.monotonic(), why
            backend.came_up.clear()
        if url not in self._probes or self._probes[url].done():
            self._probes[url] = asyncio.ensure_future(self._probe(backend))

    async def _probe(self, backend: Backend) -> None:
        while not await self._answers(backend):
            await asyncio.sleep(PROBE_INTERVAL_S)
        logger.warning("%s is back after %.1f s", backend.name, time.monotonic() - backend.down_since)
        backend.down_since, backend.why = None, ""
        backend.came_up.set()

    async def _answers(self, backend: Backend) -> bool:
        """/health 200 (the engine is alive); a P's bootstrap address re-read and its bootstrap server up."""
        try:
            resp = await self.client.get(backend.url + "/health", timeout=PROBE_TIMEOUT_S)
            if resp.status_code != 200:
                return False
            if backend.role == "prefill":
                if not await self._learn_bootstrap(backend):
                    return False
                host, port = backend.bootstrap
                resp = await self.client.get(f"http://{host}:{port}/health", timeout=PROBE_TIMEOUT_S)
                return resp.status_code == 200
        except httpx.HTTPError:
            return False
        return True

    async def wait_up(self, urls: list[str], deadline: float) -> list[Backend]:
        """Wait until every backend of `urls` is up or `deadline` (monotonic) passed; the ones still down."""
        for url in urls:
            backend = self.all[url]
            left = deadline - time.monotonic()
            if not backend.up and left > 0:
                try:
                    await asyncio.wait_for(backend.came_up.wait(), left)
                except asyncio.TimeoutError:
                    pass
        return [self.all[u] for u in urls if not self.all[u].up]

    def usable(self, urls: list[str]) -> list[str]:
        """The backends of `urls` that are up (all of them when none is)."""
        return [u for u in urls if self.all[u].up] or list(urls)


class Exchange:
    """One request to one backend on a connection of its own (module docstring, step 2). `post` and `send` start
    it as a task; `close()` (idempotent; `drop()` from synchronous code) ends it whatever state it is in."""

    _dropping: set = set()  # drops in progress (a task nobody holds can be collected before it runs)

    def __init__(self, headers: dict[str, str]):
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), headers=headers, verify=_TLS,
                                        limits=httpx.Limits(max_connections=1, max_keepalive_connections=0))
        self.task: asyncio.Task | None = None

    def post(self, url: str, body: dict) -> asyncio.Task:
        """The whole answer (read in full)."""
        self.task = asyncio.ensure_future(self.client.post(url, json=body))
        return self.task

    def send(self, url: str, body: dict) -> asyncio.Task:
        """The answer's headers; its body is read (or streamed) by the caller."""
        self.task = asyncio.ensure_future(self.client.send(self.client.build_request("POST", url, json=body),
                                                           stream=True))
        return self.task

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()  # a no-op once it is done
            await asyncio.wait({self.task})
            if not self.task.cancelled():
                self.task.exception()  # taken: never logged as "never retrieved"
        await self.client.aclose()  # every connection, whatever state httpcore left it in

    def drop(self) -> None:
        task = asyncio.ensure_future(self.close())
        Exchange._dropping.add(task)
        task.add_done_callback(Exchange._dropping.discard)
