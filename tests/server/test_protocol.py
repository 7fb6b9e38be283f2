"""Request parsing, sampling-param conversion and response shapes: pure functions, no model."""
import json

import pytest
from pydantic import ValidationError

from specpd.core import InvalidRequest, RequestOutput, TokenLogprob
from specpd.server.protocol import ChatCompletionRequest, CompletionRequest, check_common, field_errors
from specpd.server.responses import SSE_DONE, ChatFormatter, CompletionFormatter, merged_usage, sse


def _parse_error(model, body) -> InvalidRequest:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(body if isinstance(body, str) else json.dumps(body))
    return field_errors(info.value)


@pytest.mark.parametrize("body, field", [
    ('{"prompt": ', "body"),
    ("", "body"),
    ("[1, 2]", "body"),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids[0]"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "maybe"}},
     "stream_options.include_usage"),
])
def test_schema_errors_name_the_field(body, field):
    err = _parse_error(CompletionRequest, body)
    assert err.field == field
    assert str(err).startswith(field)


def test_chat_schema_errors_name_the_field():
    assert _parse_error(ChatCompletionRequest, {"messages": [{"content": "hi"}]}).field == "messages[0].role"
    assert _parse_error(ChatCompletionRequest, {"messages": "hi"}).field == "messages"
    assert _parse_error(ChatCompletionRequest, {"prompt": "hi"}).field == "messages"


def test_completion_sampling_params_defaults_and_extensions():
    req = CompletionRequest.model_validate({"prompt": "hi"})
    p = req.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.logprobs, p.stop) == (16, 1.0, 1.0, None, ())
    req = CompletionRequest.model_validate({
        "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 3,
        "logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
        "presence_penalty": -0.5, "stop_token_ids": [2], "ignore_eos": True, "min_tokens": 2,
        "skip_special_tokens": False, "temperature_extra": "ignored"})
    p = req.to_sampling_params()
    assert req.single_prompt() == [1, 2, 3]
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.logprobs, p.top_k) == (7, 0, 0.5, ("\n",), 3, 2, 5)
    assert (p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (0.1, 1.2, 0.5, -0.5)
    assert (p.stop_token_ids, p.ignore_eos, p.min_tokens, p.skip_special_tokens) == ((2,), True, 2, False)


def test_explicit_nulls_mean_defaults():
    req = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": None, "temperature": None, "n": None,
                                            "stop": None, "stream": None, "logprobs": None})
    check_common(req, ("m",))
    assert req.to_sampling_params().max_tokens == 16


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "top_k": -4}, "top_k"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed"),  # what torch.Generator takes: [-2^63, 2^64 - 1]
    ({"prompt": "x", "seed": -2 ** 63 - 1}, "seed"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "NaN"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "-Infinity"}}, "logit_bias"),
])
def test_bad_sampling_values(body, field):
    with pytest.raises(InvalidRequest) as info:
        CompletionRequest.model_validate(body).to_sampling_params()
    assert info.value.field == field


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_server_rules(body, field):
    with pytest.raises(InvalidRequest) as info:
        check_common(CompletionRequest.model_validate(body), ("served",))
    assert info.value.field == field


def test_model_may_be_absent_or_any_served_name():
    for model in (None, "served", "alias"):
        check_common(CompletionRequest.model_validate({"prompt": "x", "model": model, "n": 128}), ("served", "alias"))


def test_seed_and_logit_bias_edges_are_accepted():
    for seed in (2 ** 64 - 1, -2 ** 63, 0, -1):
        assert CompletionRequest.model_validate({"prompt": "x", "seed": seed}).to_sampling_params().seed == seed
    p = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": -100, "3": 100, "07": 2.5}}
                                         ).to_sampling_params()
    assert p.logit_bias == ((3, 100.0), (7, 2.5)) and p.adjusts_logits


def test_unknown_chat_roles_are_refused():
    for role in ("system", "developer", "user", "assistant", "tool", "function"):
        ChatCompletionRequest.model_validate({"messages": [{"role": role, "content": "hi"}]}).template_messages()
    with pytest.raises(InvalidRequest) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "wizard", "content": "hi"}]}).template_messages()
    assert info.value.field == "messages[1].role" and "wizard" in info.value.message


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", "b"], [[1], [2]]])
def test_bad_prompts(prompt):
    with pytest.raises(InvalidRequest) as info:
        CompletionRequest.model_validate({"prompt": prompt}).single_prompt()
    assert info.value.field == "prompt"


def test_single_element_batch_is_unwrapped():
    assert CompletionRequest.model_validate({"prompt": ["hi"]}).single_prompt() == "hi"
    assert CompletionRequest.model_validate({"prompt": [[4, 5]]}).single_prompt() == [4, 5]


def test_chat_params():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert req.to_sampling_params(default_max_tokens=100).max_tokens == 100
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": 5, "max_tokens": 9,
                                                "logprobs": True, "top_logprobs": 3})
    p = req.to_sampling_params(default_max_tokens=100)
    assert (p.max_tokens, p.logprobs) == (5, 3)
    bad = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": 0})
    with pytest.raises(InvalidRequest) as info:
        bad.to_sampling_params(default_max_tokens=100)
    assert info.value.field == "max_completion_tokens"
    no_lp = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                  "top_logprobs": 2})
    with pytest.raises(InvalidRequest) as info:
        no_lp.to_sampling_params(default_max_tokens=100)
    assert info.value.field == "top_logprobs"


def test_chat_messages_text_parts_joined_others_rejected():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.template_messages() == [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]
    img = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(InvalidRequest) as info:
        img.template_messages()
    assert info.value.field == "messages[0].content"
    with pytest.raises(InvalidRequest) as info:
        ChatCompletionRequest.model_validate({"messages": []}).template_messages()
    assert info.value.field == "messages"


# -- response shapes -------------------------------------------------------------------------
def _outputs():
    lp = lambda t: TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5), (t + 2, float("-inf"))])
    return [RequestOutput("r", [10], "ab", [10], "ab", False, None, 3, [lp(10)]),
            RequestOutput("r", [11, 12], "c", [10, 11, 12], "abc", True, "stop", 3, [lp(11), lp(12)], "\n")]


def _tok(t: int) -> str:
    return f"<{t}>"


def test_completion_response_and_chunks():
    outs = _outputs()
    body = CompletionFormatter("cmpl-1", "m", _tok, 1).response(outs)
    choice = body["choices"][0]
    assert (body["object"], body["model"], choice["text"], choice["finish_reason"]) == ("text_completion", "m", "abc", "stop")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    lps = choice["logprobs"]
    assert lps["tokens"] == ["<10>", "<11>", "<12>"] and lps["text_offset"] == [0, 4, 8]
    assert lps["top_logprobs"][0] == {"<10>": -0.5}
    fmt = CompletionFormatter("cmpl-1", "m", _tok, None, include_usage=True)
    chunks = [c for o in outs for c in fmt.chunks(o)]
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", "c"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert all(c["usage"] is None for c in chunks) and chunks[0]["choices"][0]["logprobs"] is None
    assert fmt.usage_chunk([outs[-1]])["choices"] == []


def test_a_speculating_servers_usage_always_carries_the_acceptance_fields():
    """A request the adaptive policy served in plain steps only (or one its first token ended): 0 verifies, tau
    null, not no fields (a client measuring tau sees why); with verifies, the counts."""
    outs = _outputs()
    assert CompletionFormatter("c", "m", _tok, None, speculative=True).response(outs)["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0},
        "spec_verify_count": 0, "spec_accepted_tokens": 0, "spec_accept_length": None}
    assert ChatFormatter("c", "m", _tok, None, True, speculative=True).usage_chunk([outs[-1]])["usage"][
        "spec_accept_length"] is None
    outs[-1].spec_verify_count, outs[-1].spec_accepted_tokens, outs[-1].spec_committed_tokens = 2, 1, 3
    usage = ChatFormatter("c", "m", _tok, None, speculative=True).response(outs)["usage"]
    assert (usage["spec_verify_count"], usage["spec_accepted_tokens"], usage["spec_accept_length"]) == (2, 1, 1.5)


def test_chat_response_and_chunks():
    outs = _outputs()
    body = ChatFormatter("chatcmpl-1", "m", _tok, 2).response(outs)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "abc"}
    content = choice["logprobs"]["content"]
    assert len(content) == 3 and content[0]["token"] == "<10>" and content[0]["bytes"] == list(b"<10>")
    assert [e["logprob"] for e in content[0]["top_logprobs"]] == [-0.5, -1.5]
    fmt = ChatFormatter("chatcmpl-1", "m", _tok, None)
    chunks = [c for o in outs for c in fmt.chunks(o)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "ab"}, {"content": "c"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]


def test_infinite_logprob_is_json_safe():
    fmt = ChatFormatter("chatcmpl-1", "m", _tok, 3)
    text = "".join(sse(c) for o in _outputs() for c in fmt.chunks(o)) + SSE_DONE
    assert "Infinity" not in text and "-9999.0" in text
    for line in text.split("\n\n")[:-2]:
        json.loads(line.removeprefix("data: "))


def test_parallel_samples_format_as_choices_of_one_response():
    """n > 1: one formatter per sample writes its choice index; usage counts the prompt once and sums the rest."""
    outs = _outputs()
    assert ChatFormatter("c", "m", _tok, None, index=2).response(outs)["choices"][0]["index"] == 2
    assert CompletionFormatter("c", "m", _tok, None, index=1).chunks(outs[0])[0]["choices"][0]["index"] == 1
    second = _outputs()
    second[-1].spec_verify_count, second[-1].spec_committed_tokens = 2, 3
    usage = merged_usage([outs[-1], second[-1]], speculative=True)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 6, 9)
    assert (usage["spec_verify_count"], usage["spec_accept_length"]) == (2, 1.5)

