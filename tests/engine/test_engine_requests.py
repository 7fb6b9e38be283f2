"""Engine behaviour on the real default model: stops, seeds, logprobs, aborts, validation, page accounting."""
import pytest

from specpd.config import CacheConfig, EngineConfig, SchedulerConfig
from specpd.core import InvalidRequest, SamplingParams
from specpd.engine.llm_engine import LLMEngine

NUM_PAGES = 96


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="default", cache=CacheConfig(page_size=16, num_pages=NUM_PAGES),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256, chunked_prefill_size=64)))


@pytest.fixture(autouse=True)
def no_leaks(engine):
    yield
    assert not engine.has_unfinished_requests()
    assert engine.free_pages == NUM_PAGES


def chat(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def run(engine, prompt, **kw):
    return engine.generate([prompt], SamplingParams(**kw))[0]


def test_eos_stops_and_is_not_rendered(engine):
    out = run(engine, chat(engine, "What is the capital of France?"), max_tokens=64, temperature=0.0)
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.eos_token_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_min_tokens_suppresses_eos(engine):
    prompt = chat(engine, "What is the capital of France?")
    short = run(engine, prompt, max_tokens=64, temperature=0.0)
    out = run(engine, prompt, max_tokens=64, temperature=0.0, min_tokens=len(short.token_ids) + 5)
    assert len(out.token_ids) >= len(short.token_ids) + 5
    assert not set(out.token_ids[:len(short.token_ids) + 4]) & set(engine.eos_token_ids)


def test_max_tokens_is_exact(engine):
    out = run(engine, chat(engine, "Tell me a long story."), max_tokens=7, temperature=0.0, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_stop_token_id(engine):
    prompt = chat(engine, "Count from one to twenty in words.")
    ref = run(engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True).token_ids
    stop_tok = ref[6]
    first = ref.index(stop_tok)
    out = run(engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,))
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_stop_string_truncates_text(engine):
    prompt = chat(engine, "Count from one to twenty in words.")
    ref = run(engine, prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    words = ref.text.split()
    stop = words[len(words) // 2]
    cut = ref.text.index(stop)
    out = run(engine, prompt, max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:cut]
    assert len(out.token_ids) < len(ref.token_ids)


def test_streamed_deltas_add_up_to_text(engine):
    prompt = chat(engine, "Count from one to twenty in words.")
    engine.add_request("stream", prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=("ten",)))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert "".join(pieces) == final.text and "ten" not in final.text.lower().split()[-1:]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompt = chat(engine, "Write a haiku about the sea.")
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a = engine.generate([prompt], p)[0].token_ids
    b = engine.generate([prompt], p)[0].token_ids
    other = SamplingParams(max_tokens=16, temperature=1.0, seed=99)
    batched = engine.generate([chat(engine, "Hi"), prompt, prompt], [other, p, other])
    assert a == b == batched[1].token_ids
    assert batched[2].token_ids != a  # a different seed takes a different path


def test_top_k_one_equals_greedy(engine):
    prompt = chat(engine, "Name a fruit.")
    greedy = run(engine, prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
    topk1 = run(engine, prompt, max_tokens=12, temperature=0.8, top_k=1, seed=3, ignore_eos=True).token_ids
    tiny_p = run(engine, prompt, max_tokens=12, temperature=0.8, top_p=1e-6, seed=3, ignore_eos=True).token_ids
    assert greedy == topk1 == tiny_p




def test_logprobs_per_token(engine):
    prompt = chat(engine, "Name a fruit.")
    engine.add_request("lp", prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True))
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.extend(out.new_logprobs or [])
    assert len(got) == 6
    for lp in got:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert lp.logprob <= 0 and abs(lp.logprob - lp.top[0][1]) < 1e-6
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_repetition_penalty_changes_greedy_output(engine):
    prompt = chat(engine, "Repeat the word hello ten times.")
    plain = run(engine, prompt, max_tokens=20, temperature=0.0, ignore_eos=True).token_ids
    penal = run(engine, prompt, max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.8).token_ids
    assert plain != penal
    assert len(set(penal)) >= len(set(plain))


def test_abort_frees_pages(engine):
    engine.add_request("long", chat(engine, "Tell me a story."), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.free_pages < NUM_PAGES
    engine.abort_request("long")
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == "long"] == ["abort"]


@pytest.mark.parametrize("kw,field", [
    (dict(prompt=[], max_tokens=4), "prompt"),
    (dict(prompt=[10**9], max_tokens=4), "prompt"),
    (dict(prompt=[1] * 10, max_tokens=9000), "max_tokens"),
    (dict(prompt=[1] * 10, max_tokens=0), "max_tokens"),
    (dict(prompt=[1] * 10, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(prompt=[1] * 10, max_tokens=4, top_p=0.0), "top_p"),
    (dict(prompt=[1] * 10, max_tokens=2000), "max_tokens"),  # over the KV pool's capacity
])
def test_bad_requests_name_the_field(engine, kw, field):
    prompt = kw.pop("prompt")
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", prompt, SamplingParams(**kw))
    assert err.value.field == field
    assert field in str(err.value)
