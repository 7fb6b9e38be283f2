"""The heads shipped for the default model (specpd/spec/draft/heads/: EAGLE-3 and MTP): `--draft-model default`
finds each, the engine with it is lossless, and it is trained (a random head accepts ~nothing)."""
import os

import pytest

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import HEADS_DIR, read_draft_config, resolve_draft_path, shipped_heads
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint

PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."
FAMILIES = ["eagle3", "mtp"]


def test_default_resolves_to_the_shipped_heads_and_names_what_ships():
    assert shipped_heads() == FAMILIES
    for family in FAMILIES:
        path = resolve_draft_path("default", family)
        assert path.startswith(HEADS_DIR) and os.path.getsize(os.path.join(path, "model.safetensors")) <= 25 << 20
        assert read_draft_config(path)["draft_vocab_size"] == 8192
    with pytest.raises(ValueError, match=r"ships no eagle head for the default model \(shipped: \['eagle3', 'mtp'"):
        resolve_draft_path("default", "eagle")
    assert resolve_draft_path("/some/dir", "eagle") == "/some/dir"


@pytest.fixture(scope="module")
def smollm2():
    ckpt = load_checkpoint("default")
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = ckpt.tokenizer.encode(text, add_special_tokens=False)
    base = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=64)), checkpoint=ckpt)
    return ckpt, prompt, base.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0]


# measured on this prompt (pinned policy): eagle3 1.38 (1.27 with the 700k-token head), mtp 1.24; random heads: 1.0
@pytest.mark.parametrize("family,min_tau", [("eagle3", 1.15), ("mtp", 1.15)])
def test_the_shipped_head_is_lossless_and_accepts(smollm2, family, min_tau):
    ckpt, prompt, base = smollm2
    spec = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=64), spec=SpecConfig(
        family, draft_model="default", spec_num_steps=4, spec_adaptive_pinned=True)), checkpoint=ckpt)
    out = spec.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert out.token_ids == base.token_ids
    assert out.spec_accept_length >= min_tau, out.spec_accept_length
    assert spec.free_pages == spec.total_pages
