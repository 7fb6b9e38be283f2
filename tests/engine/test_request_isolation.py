"""One request's own parameters or data fail that request alone (specpd.core.RequestFaults): its batch-mates finish
with the tokens they get without it, every page comes back, and the engine serves the next request. Plain decoding,
a speculative tree and a PD decode server alike. A step that fails with no request to blame fails its batch only;
one that keeps failing stops the engine.

The bad request is one the server's validation would refuse (a seed past 64 bits, a logit_bias token outside the
vocabulary), let through by skipping `validate_request` for it alone: what a validation gap would let in."""
import pytest

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import MAX_FAILED_STEPS, LLMEngine

PROMPTS = [[5, 17, 99, 3], list(range(40, 77)), [7, 8, 9], list(range(100, 113))]  # 37: across page boundaries
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
BAD = {"seed past 64 bits": SamplingParams(max_tokens=12, temperature=1.0, seed=2 ** 64, ignore_eos=True),
       "logit_bias outside the vocabulary": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                           logit_bias=((10 ** 6, 5.0),))}
WHERE = {"seed past 64 bits": "seeding its generator", "logit_bias outside the vocabulary": "sampling"}
NUM_PAGES = 128


@pytest.fixture
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture
def eagle3_dir(tiny_eagle3_dir):
    return tiny_eagle3_dir


def _engine(model_dir, spec=None):
    return LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(page_size=4, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(chunked_prefill_size=16), spec=spec or SpecConfig()))


def _let_through(monkeypatch, engine, request_id: str) -> None:
    """Skip the engine's validation for `request_id` alone."""
    check = engine.validate_request
    monkeypatch.setattr(engine, "validate_request",
                        lambda rid, prompt, params: None if rid == request_id else check(rid, prompt, params))


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _good(prompts=PROMPTS) -> dict:
    return {f"ok{i}": (p, GREEDY if i % 2 == 0 else SEEDED) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("spec", ["plain", "eagle3 tree"])
def test_a_failing_request_fails_alone(model_dir, eagle3_dir, monkeypatch, spec, bad):
    # a fixed tree: the adaptive policy's depths follow measured step times, which a loaded box changes
    config = None if spec == "plain" else SpecConfig("eagle3", draft_model=eagle3_dir, spec_num_steps=3, spec_topk=2,
                                                     spec_num_draft_tokens=6, spec_adaptive=False)
    engine = _engine(model_dir, config)
    expected = _run(engine, _good())
    _let_through(monkeypatch, engine, "bad")
    got = _run(engine, {**_good(), "bad": (list(range(60, 90)), BAD[bad])})
    assert got["bad"].finish_reason == "abort" and WHERE[bad] in got["bad"].error
    # a seeded request's speculative tokens move with its batch's make-up, bad request or not (the draft's q over
    # a different row count; lossless in distribution): under a tree its batch-mates are held to finishing whole
    exact = [rid for rid in expected if spec == "plain" or _good()[rid][1] is GREEDY]
    assert {rid: got[rid].token_ids for rid in exact} == {rid: expected[rid].token_ids for rid in exact}
    assert all(len(got[rid].token_ids) == len(expected[rid].token_ids) for rid in expected)
    assert all(o.error is None for rid, o in got.items() if rid != "bad")
    assert engine.free_pages == NUM_PAGES
    again = _run(engine, {"after": (PROMPTS[0], GREEDY)})  # the engine serves on
    assert again["after"].token_ids == expected["ok0"].token_ids
    assert engine.free_pages == NUM_PAGES


def test_a_failing_request_on_a_decode_server_fails_alone(model_dir, monkeypatch):
    """PD: the bad request reaches D's running batch (P sampled its y0 with clean params); its batch-mates on D
    finish with the unified engine's tokens, and P's and D's pages come back."""
    from tests.disagg.handoff_helpers import make_workers, run_unified
    from specpd.disagg.worker import BootstrapInfo
    reference = run_unified(_engine(model_dir), PROMPTS, GREEDY)
    p, d = make_workers(model_dir, page_size=4)
    try:
        _let_through(monkeypatch, d.engine, "dbad")
        bad_params = BAD["logit_bias outside the vocabulary"]
        jobs = [(f"{i}", prompt, GREEDY, GREEDY) for i, prompt in enumerate(PROMPTS)] + [
            ("bad", list(range(60, 90)), GREEDY, bad_params)]
        for room, (name, prompt, p_params, d_params) in enumerate(jobs, start=500):
            info = BootstrapInfo("127.0.0.1", p.bootstrap.port, room)
            p.expect(f"p{name}", info)
            p.add_request(f"p{name}", prompt, p_params)
            d.bootstrap(f"d{name}", info)
            d.add_request(f"d{name}", prompt, d_params)
        final = {}
        while p.has_unfinished_requests() or d.has_unfinished_requests():
            for worker in (p, d):
                for out in worker.step():
                    if out.finished:
                        final[out.request_id] = out
        assert final["dbad"].finish_reason == "abort" and "sampling" in final["dbad"].error
        assert [final[f"d{i}"].token_ids for i in range(len(PROMPTS))] == [r.token_ids for r in reference]
        assert all(final[f"d{i}"].error is None for i in range(len(PROMPTS)))
        assert p.engine.free_pages == p.engine.total_pages and d.engine.free_pages == d.engine.total_pages
    finally:
        p.close()
        d.close()


def test_a_step_failing_with_no_request_to_blame_fails_its_batch_and_a_persistent_one_stops_the_engine(
        model_dir, monkeypatch):
    engine = _engine(model_dir)
    expected = _run(engine, _good())
    forward = engine.runner.model.forward
    fail = {"left": 1}

    def flaky(*args, **kwargs):
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("injected")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", flaky)
    got = _run(engine, _good())
    failed = {rid for rid, o in got.items() if o.error is not None}
    assert failed and all(got[rid].finish_reason == "abort" and "engine step" in got[rid].error for rid in failed)
    assert all(got[rid].token_ids == expected[rid].token_ids for rid in got if rid not in failed)
    assert engine.free_pages == NUM_PAGES
    after = _run(engine, _good())  # contained: the next requests are served as before
    assert {rid: o.token_ids for rid, o in after.items()} == {rid: o.token_ids for rid, o in expected.items()}
    fail["left"] = 10 ** 9  # the engine is broken: MAX_FAILED_STEPS failed steps in a row end it
    with pytest.raises(RuntimeError, match="injected"):
        for i in range(MAX_FAILED_STEPS):
            assert _run(engine, {f"x{i}": (PROMPTS[0], GREEDY)})[f"x{i}"].error is not None
