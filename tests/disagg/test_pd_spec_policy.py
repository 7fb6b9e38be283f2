"""PD over real processes with the drafters of «speculation that pays»: ngram (lives on D only; P runs no
draft) and adaptive EAGLE-3 in both draft modes, as hybrid (its default) and the head alone. Outputs always
equal the unified engine's; with the policy pinned (fixed cost table, no engine-wide learning) and the
n-gram store off, D's acceptance counts equal unified's request by request; free pages return to totals."""
import httpx
import pytest

from specpd.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.spec.draft.loader import random_draft_checkpoint
from specpd.engine.llm_engine import LLMEngine
from specpd.model.loader import load_checkpoint
from specpd.server.launch import free_port
from tests.disagg.test_pd_e2e import servers, wait_free_pages
from tests.model.hf_models import save_tiny_model

PROMPTS = [[5, 17, 99, 3, 5, 17, 99, 3, 8], list(range(40, 61)) * 2, list(range(1, 33))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_pd_policy")
    save_tiny_model("llama", path, num_hidden_layers=8)
    return str(path)


@pytest.fixture(scope="module")
def eagle3_dir(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3_random")
    random_draft_checkpoint(str(path), "eagle3", ModelConfig.from_hf(load_checkpoint(model_dir).hf_config), seed=2)
    return str(path)


def unified(model_dir, spec: SpecConfig):
    """One request at a time, as the client below sends them: a plan depends on the batch it is made for."""
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=128), spec=spec))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [engine.generate([p], params)[0] for p in PROMPTS]
    assert engine.free_pages == engine.total_pages
    return [(o.token_ids, o.spec_verify_count, o.spec_accepted_tokens) for o in outs]


CASES = [  # (name, spec flags, SpecConfig kwargs, pinned)
    ("ngram", ["--speculative-algorithm", "ngram", "--spec-ngram-min-match", "1", "--spec-ngram-store-tokens", "0",
               "--spec-adaptive-pinned"],
     dict(speculative_algorithm="ngram", spec_ngram_min_match=1, spec_ngram_store_tokens=0, spec_adaptive_pinned=True),
     True),
    ("ngram-adaptive", ["--speculative-algorithm", "ngram", "--spec-ngram-min-match", "1"],
     dict(speculative_algorithm="ngram", spec_ngram_min_match=1), False),
    # EAGLE-3 as shipped merges n-grams into the head's tree (hybrid, on D only), here with the store off
    ("eagle3-hybrid-both", ["--speculative-algorithm", "eagle3", "--spec-num-steps", "3", "--spec-topk", "2",
                            "--spec-num-draft-tokens", "5", "--draft-mode", "both", "--spec-adaptive-pinned",
                            "--spec-ngram-min-match", "1", "--spec-ngram-store-tokens", "0"],
     dict(speculative_algorithm="eagle3", spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=5,
          draft_mode="both", spec_adaptive_pinned=True, spec_ngram_min_match=1, spec_ngram_store_tokens=0), True),
    ("eagle3-head-alone-decode-only", ["--speculative-algorithm", "eagle3", "--spec-num-steps", "3", "--draft-mode",
                                       "decode-only", "--spec-adaptive-pinned", "--no-spec-ngram"],
     dict(speculative_algorithm="eagle3", spec_num_steps=3, draft_mode="decode-only", spec_adaptive_pinned=True,
          spec_ngram=False), True),
]


@pytest.mark.parametrize("name,flags,kwargs,pinned", CASES, ids=[c[0] for c in CASES])
def test_pd_with_adaptive_and_ngram_matches_unified(model_dir, eagle3_dir, name, flags, kwargs, pinned):
    draft = ["--draft-model", eagle3_dir] if kwargs["speculative_algorithm"] == "eagle3" else []
    spec = SpecConfig(**kwargs, **({"draft_model": eagle3_dir} if draft else {}))
    want = unified(model_dir, spec)
    boot = free_port()
    engine = ["--model", model_dir, "--page-size", "4", "--num-pages", "128", "--num-threads", "1", *flags, *draft]
    with servers([["--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port", str(boot), *engine],
                  ["--role", "decode", "--transfer-backend", "tcp", *engine]]) as (p_url, d_url):
        with servers([["--role", "router", "--prefill", p_url, "--decode", d_url,
                       "--bootstrap-port", str(boot)]]) as (router,):
            with httpx.Client(base_url=router, timeout=120) as client:
                for prompt, (tokens, verifies, accepted) in zip(PROMPTS, want):
                    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                "temperature": 0, "ignore_eos": True, "logprobs": 0})
                    assert resp.status_code == 200, resp.text
                    body = resp.json()
                    got = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
                    assert got == tokens
                    if pinned:
                        assert (body["usage"]["spec_verify_count"], body["usage"]["spec_accepted_tokens"]) == \
                            (verifies, accepted)
            p_info = httpx.get(p_url + "/server_info").json()
            if kwargs["speculative_algorithm"] == "ngram":  # model-free: P holds no draft layers in its pages
                assert p_info.get("spec_verify_count") in (None, 0)
            for base in (p_url, d_url):
                info = wait_free_pages(base)
                assert info["free_pages"] == info["total_pages"], (base, info)
    if name.startswith("ngram") and pinned:
        assert sum(a for _, _, a in want) > 0  # the tiny model loops: n-grams were accepted
