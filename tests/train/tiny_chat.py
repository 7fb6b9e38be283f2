"""A tiny chat setup for draft-training tests: a byte-level tokenizer with ChatML markers saved next
to a tiny random target (tests/model/hf_models.py), and synthetic ShareGPT-style records."""
from __future__ import annotations

import json
import os
import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from specpd.model.tokenizer import _bytes_to_unicode
from tests.model.hf_models import save_tiny_model

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ("<|im_start|>", "<|im_end|>")  # ids 256, 257: inside the tiny target's 320-token vocab


def save_byte_tokenizer(path) -> None:
    """Byte-level BPE without merges: one token per byte, plus the two ChatML markers."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
                   "added_tokens_decoder": {str(256 + i): {"content": s, "special": True}
                                            for i, s in enumerate(SPECIAL)}}, f)


def save_tiny_chat_model(path, arch: str = "llama") -> str:
    save_tiny_model(arch, path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    save_byte_tokenizer(path)
    return str(path)


WORDS = "the a draft target token model fast slow cache page tree verify accept reject bonus".split()


def sharegpt_records(n: int, seed: int = 0) -> list[dict]:
    """n ShareGPT-style conversations of 1-2 exchanges, ids conv-0 .. conv-{n-1}."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    records = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns += [{"from": "human", "value": text(rng.randint(2, 5))},
                      {"from": "gpt", "value": text(rng.randint(4, 9))}]
        records.append({"id": f"conv-{i}", "conversations": turns})
    return records


def write_jsonl(path, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)
