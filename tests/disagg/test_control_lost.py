"""D learns that a P process exited from its control connection, not from a clock: a P killed and restarted
faster than D's route trust (ROUTE_TRUST_S) must not be reached at its old control endpoint (issue 30's CI run:
a tiny-model P came back in 1.8 s and D2 sent the room to the dead endpoint, to wait out its heartbeat timeout).
Real sockets: D's control thread against a P stand-in in a subprocess, SIGKILLed."""
import os
import signal
import subprocess
import sys
import time
import types

import zmq

from specpd.disagg.control import DecodeControl
from specpd.disagg.messages import Heartbeat

PEER = """
import sys, zmq
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
port = router.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    frames = router.recv_multipart()
    router.send_multipart(frames)  # echo: D hears from its P
"""


def wait_for(pred, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_a_killed_prefill_is_lost_at_once_and_a_frozen_one_is_not():
    ctx = zmq.Context()
    worker = types.SimpleNamespace(ctx=ctx, name="decode@test", heartbeat_timeout_s=25.0,
                                   prefill_timeout_s=300.0, transfer_timeout_s=60.0)
    control = DecodeControl(worker).start()
    procs = [subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        victim, frozen = (f"tcp://127.0.0.1:{int(p.stdout.readline())}" for p in procs)
        for endpoint in (victim, frozen):
            control.send(endpoint.encode(), Heartbeat("decode@test", 1, time.time()))
        assert wait_for(lambda: victim in control.heard and frozen in control.heard), "no echo from the peers"
        assert not control.lost
        os.kill(procs[1].pid, signal.SIGSTOP)  # frozen: its connection holds, it may still write
        killed_at = time.monotonic()
        procs[0].kill()
        assert wait_for(lambda: victim in control.lost), "D never saw the killed P's connection drop"
        print(f"\nlost {control.lost[victim] - killed_at:.3f} s after the kill")
        time.sleep(3 * 0.05)  # a few control ticks more
        assert frozen not in control.lost
        control.command(b"forget-peer", victim.encode())  # what D does once it decided P is gone
        assert wait_for(lambda: victim not in control.lost)
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT) if p.poll() is None else None
            p.kill()
            p.wait()
        control.close()
        ctx.term()
