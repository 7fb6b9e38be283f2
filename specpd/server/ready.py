"""The line a server prints once clients may send requests: where it serves and a curl to try it.

Printed by a unified `specpd serve` (cli.py) and by `specpd serve --disagg`'s supervisor once its router is up
(cluster.py); here, below both, so neither imports the other for it.
"""
from __future__ import annotations

import json
import shlex


def ready_message(host: str, port: int, model_name: str) -> str:
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    return (f"specpd ready: serving {model_name} on http://{client_host}:{port}\n"
            f"curl http://{client_host}:{port}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")
