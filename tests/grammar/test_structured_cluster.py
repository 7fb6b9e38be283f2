"""Structured outputs through a real `specpd serve --disagg 1p1d` cluster (launcher, router, P and D
processes over HTTP), SmolLM2 with the shipped EAGLE-3 draft (tree), pinned speculation, both draft modes:
the CASES (nested-object schemas with enum, pattern and array; regex; choice; a sampled schema) sent all at
once, streamed and not, plus a streamed chat request with a response_format: every output validates, greedy
output is the unified engine's token for token, D speculates, and P's and D's pages come back."""
import concurrent.futures
import json

import httpx

from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import wait_free_pages
from tests.grammar.cases import CASES, PERSON, check
from tests.server.launcher import launch_servers


def constraint_fields(params) -> dict:
    """The request fields for a case's constraint, in a different dialect per kind."""
    if params.constraint_kind == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": json.loads(params.constraint_spec)}}}
    if params.constraint_kind == "regex":
        return {"structured_outputs": {"regex": params.constraint_spec}}
    return {"guided_choice": json.loads(params.constraint_spec)}


def completion_body(prompt, params) -> dict:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature, "logprobs": 0,
            "return_tokens_as_token_ids": True, **constraint_fields(params)}
    return body if params.seed is None else {**body, "seed": params.seed}


def token_ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in (logprobs or {}).get("tokens", [])]


def complete(base: str, body: dict, stream: bool) -> dict:
    """{"text", "tokens", "finish_reason", "usage"} of one /v1/completions request."""
    if not stream:
        resp = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return {"text": choice["text"], "tokens": token_ids(choice["logprobs"]),
                "finish_reason": choice["finish_reason"], "usage": resp.json()["usage"]}
    out = {"text": "", "tokens": [], "finish_reason": None, "usage": None}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if not chunk["choices"]:
                out["usage"] = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            out["text"] += choice["text"]
            out["tokens"] += token_ids(choice.get("logprobs"))
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def chat_stream(base: str) -> str:
    body = {"messages": [{"role": "user", "content": "Describe Bob from Tokyo, as JSON."}], "max_tokens": 64,
            "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    text = ""
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[len("data: "):])["choices"]
                text += (choices[0]["delta"].get("content") or "") if choices else ""
    return text


def cluster_args(mode: str) -> tuple[list[str], str, str]:
    """(`specpd serve` arguments, P's URL, D's URL) for a 1P1D cluster in draft mode `mode`."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    args = ["--disagg", "1p1d", "--prefill-port", str(p_port), "--decode-port", str(d_port), "--bootstrap-port",
            str(boot), "--log-level", "warning", "--transfer-backend", "tcp", "--model", "default",
            "--page-size", "16", "--num-pages", "128", "--num-threads", "1", "--speculative-algorithm", "eagle3",
            "--draft-model", "default", "--spec-num-steps", "3", "--spec-topk", "2", "--spec-num-draft-tokens", "6",
            "--draft-mode", mode, "--spec-adaptive-pinned"]
    return args, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"


MODES = ("both", "decode-only")


def test_constrained_requests_through_1p1d_clusters_in_both_draft_modes(prompts, reference):
    """Both clusters at once (each D decodes on its own core while the P's idle); every case once per cluster,
    streamed in one draft mode and not in the other."""
    clusters = [cluster_args(mode) for mode in MODES]
    jobs = [(m, i, (i + m) % 2 == 1) for m in range(len(MODES)) for i in range(len(CASES))]
    with launch_servers([args for args, _, _ in clusters]) as procs, \
            concurrent.futures.ThreadPoolExecutor(len(jobs) + len(MODES)) as pool:
        bases = [base for _, base, _ in procs]
        chats = [pool.submit(chat_stream, base) for base in bases]
        outs = list(pool.map(lambda job: complete(bases[job[0]], completion_body(prompts[job[1]], CASES[job[1]][1]),
                                                  job[2]), jobs))
        for chat in chats:
            check(chat.result(), ("json", PERSON))
        for (m, i, stream), out in zip(jobs, outs):
            _, params, how = CASES[i]
            where = (MODES[m], i, "stream" if stream else "whole")
            assert out["finish_reason"] == "stop", (where, out)
            check(out["text"], how)
            assert len(out["tokens"]) == out["usage"]["completion_tokens"], where
            if params.greedy:
                assert out["tokens"] == reference[i].token_ids, (where, out["text"], reference[i].text)
        for m, (_, p_url, d_url) in enumerate(clusters):
            assert sum(o["usage"].get("spec_accepted_tokens", 0) for (n, _, _), o in zip(jobs, outs) if n == m) > 0
            for url in (p_url, d_url):
                info = wait_free_pages(url)
                assert info["free_pages"] == info["total_pages"], (MODES[m], url, info)
