"""Mooncake TransferEngine backend: P2PHANDSHAKE metadata, TCP on one box, RDMA across machines.

Setup (`make install` does it): `pip install mooncake-transfer-engine-non-cuda` (the CPU wheel) and the
system library libibverbs1 (with libnl-3-200, libnl-route-3-200). As root: `apt-get install libibverbs1`.
Without root: `specpd/disagg/transfer/install_ibverbs.sh` extracts the .debs into
`$VIRTUAL_ENV/lib/specpd-ibverbs` (or `$SPECPD_IBVERBS_DIR`), which `load_transfer_engine` preloads with
ctypes before importing the engine.

Engine facts this file relies on (mooncake-transfer-engine 0.3.13):
- `initialize(host, "P2PHANDSHAKE", "tcp", "")` picks a free RPC port; the session id a peer writes to is
  "host:rpc_port". Peers must address the engine by the host it was initialized with.
- `batch_transfer_sync_write(peer, src_ptrs, dst_ptrs, lengths)` returns 0 or -1 (no reason; the engine
  logs it). It busy-polls in C++ with the GIL released.
- The TCP transport queues at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024) descriptors per peer plus a
  1 s admission queue; beyond that the batch fails *while its admitted slices are still being written*,
  and the next calls to that peer fail until they drain. Hence `max_descriptors_per_call` (512) and one
  call per peer at a time.
- A dead peer fails in well under a millisecond (the handshake connect is refused). A frozen peer blocks a
  call for MC_TRANSFER_TIMEOUT seconds (default 30, floor 5) plus 1 s per GiB; `timeout_s` sets it for
  engines created here (the engine reads the variable in its constructor).
- A write to an address the peer did not register fails (-1) and the peer logs an error.

Transport: `--transfer-protocol tcp|rdma` and `--rdma-devices` (P and D alike; docs/disaggregation.md's two-host
setup). `use_transport` checks them at start-up, naming the flag (RDMA needs this backend and an RDMA device under
/sys/class/infiniband), and keeps them in the process environment, so every MooncakeBackend of the server and of
its tensor-parallel ranks (spawned processes inherit it) initializes its engine with them.
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from specpd.disagg.messages import PoolLayout
from specpd.disagg.transfer.base import PageCopy, PeerUnreachable, TransferBackend, TransferError

PROTOCOL_ENV, DEVICES_ENV = "SPECPD_TRANSFER_PROTOCOL", "SPECPD_RDMA_DEVICES"
PROTOCOLS = ("tcp", "rdma")
RDMA_SYSFS = "/sys/class/infiniband"


def rdma_devices_here(root: str = RDMA_SYSFS) -> list[str]:
    """The RDMA devices this machine has (their names, e.g. mlx5_0), none where the class is missing."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def check_transport(protocol: str, devices: str, backend: str, root: str = RDMA_SYSFS) -> None:
    """ValueError naming the flag when `protocol` / `devices` (comma-separated) cannot run here with `backend`."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"--transfer-protocol must be one of {PROTOCOLS}, got {protocol!r}")
    names = [d for d in devices.split(",") if d]
    if protocol == "tcp":
        if names:
            raise ValueError(f"--rdma-devices {devices} needs --transfer-protocol rdma (got tcp)")
        return
    if backend != "mooncake":
        raise ValueError(f"--transfer-protocol rdma needs --transfer-backend mooncake (got {backend})")
    present = rdma_devices_here(root)
    if not present:
        raise ValueError(f"--transfer-protocol rdma: this machine has no RDMA device ({root} is empty or missing); "
                         f"use --transfer-protocol tcp")
    missing = [d for d in names if d not in present]
    if missing:
        raise ValueError(f"--rdma-devices {','.join(missing)}: not on this machine (its RDMA devices: "
                         f"{','.join(present)})")


def use_transport(protocol: str, devices: str, backend: str) -> None:
    """Check the transport (check_transport), then make it this process's and its children's."""
    check_transport(protocol, devices, backend)
    os.environ[PROTOCOL_ENV], os.environ[DEVICES_ENV] = protocol, devices


# dependency order: libibverbs needs libnl-route-3, which needs libnl-3
_IBVERBS_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
_ENV_LOCK = threading.Lock()
# TransferEngine's destructor holds the GIL for ~1 s, so a closed backend parks its engine (pools
# unregistered: a stale peer's writes are rejected) and the next backend with the same settings reuses it.
_IDLE_ENGINES: dict[tuple, list] = {}


def _local_ibverbs_dir() -> Path:
    return Path(os.environ.get("SPECPD_IBVERBS_DIR") or Path(sys.prefix) / "lib" / "specpd-ibverbs")


def _preload_local_ibverbs() -> bool:
    """dlopen a locally extracted libibverbs (and libnl) so the engine's dependency resolves by soname."""
    root = _local_ibverbs_dir()
    if not root.is_dir():
        return False
    paths = []
    for lib in _IBVERBS_LIBS:
        found = sorted(root.rglob(lib))
        if not found:
            return False
        paths.append(found[0])
    for path in paths:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return True


def load_transfer_engine() -> type:
    """Import `mooncake.engine.TransferEngine`, preloading a local libibverbs when the system lacks it."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
        return TransferEngine
    except ImportError as e:
        if "libibverbs" not in str(e) and "libnl" not in str(e):
            raise ImportError(f"mooncake transfer engine not installed ({e}); "
                              "pip install mooncake-transfer-engine-non-cuda (make install)") from e
        first_error = e
    if _preload_local_ibverbs():
        from mooncake.engine import TransferEngine
        return TransferEngine
    raise ImportError(f"mooncake transfer engine cannot load: {first_error}. Install the system library "
                      f"(apt-get install libibverbs1) or extract it without root with "
                      f"specpd/disagg/transfer/install_ibverbs.sh into {_local_ibverbs_dir()}") from first_error


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", *, protocol: str | None = None, device_name: str | None = None,
                 **options):
        """`protocol`: "tcp" (one box / no RDMA NIC) or "rdma"; `device_name`: RDMA NICs, e.g. "mlx5_0"
        (default: the server's --transfer-protocol / --rdma-devices, `use_transport`; else tcp)."""
        super().__init__(host, **options)
        protocol = protocol or os.environ.get(PROTOCOL_ENV) or "tcp"
        device_name = device_name if device_name is not None else os.environ.get(DEVICES_ENV, "")
        # Mooncake names itself (its session id) by the host it is initialized with: the advertised one
        self._engine_key = (self.advertise_host, protocol, device_name, max(5, math.ceil(self.timeout_s)))
        with _ENV_LOCK:
            idle = _IDLE_ENGINES.get(self._engine_key)
            self._engine = idle.pop() if idle else None
        if self._engine is None:
            self._engine = self._new_engine(*self._engine_key)
        self._session = f"{self.advertise_host}:{self._engine.get_rpc_port()}"
        self._base_addresses: list[int] = []

    @staticmethod
    def _new_engine(host: str, protocol: str, device_name: str, timeout_s: int):
        engine_cls = load_transfer_engine()
        with _ENV_LOCK:  # the engine reads MC_TRANSFER_TIMEOUT once, in its constructor
            saved = os.environ.get("MC_TRANSFER_TIMEOUT")
            os.environ["MC_TRANSFER_TIMEOUT"] = str(timeout_s)
            try:
                engine = engine_cls()
            finally:
                if saved is None:
                    os.environ.pop("MC_TRANSFER_TIMEOUT")
                else:
                    os.environ["MC_TRANSFER_TIMEOUT"] = saved
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(f"mooncake: TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                                f"returned {rc}")
        return engine

    @classmethod
    def check_available(cls) -> None:
        load_transfer_engine()

    @property
    def session_id(self) -> str:
        return self._session

    def _register_pool(self, pool_bytes: torch.Tensor) -> int:
        ptr, size = pool_bytes.data_ptr(), pool_bytes.numel()
        rc = self._engine.register_memory(ptr, size)
        if rc != 0:
            raise TransferError(f"mooncake: register_memory({size} B) returned {rc}")
        self._base_addresses.append(ptr)
        return ptr

    def _write(self, peer_session: str, copies: Sequence[PageCopy], peer_layouts: Sequence[PoolLayout],
               deadline: float) -> None:
        src, dst, lengths = [], [], []
        for c in copies:
            run, peer = c.run, peer_layouts[c.run.dst_pool]
            src.append(self._base_addresses[run.src_pool] + c.src_page * self._layouts[run.src_pool].page_bytes
                       + run.src_offset)
            dst.append(peer.base_address + c.dst_page * peer.page_bytes + run.dst_offset)
            lengths.append(run.num_bytes)
        start = time.monotonic()
        rc = self._engine.batch_transfer_sync_write(peer_session, src, dst, lengths)
        if rc == 0:
            return
        elapsed = time.monotonic() - start
        # a fast failure is a refused connection or a rejected address; a probe tells them apart cheaply
        if elapsed < 1.0 and self._engine.send_probe(peer_session) != 0:
            raise PeerUnreachable(f"mooncake: peer {peer_session} is unreachable (connection refused)")
        raise TransferError(f"mooncake: batch write of {len(copies)} blocks to {peer_session} failed after "
                            f"{elapsed:.2f} s (peer rejected the addresses, or timed out)")

    def _close(self) -> None:
        for ptr in self._base_addresses:
            self._engine.unregister_memory(ptr)
        self._base_addresses.clear()
        with _ENV_LOCK:
            _IDLE_ENGINES.setdefault(self._engine_key, []).append(self._engine)
        self._engine = None
