"""SmolLM2-135M-Instruct from the GGUF: greedy output token-identical to HF transformers (fp32, batch 1)."""
import pytest
import torch

from specpd.config import CacheConfig, EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("default")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = {k: v for k, v in checkpoint.hf_config.items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.generation_config.eos_token_id = None  # compare with ignore_eos: run the full length
    missing, unexpected = model.load_state_dict(checkpoint.weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)  # tied head
    return model


def test_greedy_matches_hf(checkpoint, hf_model):
    engine = LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=64)),
                       checkpoint=checkpoint)
    tok = checkpoint.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for q in QUESTIONS:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
        ours = engine.generate([prompt], params)[0]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert ours.token_ids == ref[0, len(prompt):].tolist(), q
        assert ours.text == tok.decode(ours.token_ids)
    assert engine.free_pages == 64
