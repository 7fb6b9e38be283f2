"""The EAGLE-3 head shipped for the default model (specpd/draft/heads/): `--draft-model default` finds it,
the engine with it is lossless, and it is trained (a random head accepts ~nothing)."""
import os

import pytest

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.draft.loader import HEADS_DIR, read_draft_config, resolve_draft_path, shipped_heads
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint

PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."


def test_default_resolves_to_the_shipped_head_and_names_what_ships():
    assert "eagle3" in shipped_heads()
    path = resolve_draft_path("default", "eagle3")
    assert path.startswith(HEADS_DIR) and os.path.getsize(os.path.join(path, "model.safetensors")) <= 25 << 20
    assert read_draft_config(path)["draft_vocab_size"] == 8192
    with pytest.raises(ValueError, match=r"ships no eagle head for the default model \(shipped: \['eagle3'"):
        resolve_draft_path("default", "eagle")
    assert resolve_draft_path("/some/dir", "eagle") == "/some/dir"


def test_the_shipped_head_is_lossless_and_accepts():
    ckpt = load_checkpoint("default")
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = ckpt.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    cache = CacheConfig(page_size=16, num_pages=64)
    base = LLMEngine(EngineConfig(model="default", cache=cache), checkpoint=ckpt).generate([prompt], params)[0]
    spec = LLMEngine(EngineConfig(model="default", cache=cache, spec=SpecConfig(
        "eagle3", draft_model="default", spec_num_steps=4)), checkpoint=ckpt)
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == base.token_ids
    assert out.spec_accept_length >= 1.15, out.spec_accept_length  # random draft heads: 1.0 (measured 1.27)
    assert spec.free_pages == spec.total_pages
