"""A DeepSeek-V3-shaped checkpoint (MLA, MoE, its own MTP layer; tiny, random, the MTP layer built to predict its
target: tests/model/moe_models.py) served by real processes on 127.0.0.1: router -> prefill + decode over tcp,
`--speculative-algorithm mtp` with no --draft-model, in both draft modes. Greedy tokens through the router equal the
unified engine's, and with the pinned policy each response's acceptance (verify rounds, accepted tokens) equals the
unified engine's for the same request; P's and D's pages return to their totals."""
import httpx
import pytest

from specpd.config import CacheConfig, EngineConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import servers, wait_free_pages
from tests.model.moe_models import save_tiny_moe

PROMPTS = [[5, 17, 99, 3, 8], list(range(40, 61)), list(range(1, 33))]
MAX_TOKENS = 16
SPEC = ["--speculative-algorithm", "mtp", "--spec-num-steps", "3", "--spec-topk", "2", "--spec-num-draft-tokens", "6",
        "--spec-adaptive-pinned", "--no-spec-ngram"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_deepseek_mtp")
    save_tiny_moe("deepseek", path, seed=1, nextn=1, predictable=0.3)
    return str(path)


@pytest.mark.parametrize("mode", ["both", "decode-only"])
def test_cluster_serves_the_checkpoints_mtp_as_unified(model_dir, mode):
    spec = SpecConfig("mtp", spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6, draft_mode=mode,
                      spec_adaptive_pinned=True, spec_ngram=False)
    unified = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=128), spec=spec))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [unified.generate([p], params)[0] for p in PROMPTS]  # one at a time, as the client sends them
    assert sum(o.spec_accepted_tokens for o in want) > sum(o.spec_verify_count for o in want) / 2
    boot = free_port()
    engine = ["--model", model_dir, "--page-size", "4", "--num-pages", "128", "--num-threads", "1", *SPEC,
              "--draft-mode", mode]
    with servers([["--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port", str(boot), *engine],
                  ["--role", "decode", "--transfer-backend", "tcp", *engine]]) as (p_url, d_url):
        with servers([["--role", "router", "--prefill", p_url, "--decode", d_url,
                       "--bootstrap-port", str(boot)]]) as (router,):
            with httpx.Client(base_url=router, timeout=120) as client:
                for prompt, expected in zip(PROMPTS, want):
                    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                "temperature": 0, "ignore_eos": True, "logprobs": 0})
                    assert resp.status_code == 200, resp.text
                    body = resp.json()
                    got = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
                    assert got == expected.token_ids
                    assert (body["usage"]["spec_verify_count"], body["usage"]["spec_accepted_tokens"]) == \
                        (expected.spec_verify_count, expected.spec_accepted_tokens)
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)
