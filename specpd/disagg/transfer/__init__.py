"""Transfer backends (docs/disaggregation.md): an ABC and a registry; heavy engines are imported only when chosen.

`--transfer-backend {mooncake,tcp}`: `create_backend(name, host=..., **options)`. Without the flag a PD
server takes `default_backend()`: mooncake where its engine loads, else tcp with one log line saying why
(`specpd serve --disagg` decides once and passes the choice to every child).
"""
from __future__ import annotations

import importlib
import logging

from specpd.disagg.transfer.base import (PageCopy, PeerUnreachable, Run, TransferBackend, TransferError, TransferHandle,
                                         TransferResult, TransferStatus)

# name -> "module:Class", imported on first use (mooncake needs a native library that may be absent)
TRANSFER_BACKENDS: dict[str, str] = {
    "mooncake": "specpd.disagg.transfer.mooncake:MooncakeBackend",
    "tcp": "specpd.disagg.transfer.tcp:TcpBackend",
}


def get_backend_class(name: str) -> type[TransferBackend]:
    """Raises ValueError for an unknown name, ImportError (with the fix) when the backend cannot load."""
    if name not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose from {sorted(TRANSFER_BACKENDS)}")
    module, cls = TRANSFER_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, host: str = "127.0.0.1", **options) -> TransferBackend:
    return get_backend_class(name)(host, **options)


DEFAULT_BACKEND = "mooncake"
FALLBACK_BACKEND = "tcp"


def default_backend() -> str:
    """mooncake if its engine loads here, else tcp (logged once, with the reason)."""
    ok, why = backend_available(DEFAULT_BACKEND)
    if ok:
        return DEFAULT_BACKEND
    logging.getLogger(__name__).warning("transfer backend %s: %s cannot load here (%s)", FALLBACK_BACKEND,
                                        DEFAULT_BACKEND, why)
    return FALLBACK_BACKEND


def backend_available(name: str) -> tuple[bool, str]:
    """(True, "") if `name` loads here, else (False, why)."""
    try:
        get_backend_class(name).check_available()
    except (ImportError, OSError) as e:
        return False, str(e)
    return True, ""


__all__ = ["TRANSFER_BACKENDS", "PageCopy", "PeerUnreachable", "Run", "TransferBackend", "TransferError",
           "TransferHandle", "TransferResult", "TransferStatus", "backend_available", "create_backend",
           "default_backend", "get_backend_class"]
