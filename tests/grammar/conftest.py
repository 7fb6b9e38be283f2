import pytest

from specpd.config import CacheConfig, EngineConfig, ModelConfig
from specpd.model.loader import load_checkpoint
from tests.grammar.cases import CASES, NUM_PAGES


@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct), loaded once for every grammar test."""
    return load_checkpoint("default")


@pytest.fixture(scope="session")
def backend(smollm2):
    from specpd.grammar.backend import GrammarBackend
    cfg = ModelConfig.from_hf(smollm2.hf_config)
    eos = tuple(sorted(set(cfg.eos_token_ids) | set(smollm2.tokenizer.eos_token_ids)))
    return GrammarBackend(smollm2.tokenizer, cfg.vocab_size, eos)


@pytest.fixture(scope="session")
def prompts(smollm2):
    """CASES' questions as chat prompts (token ids)."""
    tok = smollm2.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q, _, _ in CASES]


@pytest.fixture(scope="session")
def plain(smollm2):
    """The unified engine without speculation."""
    from specpd.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=NUM_PAGES)),
                     checkpoint=smollm2)


@pytest.fixture(scope="session")
def reference(plain, prompts):
    """CASES through the unified engine without speculation, as one batch: the outputs every speculative,
    PD and cluster run must reproduce token for token where greedy."""
    outs = plain.generate(prompts, [p for _, p, _ in CASES])
    assert plain.free_pages == NUM_PAGES
    return outs
