"""Tiny random targets and heads shared by the engine tests that need one of each (built once per session)."""
import pytest

from specpd.config import ModelConfig
from specpd.spec.draft.loader import random_draft_checkpoint
from tests.model.hf_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama8")
    save_tiny_model("llama", path, num_hidden_layers=8)  # EAGLE-3 fuses layers 2, 4, 5
    return str(path)


@pytest.fixture(scope="session")
def tiny_eagle3_dir(tiny_llama_dir, tmp_path_factory):
    from specpd.model.loader import load_checkpoint
    path = tmp_path_factory.mktemp("tiny_eagle3")
    random_draft_checkpoint(str(path), "eagle3", ModelConfig.from_hf(load_checkpoint(tiny_llama_dir).hf_config), seed=0)
    return str(path)
