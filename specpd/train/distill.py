"""Self-distillation: the target rewrites the assistant turns, so the draft learns the target's own
distribution rather than ChatGPT's (EAGLE's and Medusa's recommended data recipe).

Per group of `batch_size` conversations, turn by turn: every conversation that still has an
assistant turn renders its history (earlier turns already rewritten) with the chat template plus
the generation prompt, and the whole group is generated in one LLMEngine.generate call (the engine
batches and schedules them). The reply text replaces the original turn; a conversation whose
history no longer fits `max_len` ends there. Results stream to a JSONL file as ShareGPT records,
one line per input record consumed (empty conversations included), so a resumed run skips what is
done instead of regenerating it.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Iterable, Iterator

from specpd.train.data import Conversation, to_conversation

_SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def _record(conv: Conversation) -> dict:
    return {"id": conv.id, "conversations": [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]}
                                             for m in conv.messages]}


def self_distill(records: Iterable[dict], engine, tokenizer, out_path: str, max_len: int,
                 max_new_tokens: int = 512, temperature: float = 0.0, batch_size: int = 32,
                 seed: int = 0) -> Iterator[dict]:
    """Yield records whose assistant turns the target wrote (cached in `out_path`, JSONL)."""
    records = iter(records)
    done = _complete_lines(out_path) if os.path.isfile(out_path) else []
    with open(out_path, "w", encoding="utf-8") as f:  # drops a line cut short by a crash
        f.writelines(done)
    for line in done:
        next(records, None)
        yield json.loads(line)
    with open(out_path, "a", encoding="utf-8") as out:
        while True:
            group = [to_conversation(r) for r in _take(records, batch_size)]
            if not group:
                return
            for conv in _rewrite(group, engine, tokenizer, max_len, max_new_tokens, temperature, seed):
                record = _record(conv)
                out.write(json.dumps(record) + "\n")
                yield record
            out.flush()


def _complete_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line for line in f if line.endswith("\n")]


def _take(it: Iterator[dict], n: int) -> list[dict]:
    out = []
    for record in it:
        out.append(record)
        if len(out) == n:
            break
    return out


def _rewrite(group: list[Conversation], engine, tokenizer, max_len, max_new_tokens, temperature,
             seed) -> list[Conversation]:
    """The group with every assistant turn regenerated (conversations may end early)."""
    from specpd.core import SamplingParams

    # per conversation: rewritten messages so far, and the original turns still to process
    history: list[list[dict]] = [[] for _ in group]
    todo: list[list[dict]] = [list(c.messages) for c in group]
    turn = 0
    while True:
        prompts, params, who = [], [], []
        for i, rest in enumerate(todo):
            while rest and rest[0]["role"] != "assistant":
                history[i].append(rest.pop(0))
            if not rest:
                continue
            rest.pop(0)  # the original reply, replaced by the target's
            ids = tokenizer.encode(tokenizer.apply_chat_template(history[i], add_generation_prompt=True))
            if len(ids) + 1 >= max_len:
                todo[i] = []
                continue
            request_seed = zlib.crc32(f"{seed}:{group[i].id}:{turn}".encode())
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=min(max_new_tokens, max_len - len(ids)),
                                          temperature=temperature, seed=request_seed))
            who.append(i)
        if not prompts:
            break
        for i, out in zip(who, engine.generate(prompts, params)):
            history[i].append({"role": "assistant", "content": out.text})
        turn += 1
    result = []
    for conv, msgs in zip(group, history):
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()
        result.append(Conversation(conv.id, msgs))
    return result
