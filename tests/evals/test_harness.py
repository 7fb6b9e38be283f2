"""evals.harness without a model: every result file names the CPU ISA, the machine and the commit; a server started
in a process group of its own is stopped with its children; one that exits before /health answers is named with its
log's tail."""
import json
import os
import signal
import tempfile
import time

import pytest

from evals.harness.results import write_json
from evals.harness.servers import (ServerStartError, free_port, group_stats, start_group, stop_group,
                                   wait_healthy)
from specpd.machine import isa


def test_write_json_adds_the_isa_machine_and_commit_a_result_lacks(tmp_path):
    write_json(str(tmp_path / "r.json"), {"tok_s": 1.0})
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["tok_s"] == 1.0 and got["isa"] == isa()
    assert got["machine"]["cpu_model"] and "specpd_commit" in got["versions"]


def test_write_json_keeps_what_a_result_records_itself(tmp_path):
    data = {"meta": {"isa": "avx2", "machine": {"cpu_model": "X"}, "versions": {"specpd_commit": "abc"}}, "v": 2}
    write_json(str(tmp_path / "r.json"), data)
    assert json.loads((tmp_path / "r.json").read_text()) == data


def _alive(pgid: int, settle_s: float = 5.0) -> bool:
    """Whether a process of group `pgid` is still running (zombies, reaped by init in their own time, are not)."""
    deadline = time.monotonic() + settle_s
    while True:
        states = [fields[0] for fields in group_stats(pgid)]
        if any(s != "Z" for s in states) and time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        return any(s != "Z" for s in states)


def test_stop_group_stops_the_leader_and_its_children():
    with tempfile.TemporaryFile("w+") as log:
        proc = start_group(["bash", "-c", "sleep 300 & sleep 300 & wait"], log)
        assert _alive(proc.pid, settle_s=0)
        assert stop_group(proc, grace_s=10).startswith("SIGTERM")
        assert not _alive(proc.pid)


def test_stop_group_kills_a_leader_that_ignores_the_first_signal():
    with tempfile.NamedTemporaryFile("w+") as log:
        proc = start_group(["bash", "-c", "trap '' INT; echo ready; sleep 300 & wait; sleep 300"], log)
        deadline = time.monotonic() + 30
        while "ready" not in open(log.name).read() and time.monotonic() < deadline:  # the trap is set
            time.sleep(0.05)
        assert stop_group(proc, signal.SIGINT, grace_s=0.5, leader_only=True) == "SIGKILL (no exit 0 s after SIGINT)"
        assert not _alive(proc.pid)


def test_wait_healthy_names_a_server_that_exited_with_its_log():
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = start_group(["bash", "-c", "echo cannot bind; exit 3"], log)
        with pytest.raises(ServerStartError, match=r"(?s)peer exited with 3.*cannot bind"):
            wait_healthy(proc, f"http://127.0.0.1:{free_port()}", 30, "peer", log.name)
        stop_group(proc)


def test_command_line_is_how_the_run_reruns_from_the_repository_root(monkeypatch):
    from evals.harness.results import REPO_ROOT, command_line
    monkeypatch.setattr("sys.argv", [os.path.join(REPO_ROOT, "evals", "pd.py"), "--quick", "--backend", "tcp"])
    assert command_line() == "python -m evals.pd --quick --backend tcp"
