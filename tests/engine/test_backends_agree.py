"""The triton backend (under TRITON_INTERPRET on CPU) serves the same greedy tokens as the torch backend."""
import pytest

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), [7]]


@pytest.mark.triton_interpreter
def test_triton_backend_matches_torch(tmp_path):
    save_tiny_model("qwen3", tmp_path)
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), attention_backend=backend,
                                        cache=CacheConfig(page_size=4, num_pages=64),
                                        scheduler=SchedulerConfig(chunked_prefill_size=8)))
        res = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        outs[backend] = [o.token_ids for o in res]
        assert engine.free_pages == 64
    assert outs["triton"] == outs["torch"]
