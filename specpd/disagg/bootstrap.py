"""P's bootstrap registry: how a decode server finds a prefill server's control socket.

1. P starts `BootstrapServer(port, route)` next to its HTTP server (`--bootstrap-port`, default 8998).
2. The router tells D `bootstrap_host` / `bootstrap_port` in the request body.
3. D calls `GET /route` (`fetch_route`; D caches it while P keeps speaking, and asks again once P has been
   silent a moment, so a restarted P's new endpoint is found): P's ZMQ control endpoint, its `PeerConfig` and
   transfer backend. D runs `check_compatible` on the config before reserving pages; a bootstrap server that
   does not answer is `BootstrapUnreachable` (HTTP 502 from D).
4. `GET /health` answers 200 while P is up.

Plain stdlib HTTP in a daemon thread: no torch, no event loop shared with the engine.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_BOOTSTRAP_PORT = 8998


@dataclasses.dataclass(frozen=True)
class Route:
    """What `/route` returns. `config` is PeerConfig's fields as a dict."""

    zmq_endpoint: str  # P's ROUTER control socket, e.g. "tcp://127.0.0.1:40123"
    transfer_backend: str
    config: dict


class BootstrapServer:
    def __init__(self, host: str, port: int, route: Route):
        body = json.dumps(dataclasses.asdict(route)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/route":
                    self._answer(200, body)
                elif self.path == "/health":
                    self._answer(200, b'{"status": "ok"}')
                else:
                    self._answer(404, b'{"error": "not found"}')

            def _answer(self, code: int, payload: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="specpd-bootstrap", daemon=True)

    def start(self) -> "BootstrapServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class BootstrapUnreachable(ConnectionError):
    """D could not ask P's bootstrap server for its route: HTTP 502 (bad gateway), not the client's fault."""


def fetch_route(host: str, port: int, timeout: float = 5.0) -> Route:
    with urllib.request.urlopen(f"http://{host}:{port}/route", timeout=timeout) as resp:
        data = json.loads(resp.read())
    return Route(**data)
