"""Draft families load the published key layouts (and their variants), save them back, and name what is wrong
with a bad checkpoint. (Forward passes against a dense oracle: test_draft_models_forward.py.)
"""
import json
import os

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.spec.draft.eagle3 import resolve_aux_layer_ids
from specpd.spec.draft.loader import load_draft_model, random_draft_checkpoint, read_draft_checkpoint, save_draft_model
from tests.spec.draft.draft_helpers import AUX, FAMILIES, draft_attention, make_draft, target, target_config  # noqa: F401

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
         "post_attention_layernorm.weight"]
QKV_BIAS = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
EAGLE1_KEYS = ["fc.weight", "fc.bias"] + [f"layers.0.{k}" for k in LAYER]
EAGLE3_KEYS = (["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
                "midlayer.hidden_norm.weight"] + [f"midlayer.{k}" for k in LAYER])
MTP_KEYS = [f"model.layers.4.{k}" for k in ["enorm.weight", "hnorm.weight", "eh_proj.weight",
                                            "shared_head.norm.weight", "input_layernorm.weight"] + LAYER]
EXTRA = {  # per target arch, what its decoder layer adds
    "llama": [], "qwen2": QKV_BIAS, "qwen3": ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]}


# ---- layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp"])
def test_published_key_set(tmp_path, algorithm, arch):
    cfg = target_config(arch)
    random_draft_checkpoint(str(tmp_path), algorithm, cfg, draft_vocab_size=96 if algorithm == "eagle3" else None,
                            eagle_aux_hidden_state_layer_ids=AUX)
    config, weights = read_draft_checkpoint(str(tmp_path))
    if algorithm == "eagle":  # EAGLE layers are Llama-style; Qwen2 drafts keep q/k/v bias ("qkv_bias")
        expected = EAGLE1_KEYS + ([f"layers.0.{k}" for k in QKV_BIAS] if arch == "qwen2" else [])
    elif algorithm == "eagle3":
        expected = EAGLE3_KEYS + ([f"midlayer.{k}" for k in QKV_BIAS] if arch == "qwen2" else [])
    else:  # the MTP block is of the target's kind
        expected = MTP_KEYS + [f"model.layers.4.{k}" for k in EXTRA[arch]]
    assert sorted(weights) == sorted(expected)
    if algorithm == "eagle3":
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert weights["lm_head.weight"].shape == (96, 64) and weights["t2d"].shape == (320,)
        assert weights["midlayer.self_attn.q_proj.weight"].shape == (cfg.q_size, 128)  # input [emb; hidden] = 2H
        assert weights["fc.weight"].shape == (64, 192)
        assert config["eagle_aux_hidden_state_layer_ids"] == AUX
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: layer outputs
    if algorithm == "mtp":
        assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_load_save_roundtrip(tmp_path, target, family):
    draft, _ = make_draft(tmp_path / "a", target, family)
    _, original = read_draft_checkpoint(str(tmp_path / "a"))
    save_draft_model(draft, str(tmp_path / "b"))
    _, again = read_draft_checkpoint(str(tmp_path / "b"))
    assert sorted(original) == sorted(again)
    assert all(torch.equal(original[k], again[k]) for k in original)


# ---- checkpoint variants and errors -------------------------------------------------------------

def rewrite(path, weights=None, config=None):
    from safetensors.torch import save_file
    if weights is not None:
        save_file(weights, os.path.join(path, "model.safetensors"))
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)


def test_eagle1_pytorch_bin_with_embedding_copy(tmp_path, target):
    draft, _ = make_draft(tmp_path, target, "eagle")
    _, weights = read_draft_checkpoint(str(tmp_path))
    weights["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()  # EAGLE-1 releases carry it
    os.remove(tmp_path / "model.safetensors")
    torch.save(weights, tmp_path / "pytorch_model.bin")
    again = load_draft_model(str(tmp_path), "eagle", target, target.config)
    assert torch.equal(again.fc.weight, draft.fc.weight) and again.embed_tokens is None


def test_mtp_inside_target_checkpoint_and_extracted_nextn(tmp_path, target):
    draft, _ = make_draft(tmp_path, target, "mtp")
    config, weights = read_draft_checkpoint(str(tmp_path))
    h, ids, pos = torch.randn(5, 64), torch.arange(5), torch.arange(5)

    def run(d):
        _, backend = draft_attention(d)
        with torch.no_grad():
            return d(ids, h, pos, backend, backend.plan(AttentionMetadata.build([5], [5], [[1, 2]], 4)))

    expected = run(draft)
    # DeepSeek-V3 style: MTP layers ship inside the target's checkpoint, with embed/head copies
    full = dict(weights, **{"model.embed_tokens.weight": torch.zeros(320, 64), "model.norm.weight": torch.ones(64),
                            "lm_head.weight": torch.zeros(320, 64),
                            "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64),
                            "model.layers.4.embed_tokens.weight": torch.zeros(320, 64),
                            "model.layers.4.shared_head.head.weight": target.lm_head_weight.detach().clone()})
    rewrite(tmp_path, full)
    inside = load_draft_model(str(tmp_path), "mtp", target, target.config)
    assert inside.mtp[0].shared_head.head is not None  # a present head is the module's own
    torch.testing.assert_close(run(inside), expected)
    # SGLang's extracted NextN layout: the module at model.layers.0, num_hidden_layers 1
    rewrite(tmp_path, {k.replace("model.layers.4.", "model.layers.0."): v for k, v in weights.items()},
            dict(config, num_hidden_layers=1))
    extracted = load_draft_model(str(tmp_path), "nextn", target, target.config)
    assert extracted.first_layer_index == 0
    torch.testing.assert_close(run(extracted), expected)


@pytest.mark.parametrize("family,edit,message", [
    ("eagle", lambda w: w.update({"layers.0.self_attn.qkv_proj.weight": torch.zeros(1)}), "unexpected keys.*qkv_proj"),
    ("eagle", lambda w: w.pop("fc.bias"), "missing keys.*'fc.bias'"),
    ("eagle3", lambda w: w.pop("midlayer.hidden_norm.weight"), "missing keys.*hidden_norm"),
    ("eagle3", lambda w: w.update({"lm_head.weight": torch.zeros(320, 64)}),
     r"lm_head.weight has shape \(320, 64\), expected \(96, 64\)"),
    ("eagle3", lambda w: w.update({"d2t": torch.full((96,), 400)}), "d2t maps draft ids outside"),
    ("mtp", lambda w: w.update({"model.layers.4.mlp.experts.0.up_proj.weight": torch.zeros(1)}),
     "unexpected keys.*experts"),
    ("mtp", lambda w: w.update({"model.layers.6.eh_proj.weight": torch.zeros(64, 128)}), "modules at layers"),
])
def test_bad_checkpoints_name_the_keys(tmp_path, target, family, edit, message):
    make_draft(tmp_path, target, family if family != "eagle3" else "eagle3-reduced")
    _, weights = read_draft_checkpoint(str(tmp_path))
    edit(weights)
    rewrite(tmp_path, weights)
    with pytest.raises(ValueError, match=message):
        load_draft_model(str(tmp_path), FAMILIES[family][0], target, target.config)


def test_config_errors(tmp_path, target):
    random_draft_checkpoint(str(tmp_path), "eagle3", target.config, hidden_size=32,
                            eagle_aux_hidden_state_layer_ids=AUX)
    config, weights = read_draft_checkpoint(str(tmp_path))
    assert config["target_hidden_size"] == 64 and weights["fc.weight"].shape == (32, 192)
    del weights["embed_tokens.weight"]
    rewrite(tmp_path, weights)
    with pytest.raises(ValueError, match="must carry its own embed_tokens.weight"):
        load_draft_model(str(tmp_path), "eagle3", target, target.config)
    with pytest.raises(ValueError, match="unknown draft algorithm 'medusa'"):
        random_draft_checkpoint(str(tmp_path), "medusa", target.config)
    with pytest.raises(ValueError, match=r"aux layer ids \[1, 2, 4\].*4-layer target"):
        random_draft_checkpoint(str(tmp_path), "eagle3", target.config, eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match=r"\[2, 2, 1\].*4-layer"):  # defaults (2, L//2, L-3) collide on 4 layers
        random_draft_checkpoint(str(tmp_path), "eagle3", target.config)
    random_draft_checkpoint(str(tmp_path), "eagle", target.config)
    config, _ = read_draft_checkpoint(str(tmp_path))
    rewrite(tmp_path, config=dict(config, vocab_size=1000))
    with pytest.raises(ValueError, match="vocab_size 1000, target has 320"):
        load_draft_model(str(tmp_path), "eagle", target, target.config)


def test_aux_layer_id_conventions():
    assert resolve_aux_layer_ids({}, 30) == (2, 15, 27)  # SmolLM2-135M: reference/SGLang/vLLM default
    assert resolve_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [27, 2, 15]}, 30) == (2, 15, 27)
    # SGLang / SpecForge nest layer OUTPUT ids in eagle_config; SGLang captures them at id + 1
    assert resolve_aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, 30) == (2, 15, 27)
    with pytest.raises(ValueError, match="disagrees"):
        resolve_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [1, 14, 26],
                               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, 30)
