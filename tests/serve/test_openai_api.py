"""Request validation and response shapes (pure functions; the HTTP paths are in test_app.py)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from strata_ray.model.gguf_writer import byte_level_tokenizer_spec
from strata_ray.model.tokenizer import Tokenizer
from strata_ray.serve import openai_api as oa

MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_fields():
    job = oa.parse_chat({"messages": MSG, "max_tokens": 5, "temperature": 0, "top_k": -1, "seed": 3,
                         "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                         "unknown_field": {"ignored": True}})
    assert job.chat and job.max_tokens == 5 and job.stop == ("x",) and job.stream and job.include_usage
    assert job.sampling == oa.Sampling(temperature=0.0, top_k=0, seed=3)
    assert oa.parse_chat({"messages": MSG}).sampling.temperature == 1.0  # OpenAI's default


def test_content_parts_and_max_completion_tokens():
    job = oa.parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}],
                         "max_completion_tokens": 7})
    assert job.messages[0]["content"] == "ab" and job.max_tokens == 7


def test_include_usage_only_when_streaming():
    assert not oa.parse_chat({"messages": MSG, "stream_options": {"include_usage": True}}).include_usage


def test_text_prompts():
    assert oa.parse_text({"prompt": "abc"}).prompt == "abc"
    assert oa.parse_text({"prompt": [1, 2]}).prompt_ids == (1, 2)
    assert oa.parse_text({"prompt": ["abc"]}).prompt == "abc"
    with pytest.raises(oa.APIError) as info:
        oa.parse_text({"prompt": ["a", "b"]})
    assert info.value.param == "prompt"


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_nan_sampling_values_are_refused_naming_the_field(field):
    body = oa.parse_json(b'{"messages": [{"role": "user", "content": "hi"}], "%s": NaN}' % field.encode())
    with pytest.raises(oa.APIError) as info:
        oa.parse_chat(body)
    assert (info.value.status, info.value.param, info.value.code) == (400, field, "invalid_value")


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe", b"null", b"3"])
def test_bad_json(raw):
    with pytest.raises(oa.APIError) as info:
        oa.parse_json(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_spec(**asdict(byte_level_tokenizer_spec()))


def test_prompt_ids_chat_and_context(tok):
    job = oa.parse_chat({"messages": MSG})
    ids = oa.prompt_ids(job, tok, add_bos=False, context=100)
    assert ids == tok.encode(tok.apply_chat_template(MSG))
    with pytest.raises(oa.APIError) as info:
        oa.prompt_ids(job, tok, add_bos=False, context=len(ids))
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(oa.APIError) as info:
        oa.prompt_ids(oa.parse_text({"prompt": ""}), tok, add_bos=False, context=100)
    assert "empty" in info.value.message


def test_chat_template_kwargs_reach_the_template():
    spec = byte_level_tokenizer_spec(chat_template="{{ greeting }}{% for m in messages %}{{ m.content }}"
                                     "{% endfor %}")
    tok = Tokenizer.from_spec(**asdict(spec))
    job = oa.parse_chat({"messages": MSG, "chat_template_kwargs": {"greeting": "hey "}})
    assert tok.decode(oa.prompt_ids(job, tok, add_bos=False, context=100)) == "hey hi"


def test_chat_template_kwargs_may_turn_the_generation_prompt_off():
    spec = byte_level_tokenizer_spec(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
                                     "{% if add_generation_prompt %}>{% endif %}")
    tok = Tokenizer.from_spec(**asdict(spec))
    text = [tok.decode(oa.prompt_ids(oa.parse_chat({"messages": MSG, **extra}), tok, add_bos=False,
                                     context=100))
            for extra in ({}, {"chat_template_kwargs": {"add_generation_prompt": False}})]
    assert text == ["hi>", "hi"]


@pytest.mark.parametrize("kwargs, param, code", [
    ({"add_generation_prompt": "no"}, "chat_template_kwargs.add_generation_prompt", "invalid_type"),
    ({"messages": 1}, "chat_template_kwargs.messages", "invalid_value"),
])
def test_chat_template_kwargs_that_clash_with_the_request_are_refused(kwargs, param, code):
    with pytest.raises(oa.APIError) as info:
        oa.parse_chat({"messages": MSG, "chat_template_kwargs": kwargs})
    assert (info.value.param, info.value.code) == (param, code)


def test_response_shapes():
    doc = oa.response(True, "chatcmpl-1", "m", "hello", "stop", 3, 2)
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    first = oa.chunk(True, "chatcmpl-1", "m", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert oa.chunk(False, "cmpl-1", "m", "x")["choices"][0]["text"] == "x"
    assert oa.sse("[DONE]") == "data: [DONE]\n\n"
    assert oa.usage_chunk(True, "c", "m", 1, 1)["choices"] == []


@pytest.mark.parametrize("extra, param, code", [
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "invalid_value"),
    ({"response_format": {"type": "json_object"}}, "response_format", "invalid_value"),
    ({"presence_penalty": 0.5}, "presence_penalty", "invalid_value"),
    ({"presence_penalty": "abc"}, "presence_penalty", "invalid_type"),
    ({"frequency_penalty": -1}, "frequency_penalty", "invalid_value"),
    ({"repetition_penalty": 1.1}, "repetition_penalty", "invalid_value"),
    ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage", "invalid_type"),
    ({"presence_penalty": 1e10}, "presence_penalty", "invalid_value"),
    ({"repeat_penalty": 1.1}, "repeat_penalty", "invalid_value"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "invalid_value"),
    ({"functions": [{"name": "f"}]}, "functions", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"echo": True}, "echo", "invalid_value"),
    ({"best_of": 3}, "best_of", "invalid_value"),
])
def test_asks_the_server_cannot_honour_are_refused_by_name(extra, param, code):
    # before, each was ignored: a client asking for JSON mode or a penalty got plain sampling back
    with pytest.raises(oa.APIError) as info:
        oa.parse_chat({"messages": MSG, **extra})
    assert (info.value.param, info.value.code) == (param, code)


def test_the_neutral_values_of_unsupported_fields_are_accepted():
    job = oa.parse_chat({"messages": MSG, "tools": [], "response_format": {"type": "text"}, "top_logprobs": 0,
                         "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
                         "repeat_penalty": 1.0, "logit_bias": {}, "tool_choice": "auto", "echo": False,
                         "best_of": 1, "chat_template_kwargs": {"add_generation_prompt": None}})
    assert job.chat and not job.stream
