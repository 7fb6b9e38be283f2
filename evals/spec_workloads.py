"""Speculation that pays: decode tokens/s of every drafter vs non-spec on three workloads
(`python -m evals.spec --workloads` -> evals/results/spec_workloads.json + .png).

Workloads (held-out ShareGPT never trained on; chat-rendered; greedy, EOS honoured):
  chat      the first human turn of held-out conversations
  code      HumanEval stubs ("Complete this Python function.")
  grounded  an answer that reuses its input: `grounded_prompts` below, a fixed recipe over the
            held-out split (fixed before any measurement; `--split train` gives the same recipe on
            training conversations, the only prompts defaults were tuned on)
Configs: non-spec; EAGLE-3 / MTP shipped heads with the defaults (adaptive on) and adaptive off;
ngram (defaults, adaptive on/off); hybrid (EAGLE-3 + --spec-ngram); a random-init EAGLE-3 head
(a useless draft) with adaptive on/off. Each batch size runs the configs interleaved rep by rep in a
rotating order; outputs must equal non-spec's token for token; ratios are the median of the
per-rep ratios to the non-spec run of the same rep, with their min-max spread.
  decode tok/s = (output tokens - batch) / (wall time after every request has its first token)
`--lockstep`: the configs of a rep run at once, one engine step each in turn, each config timed by its
own steps (`lockstep_run`): the interleaving is per step rather than per run, so the machine's drift
between runs falls on every config alike.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time

import torch

from evals.harness.prompts import chat_prompt, humaneval_prompts
from evals.harness.results import log, machine_info, median, versions, write_json

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine

# -- the grounded workload: fixed recipe ---------------------------------------------------------
GROUNDED_TASKS = (  # (instruction, applies to code)
    ("Fix any spelling and grammar mistakes in the following text. Reply with the corrected text only.", False),
    ("Rewrite the following text so that it reads more clearly, keeping all of its content. "
     "Reply with the rewritten text only.", False),
    ("Repeat the following text, replacing every occurrence of the word \"the\" with \"this\".", False),
)
CODE_TASK = "Add a short comment above each function in the following code and return the whole code."
MIN_CHARS, MAX_CHARS = 300, 900


def grounded_prompts(tokenizer, num: int, split: str = "held_out") -> list[list[int]]:
    """An edit of a given text: the first assistant turn of 300-900 characters of each conversation of
    `split` (file order), with an instruction picked by sha1(id) (code blocks get the code task)."""
    from specpd.train.data import is_held_out, iter_sharegpt
    out = []
    for record in iter_sharegpt():
        rid = str(record.get("id"))
        if is_held_out(rid) != (split == "held_out"):
            continue
        text = next((t["value"] for t in record.get("conversations", []) if t.get("from") == "gpt"
                     and MIN_CHARS <= len(t.get("value", "")) <= MAX_CHARS), None)
        if text is None:
            continue
        if "```" in text:
            instruction = CODE_TASK
        else:
            instruction = GROUNDED_TASKS[int(hashlib.sha1(rid.encode()).hexdigest(), 16) % len(GROUNDED_TASKS)][0]
        out.append(chat_prompt(tokenizer, f"{instruction}\n\n{text.strip()}"))
        if len(out) == num:
            break
    return out


def chat_prompts(tokenizer, num: int, split: str = "held_out") -> list[list[int]]:
    from specpd.train.data import is_held_out, iter_sharegpt
    out = []
    for record in iter_sharegpt():
        if is_held_out(str(record.get("id"))) != (split == "held_out"):
            continue
        turns = [t["value"] for t in record.get("conversations", []) if t.get("from") == "human"
                 and t.get("value", "").strip()]
        if turns:
            ids = chat_prompt(tokenizer, turns[0])
            if len(ids) <= 512:
                out.append(ids)
        if len(out) == num:
            break
    return out


WORKLOADS = {"chat": chat_prompts, "code": lambda tok, n, split="held_out": humaneval_prompts(tok, n),
             "grounded": grounded_prompts}


def configs(random_head: str) -> dict[str, SpecConfig]:
    return {
        "non_spec": SpecConfig(),
        "non_spec_twin": SpecConfig(),  # a second plain engine: what two identical engines read apart (noise)
        # a draft model alone (--no-spec-ngram); the EAGLE family's default merges n-grams in: "hybrid"
        "eagle3": SpecConfig("eagle3", draft_model="default", spec_ngram=False),
        "eagle3_fixed": SpecConfig("eagle3", draft_model="default", spec_ngram=False, spec_adaptive=False),
        "mtp": SpecConfig("mtp", draft_model="default", spec_ngram=False),
        "ngram": SpecConfig("ngram"),
        "ngram_fixed": SpecConfig("ngram", spec_adaptive=False),
        "hybrid": SpecConfig("eagle3", draft_model="default"),  # `--speculative-algorithm eagle3` as shipped
        "mtp_hybrid": SpecConfig("mtp", draft_model="default"),
        # the cheapest speculation, every round (no policy): one or two draft tokens a request
        "eagle3_chain1": SpecConfig("eagle3", draft_model="default", spec_ngram=False, spec_adaptive=False,
                                    spec_num_steps=1, spec_topk=1),
        "eagle3_chain2": SpecConfig("eagle3", draft_model="default", spec_ngram=False, spec_adaptive=False,
                                    spec_num_steps=2, spec_topk=1),
        "random_eagle3": SpecConfig("eagle3", draft_model=random_head, spec_ngram=False),  # a useless draft
        "random_eagle3_fixed": SpecConfig("eagle3", draft_model=random_head, spec_ngram=False, spec_adaptive=False),
        "random_hybrid": SpecConfig("eagle3", draft_model=random_head),
    }


def timed_run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                final[out.request_id] = out
    t1 = time.perf_counter()
    outs = [final[r] for r in ids]
    assert engine.free_pages == engine.total_pages, "KV pages leaked"
    decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
    ttft = max(first.values()) - t0
    verify = sum(o.spec_verify_count for o in outs)
    committed = sum(o.spec_committed_tokens for o in outs)
    return {"tokens": [o.token_ids for o in outs], "decode_tok_s": decode_tokens / max(t1 - t0 - ttft, 1e-9),
            "wall_s": t1 - t0, "cpu_util": (time.process_time() - cpu0) / (t1 - t0),
            "tau": committed / verify if verify else None, "decode_tokens": decode_tokens}


def lockstep_run(engines: dict[str, LLMEngine], prompts: list[list[int]], params: SamplingParams,
                 tag: str, clock=time.perf_counter, concurrency: int | None = None) -> dict[str, dict]:
    """Every config on the same prompts at once, one engine step each in turn (a rotating order), each
    step timed on its own: a config's decode time is the sum of its own step times after every one of its
    requests has a first token. Interleaving per ~100 ms step instead of per run leaves the box's drift
    (other jobs, memory bandwidth) to fall on every config alike; the ratios then hold the engine's own
    difference. `clock`: time.thread_time reads each step's CPU time instead (a diagnostic: it leaves out
    the time the box took the core away, not memory-bandwidth contention).
    `concurrency`: a closed loop instead, as a served benchmark's clients: that many requests at a time, the next
    prompt added when one finishes; then `tok_s` (every output token over all the config's step time, prefills
    included) is what compares, `decode_tok_s` is left out."""
    names = list(engines)
    ids = {n: [f"{tag}-{n}-{i}" for i in range(len(prompts))] for n in names}
    start = concurrency or len(prompts)
    queued = {n: list(zip(ids[n], prompts))[start:] for n in names}
    for n in names:
        for rid, p in zip(ids[n][:start], prompts[:start]):
            engines[n].add_request(rid, p, params)
    busy = {n: 0.0 for n in names}  # seconds in this config's steps so far
    ttft = {n: None for n in names}
    first = {n: set() for n in names}
    final = {n: {} for n in names}
    turn = 0
    while any(engines[n].has_unfinished_requests() for n in names):
        order = names[turn % len(names):] + names[:turn % len(names)]
        turn += 1
        for n in order:
            eng = engines[n]
            if not eng.has_unfinished_requests():
                continue
            t0 = clock()
            outs = eng.step()
            busy[n] += clock() - t0
            for out in outs:
                if out.new_token_ids:
                    first[n].add(out.request_id)
                if out.finished:
                    final[n][out.request_id] = out
                    if queued[n]:
                        eng.add_request(*queued[n].pop(0), params)
            if ttft[n] is None and len(first[n]) == len(prompts):
                ttft[n] = busy[n]
    results = {}
    for n in names:
        eng = engines[n]
        assert eng.free_pages == eng.total_pages, f"{n}: KV pages leaked"
        outs = [final[n][r] for r in ids[n]]
        decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
        verify = sum(o.spec_verify_count for o in outs)
        committed = sum(o.spec_committed_tokens for o in outs)
        results[n] = {"tokens": [o.token_ids for o in outs], "busy_s": busy[n], "ttft_s": ttft[n],
                      "tok_s": sum(len(o.token_ids) for o in outs) / busy[n],
                      "tau": committed / verify if verify else None, "decode_tokens": decode_tokens}
        if concurrency is None:
            results[n]["decode_tok_s"] = decode_tokens / max(busy[n] - ttft[n], 1e-9)
    return results


def run(args) -> None:
    from specpd.spec.draft.loader import random_draft_checkpoint
    from specpd.model.loader import load_checkpoint
    torch.set_num_threads(args.threads)
    meta = {"machine": machine_info(), "versions": versions()}
    ckpt = load_checkpoint("default")
    tok = ckpt.tokenizer
    random_head = tempfile.mkdtemp(prefix="random-eagle3-")
    random_draft_checkpoint(random_head, "eagle3", ModelConfig.from_hf(ckpt.hf_config), seed=0, draft_vocab_size=8192)
    all_cfgs = configs(random_head)
    names = args.configs or [n for n in all_cfgs if n != "non_spec_twin"]  # the twin: asked for by name
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    results: dict = {"meta": {**meta, "args": vars(args)}, "runs": {}}
    # one engine per config for the whole run (loading and the adaptive cost measurement happen once)
    engines = {n: LLMEngine(EngineConfig(model="default", dtype="float32", spec=all_cfgs[n], num_threads=args.threads,
                                         cache=CacheConfig(page_size=16, num_pages=args.num_pages),
                                         scheduler=SchedulerConfig(max_running_requests=max(args.batch_sizes))),
                            checkpoint=ckpt) for n in names}
    reps_of = {b: args.reps_b1 if b == 1 else args.reps for b in args.batch_sizes}
    for workload in args.workload_names:
        # every rep of every batch size gets prompts of its own: no engine ever sees a prompt twice, so
        # the n-gram store (on by default) holds other requests' outputs, never this prompt's last answer
        prompts_all = WORKLOADS[workload](tok, sum(b * r for b, r in reps_of.items()), args.split)
        offset = 0
        for batch in args.batch_sizes:
            batch_names = names if batch == 1 else [n for n in names if n in args.batched_configs]
            reps = reps_of[batch]
            raw = {n: [] for n in batch_names}
            for rep in range(reps):
                prompts = prompts_all[offset:offset + batch]
                offset += batch
                order = batch_names[rep % len(batch_names):] + batch_names[:rep % len(batch_names)]
                ref = None
                if args.lockstep:
                    rep_res = lockstep_run({n: engines[n] for n in order}, prompts, params, f"{workload}-{batch}-{rep}")
                else:
                    rep_res = {n: timed_run(engines[n], prompts, params, f"{workload}-{batch}-{rep}-{n}")
                               for n in order}
                for n in batch_names:
                    if rep_res[n]["tokens"] != rep_res["non_spec"]["tokens"]:
                        raise AssertionError(f"{n} output differs from non-spec ({workload}, batch {batch})")
                    r = dict(rep_res[n])
                    r.pop("tokens")
                    r["ratio"] = r["decode_tok_s"] / rep_res["non_spec"]["decode_tok_s"]
                    raw[n].append(r)
                log(workload, batch, rep, {n: round(raw[n][-1]["ratio"], 2) for n in batch_names})
            summary = {}
            for n in batch_names:
                ratios = [r["ratio"] for r in raw[n]]
                taus = [r["tau"] for r in raw[n] if r["tau"] is not None]
                summary[n] = {"decode_tok_s": median([r["decode_tok_s"] for r in raw[n]]),
                              "vs_non_spec": median(ratios), "spread": [min(ratios), max(ratios)],
                              "tau": median(taus) if taus else None, "reps": raw[n]}
                eng = engines[n]
                if eng.spec_runner is not None and eng.spec_runner.policy is not None:
                    st = eng.spec_runner.policy.stats
                    summary[n]["rounds_off_share"] = st.rounds_off / max(st.rounds, 1)
            results["runs"][f"{workload}/b{batch}"] = summary
            write_json(args.out, results)
    write_json(args.out, results)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    for key, summary in results["runs"].items():
        log(key, {n: (round(s["vs_non_spec"], 2), s["tau"] and round(s["tau"], 2)) for n, s in summary.items()})


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = list(results["runs"])
    names = sorted({n for s in results["runs"].values() for n in s if n != "non_spec"})
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(keys)), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        xs = [k + i * width for k, key in enumerate(keys) if n in results["runs"][key]]
        ys = [results["runs"][key][n]["vs_non_spec"] for key in keys if n in results["runs"][key]]
        lo = [y - results["runs"][key][n]["spread"][0] for y, key in zip(ys, [k for k in keys if n in results["runs"][k]])]
        hi = [results["runs"][key][n]["spread"][1] - y for y, key in zip(ys, [k for k in keys if n in results["runs"][k]])]
        ax.bar(xs, ys, width, label=n, yerr=[lo, hi], capsize=2)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys)
    ax.set_ylabel("decode tok/s vs non-spec (median, min-max)")
    ax.set_title("specpd speculation on SmolLM2-135M, CPU, 1 thread, greedy")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
