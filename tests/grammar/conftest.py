import pytest

from specpd.config import ModelConfig
from specpd.model.loader import load_checkpoint


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
