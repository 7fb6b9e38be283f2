"""`specpd serve --tp-size 3` (the default model: 9 heads, 3 KV heads) with the shipped EAGLE-3 head and the
adaptive policy as a user starts it (calibrated at startup through the TP group), the way a user serves it:
concurrent streamed and plain requests answer what a plain TP 1 server answers, it speculates, every page comes
back; a killed rank stops the server (exit 1, the log naming the rank) and every other rank with it, the
other server untouched (PD roles at TP > 1, and the launcher restarting such a server: tests/disagg)."""
import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.launcher import launch_servers

QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "Write a haiku about rain.",
             "What is 2 + 2?"]
COMMON = ["--model", "default", "--log-level", "warning", "--num-threads", "1"]


def ask(base: str, question: str, max_tokens: int, stream: bool) -> str:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    with httpx.Client(base_url=base, timeout=120) as client:
        if not stream:
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["message"]["content"]
        text = ""
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
        return text


def tp_ranks(pid: int) -> list[int]:
    """The pids of server `pid`'s tensor-parallel worker ranks (its multiprocessing-spawned children)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if rank_alive(int(p))]


def rank_alive(pid: int) -> bool:
    try:
        return b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()  # (a zombie's cmdline is empty)
    except OSError:
        return False


def test_a_speculating_tp3_server_answers_as_tp1_and_a_killed_rank_stops_it():
    spec = ["--speculative-algorithm", "eagle3", "--draft-model", "default"]
    with launch_servers([COMMON, COMMON + ["--tp-size", "3", *spec]]) as [(_, base1, _), (proc3, base3, log3)]:
        info = httpx.get(f"{base3}/server_info").json()
        assert info["runtime"]["tp_size"] == 3
        jobs = [(q, 8 + 6 * i, i % 2 == 0) for i, q in enumerate(QUESTIONS)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            want = list(pool.map(lambda j: ask(base1, *j), jobs))
            got = list(pool.map(lambda j: ask(base3, *j), jobs))
        assert got == want and all(got)
        info = httpx.get(f"{base3}/server_info").json()
        assert info["free_pages"] == info["total_pages"] and info["spec_accept_length"] > 1.0, info
        ranks = tp_ranks(proc3.pid)
        assert len(ranks) == 2, ranks  # ranks 1 and 2 (rank 0 is the server)
        os.kill(ranks[-1], signal.SIGKILL)
        assert proc3.wait(timeout=30) == 1  # it notices while idle, says why and exits for its supervisor
        assert re.search(r"tensor-parallel rank\(s\) \[[12]\] exited", open(log3).read())
        deadline = time.monotonic() + 10
        while any(rank_alive(p) for p in ranks):  # the other rank reads its pipe's end and exits too
            assert time.monotonic() < deadline, "a rank outlived its server"
            time.sleep(0.1)
        assert ask(base1, QUESTIONS[0], 8, False) == want[0]  # the other server is untouched

