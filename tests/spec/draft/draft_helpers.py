"""Draft models for the draft-family tests (test_draft_models_forward.py, test_draft_models_checkpoints.py): the
tiny 4-layer target, the families' random checkpoints, and a paged KV pool for a draft."""
import pytest
import torch

from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.config import ModelConfig
from specpd.spec.draft.loader import load_draft_model, random_draft_checkpoint
from specpd.kv.pool import KVPool
from specpd.model.llama import CausalLM
from tests.model.hf_models import tiny_config

AUX = [1, 2, 3]  # EAGLE-3 aux layer inputs for the 4-layer tiny target (defaults need >= 6 layers)

FAMILIES = {  # id -> (algorithm, config overrides, draft step)
    "eagle": ("eagle", {}, 0),
    "eagle3": ("eagle3", {"eagle_aux_hidden_state_layer_ids": AUX}, 0),
    "eagle3-reduced": ("eagle3", {"eagle_aux_hidden_state_layer_ids": AUX, "draft_vocab_size": 96}, 0),
    # target_hidden_size configs: a narrower draft with its own embedding
    "eagle3-narrow": ("eagle3", {"eagle_aux_hidden_state_layer_ids": AUX, "hidden_size": 32, "intermediate_size": 64,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}, 0),
    "mtp": ("mtp", {}, 0),
    "mtp2-step1": ("mtp", {"num_nextn_predict_layers": 2}, 1),
}


def target_config(arch="llama"):
    return ModelConfig.from_hf(tiny_config(arch, num_hidden_layers=4).to_dict())


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return CausalLM(target_config(), max_positions=128).eval()


def make_draft(tmp_path, target, family):
    algorithm, overrides, step = FAMILIES[family]
    overrides = dict(overrides)
    dv = overrides.pop("draft_vocab_size", None)
    random_draft_checkpoint(str(tmp_path), algorithm, target.config, seed=1, draft_vocab_size=dv, **overrides)
    return load_draft_model(str(tmp_path), algorithm, target, target.config), step


def draft_attention(draft, num_pages=32, page_size=4):
    pool = KVPool.for_model(draft.config, page_size, torch.float32, num_pages=num_pages)
    return pool, TorchAttentionBackend(pool, draft.config.num_heads, draft.config.head_dim)
