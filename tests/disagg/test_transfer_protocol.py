"""Mooncake's transport flags (--transfer-protocol tcp|rdma, --rdma-devices): checked at start-up naming the flag
(this box has no RDMA device, so `rdma` is refused here for real), and the choice reaching the engines the server
creates (its own and its tensor-parallel ranks', through the environment)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specpd.disagg.transfer import backend_available
from specpd.disagg.transfer.mooncake import (DEVICES_ENV, PROTOCOL_ENV, check_transport, rdma_devices_here,
                                             use_transport)
from specpd.server.launch import REPO, free_port


@pytest.fixture
def sysfs(tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    (tmp_path / "mlx5_1").mkdir()
    return str(tmp_path)


def test_rdma_devices_are_checked(sysfs, tmp_path):
    check_transport("tcp", "", "mooncake")
    check_transport("tcp", "", "tcp")
    check_transport("rdma", "", "mooncake", root=sysfs)
    check_transport("rdma", "mlx5_1", "mooncake", root=sysfs)
    assert rdma_devices_here(sysfs) == ["mlx5_0", "mlx5_1"] and rdma_devices_here(str(tmp_path / "none")) == []
    with pytest.raises(ValueError, match=r"--rdma-devices mlx5_7: not on this machine \(its RDMA devices: "
                                         r"mlx5_0,mlx5_1\)"):
        check_transport("rdma", "mlx5_0,mlx5_7", "mooncake", root=sysfs)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"--transfer-protocol rdma: this machine has no RDMA device"):
        check_transport("rdma", "", "mooncake", root=str(empty))
    with pytest.raises(ValueError, match=r"--transfer-protocol rdma needs --transfer-backend mooncake \(got tcp\)"):
        check_transport("rdma", "", "tcp", root=sysfs)
    with pytest.raises(ValueError, match=r"--rdma-devices mlx5_0 needs --transfer-protocol rdma \(got tcp\)"):
        check_transport("tcp", "mlx5_0", "mooncake", root=sysfs)


@pytest.mark.skipif(bool(rdma_devices_here()), reason="this machine has an RDMA device")
def test_rdma_without_a_device_is_refused_at_start():
    """A real decode server told to use RDMA on a machine without a NIC exits before loading its model."""
    cmd = [sys.executable, "-m", "specpd", "serve", "--role", "decode", "--port", str(free_port()),
           "--transfer-backend", "mooncake", "--transfer-protocol", "rdma", "--model", "/nonexistent"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode != 0
    assert "--transfer-protocol rdma: this machine has no RDMA device" in proc.stderr
    assert "nonexistent" not in proc.stderr  # refused before the model was looked at


def test_the_choice_reaches_the_backend(monkeypatch):
    ok, why = backend_available("mooncake")
    if not ok:
        pytest.skip(why)
    from specpd.disagg.transfer.mooncake import MooncakeBackend
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    monkeypatch.delenv(DEVICES_ENV, raising=False)
    use_transport("tcp", "", "mooncake")
    assert os.environ[PROTOCOL_ENV] == "tcp" and os.environ[DEVICES_ENV] == ""
    backend = MooncakeBackend("127.0.0.1")
    try:
        assert backend._engine_key[1:3] == ("tcp", "")
    finally:
        backend.close()
    monkeypatch.setenv(PROTOCOL_ENV, "rdma")  # what use_transport leaves for the server's engines
    monkeypatch.setattr(MooncakeBackend, "_new_engine", staticmethod(lambda *key: pytest.fail(f"engine {key}")))
    with pytest.raises(pytest.fail.Exception, match="'rdma'"):
        MooncakeBackend("127.0.0.1")
