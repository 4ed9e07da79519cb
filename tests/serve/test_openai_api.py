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


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
@pytest.mark.parametrize("message", [{}, {"content": None}])
def test_a_message_without_content_is_refused_but_an_assistants(role, message):
    with pytest.raises(oa.APIError) as info:
        oa.parse_chat({"messages": [{"role": role, **message}]})
    e = info.value
    assert (e.status, e.param, e.code) == (400, "messages[0].content", "missing_field")
    job = oa.parse_chat({"messages": [*MSG, {"role": "assistant", "tool_calls": [], **message}]})
    assert job.messages[1]["content"] == ""  # an assistant's turn of tool calls only


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


def test_a_prompt_of_the_whole_context_is_scored_only_with_max_tokens_0(tok):
    """echo with max_tokens 0 (how evaluation harnesses score a text) takes a prompt as long as the context:
    it makes no token, so it needs no row after the prompt; any other request needs one."""
    ids = tok.encode("def f(x): return x")
    scored = oa.parse_text({"prompt": list(ids), "echo": True, "max_tokens": 0})
    assert oa.prompt_ids(scored, tok, add_bos=False, context=len(ids)) == list(ids)
    for body in ({"echo": True, "max_tokens": 1}, {"echo": True}, {}):
        with pytest.raises(oa.APIError) as info:
            oa.prompt_ids(oa.parse_text({"prompt": list(ids), **body}), tok, add_bos=False, context=len(ids))
        assert info.value.code == "context_length_exceeded", body
    text = oa.parse_text({"prompt": "def f(x): return x", "echo": True, "max_tokens": 0})
    assert oa.prompt_ids(text, tok, add_bos=False, context=len(ids)) == list(ids)


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


def test_a_streams_chunks_carry_the_given_timestamp_and_a_model_its_entry():
    assert oa.chunk(True, "r", "m", "a", created=5)["created"] == 5
    assert oa.usage_chunk(False, "r", "m", 1, 2, 5)["created"] == 5
    assert oa.models("m", 9, 3)["data"] == [oa.model_entry("m", 9, 3)]
    assert oa.model_entry("m", 9, 3)["id"] == "m"


def test_response_shapes():
    doc = oa.response(True, "chatcmpl-1", "m", "hello", "stop", 3, 2)
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    first = oa.chunk(True, "chatcmpl-1", "m", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert oa.chunk(False, "cmpl-1", "m", "x")["choices"][0]["text"] == "x"
    assert oa.sse("[DONE]") == "data: [DONE]\n\n"
    assert oa.usage_chunk(True, "c", "m", 1, 1)["choices"] == []
    # system_fingerprint on every answer and chunk, as OpenAI sends it (null where none is given)
    assert doc["system_fingerprint"] is None and first["system_fingerprint"] is None
    assert oa.response(False, "c", "m", "x", "stop", 1, 1, fingerprint="fp_1")["system_fingerprint"] == "fp_1"
    assert oa.chunk(True, "c", "m", "x", fingerprint="fp_1")["system_fingerprint"] == "fp_1"
    assert oa.usage_chunk(True, "c", "m", 1, 1, 5, "fp_1")["system_fingerprint"] == "fp_1"


@pytest.mark.parametrize("extra, param, code", [
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),  # without "logprobs": true
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
    # output controls of OpenAI, vLLM and llama-server: they were ignored, the answer unconstrained
    ({"suffix": "end"}, "suffix", "invalid_value"),
    ({"guided_json": {"type": "object"}}, "guided_json", "invalid_value"),
    ({"guided_regex": "a+"}, "guided_regex", "invalid_value"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "invalid_value"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "invalid_value"),
    ({"json_schema": {"type": "object"}}, "json_schema", "invalid_value"),
    ({"grammar": "root ::= x"}, "grammar", "invalid_value"),
    ({"ignore_eos": True}, "ignore_eos", "invalid_value"),
    ({"min_tokens": 5}, "min_tokens", "invalid_value"),
    ({"min_tokens": False}, "min_tokens", "invalid_value"),  # not 0: a bool
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
                         "best_of": 1, "chat_template_kwargs": {"add_generation_prompt": None},
                         "suffix": "", "ignore_eos": False, "min_tokens": 0, "guided_choice": [],
                         "json_schema": {}, "grammar": ""})
    assert job.chat and not job.stream


def test_seed_minus_one_is_random_as_llama_cpp_sends_it():
    assert oa.parse_chat({"messages": MSG, "seed": -1}).sampling.seed is None
    assert oa.parse_chat({"messages": MSG, "seed": 7}).sampling.seed == 7
    for bad in (True, "1"):
        with pytest.raises(oa.APIError) as info:
            oa.parse_chat({"messages": MSG, "seed": bad})
        assert info.value.param == "seed"


def test_seeds_are_openais_int64_and_reach_the_sampler_as_their_64_bits():
    # a negative seed is its two's complement, so every int64 has a stream of its own
    for seed, bits in ((2**63 - 1, 2**63 - 1), (-2, 2**64 - 2), (-(2**63), 2**63), (0, 0)):
        assert oa.parse_chat({"messages": MSG, "seed": seed}).sampling.seed == bits
    for bad in (2**63, -(2**63) - 1, 2**64):  # 2**63 was taken: the same bits as -2**63 now
        with pytest.raises(oa.APIError) as info:
            oa.parse_chat({"messages": MSG, "seed": bad})
        assert (info.value.param, info.value.code) == ("seed", "invalid_value")
        assert info.value.message.startswith("seed: must be ")


def test_a_lone_surrogate_is_a_400_and_a_pair_is_its_character():
    for raw in (rb'{"prompt": "a\ud800b"}', rb'{"prompt": "\uDFFF"}', rb'{"\ud800": 1}'):
        with pytest.raises(oa.APIError) as info:
            oa.parse_json(raw)
        assert (info.value.status, info.value.code) == (400, "invalid_json")
        assert "surrogate" in info.value.message
    # a surrogate's own bytes, and a UTF-16 body (json.loads of bytes took both)
    for raw in (b'{"prompt": "a\xed\xa0\x80b"}', '{"prompt": "a\\ud800"}'.encode("utf-16")):
        with pytest.raises(oa.APIError) as info:
            oa.parse_json(raw)
        assert (info.value.code, info.value.message) == ("invalid_json", "the request body is not valid JSON "
                                                         "(not UTF-8)")
    assert oa.parse_json(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a UTF-8 BOM
    assert oa.parse_json(rb'{"path": "C:\\udir"}') == {"path": "C:\\udir"}  # an escaped backslash
    assert oa.parse_json(rb'{"prompt": "\ud83d\ude00 \u00e9"}') == {"prompt": "\U0001f600 \u00e9"}


def test_a_prompt_too_long_for_any_tokens_is_refused_before_its_encode(tok, monkeypatch):
    context = 10
    limit = 4 * tok.max_token_bytes * (context - 1) + 1  # bytes: at least `context` tokens whatever the text
    job = oa.parse_text({"prompt": "x" * limit})
    monkeypatch.setattr(tok, "encode", lambda *a, **k: pytest.fail("encoded a prompt that cannot fit"))
    with pytest.raises(oa.APIError) as info:
        oa.prompt_ids(job, tok, add_bos=False, context=context)
    assert info.value.code == "context_length_exceeded" and "at least 10 tokens" in info.value.message
    monkeypatch.undo()
    short = oa.parse_text({"prompt": "x" * (limit - 1)})  # may fit: encoded, then counted
    with pytest.raises(oa.APIError) as info:
        oa.prompt_ids(short, tok, add_bos=False, context=context)
    assert info.value.code == "context_length_exceeded" and "at least" not in info.value.message


# --- logprobs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, want", [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": 0}, None), ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": True, "top_logprobs": 20}, 20),
    ({"logprobs": None, "top_logprobs": 0}, None),
])
def test_chat_logprobs_are_a_switch_and_a_count(extra, want):
    job = oa.parse_chat({"messages": MSG, **extra})
    assert job.logprobs == want and job.engine_logprobs == (0 if want is None else max(1, want))


@pytest.mark.parametrize("extra, want", [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": 0}, 0), ({"logprobs": 3}, 3),
    ({"logprobs": 20}, 20),
])
def test_completion_logprobs_are_a_count(extra, want):
    assert oa.parse_text({"prompt": "x", **extra}).logprobs == want


@pytest.mark.parametrize("chat, extra, param, code", [
    (True, {"logprobs": "yes"}, "logprobs", "invalid_type"),
    (True, {"logprobs": 1}, "logprobs", "invalid_type"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_value"),
    (True, {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "invalid_type"),
    (False, {"logprobs": 21}, "logprobs", "invalid_value"),
    (False, {"logprobs": -1}, "logprobs", "invalid_value"),
    (False, {"logprobs": True}, "logprobs", "invalid_type"),
    (False, {"logprobs": "3"}, "logprobs", "invalid_type"),
    (False, {"top_logprobs": 3}, "top_logprobs", "invalid_value"),
])
def test_bad_logprobs_are_refused_by_name(chat, extra, param, code):
    with pytest.raises(oa.APIError) as info:
        oa.parse_chat({"messages": MSG, **extra}) if chat else oa.parse_text({"prompt": "x", **extra})
    assert (info.value.param, info.value.code) == (param, code)


def emitted(token_id, offset, logprob, top):
    from strata_ray.serve.text_stream import EmittedToken

    return EmittedToken(token_id, offset, logprob, tuple(top))


def test_logprobs_shapes_of_chat_and_completions():
    token_bytes = [b"a", b"\xe2\x98", b"\x83", b"bc"]  # ids 1 and 2: the two halves of one character
    tokens = [emitted(1, 0, -0.5, [(1, -0.5), (2, -1.0)]), emitted(2, 0, -0.25, [(3, -0.1), (2, -0.25)]),
              emitted(3, 1, -2.0, [(0, -0.3), (3, -2.0)])]
    halves = ["bytes:\\xe2\\x98", "bytes:\\x83"]  # OpenAI's spelling of bytes that are not UTF-8 alone
    doc = oa.logprobs_doc(True, tokens, token_bytes, top=1)
    chat = doc["content"]
    assert doc["refusal"] is None
    assert [c["bytes"] for c in chat] == [[0xE2, 0x98], [0x83], [98, 99]]  # the exact bytes, split or not
    assert [c["token"] for c in chat] == [*halves, "bc"]
    assert [c["logprob"] for c in chat] == [-0.5, -0.25, -2.0]
    assert chat[0]["top_logprobs"] == [{"token": halves[0], "logprob": -0.5, "bytes": [0xE2, 0x98]}]
    assert oa.logprobs_doc(True, tokens, token_bytes, top=0)["content"][2]["top_logprobs"] == []
    text = oa.logprobs_doc(False, tokens, token_bytes, top=2)
    assert text["tokens"] == [*halves, "bc"] and text["token_logprobs"] == [-0.5, -0.25, -2.0]
    assert text["text_offset"] == [0, 0, 1]
    # the two halves keep names of their own (both were U+FFFD, and the dict lost one)
    assert text["top_logprobs"] == [{halves[0]: -0.5, halves[1]: -1.0}, {"bc": -0.1, halves[1]: -0.25},
                                    {"a": -0.3, "bc": -2.0}]
    # the chosen token is always listed beside the top 1 (OpenAI: up to logprobs + 1)
    top1 = oa.logprobs_doc(False, tokens, token_bytes, top=1)["top_logprobs"]
    assert top1[1] == {"bc": -0.1, halves[1]: -0.25}
    chunk = oa.chunk(True, "c", "m", "x", logprobs={"content": []})
    assert chunk["choices"][0]["logprobs"] == {"content": []}
    assert oa.response(False, "c", "m", "x", "stop", 1, 1, logprobs=text)["choices"][0]["logprobs"] is text


def test_a_name_shared_by_two_ids_keeps_the_best_and_the_chosen_ones_own():
    token_bytes = [b"x", b"x", b"y"]  # ids 0 and 1 spell the same text
    doc = oa.logprobs_doc(False, [emitted(1, 0, -0.9, [(0, -0.2), (1, -0.9), (2, -1.5)])], token_bytes, top=3)
    assert doc["top_logprobs"] == [{"x": -0.9, "y": -1.5}] and doc["token_logprobs"] == [-0.9]
    assert oa.logprobs_doc(False, [emitted(2, 0, -1.5, [(0, -0.2), (1, -0.9)])], token_bytes,
                           top=2)["top_logprobs"] == [{"x": -0.2, "y": -1.5}]


def test_infinite_logprobs_become_vllms_floor_so_the_json_is_valid():
    import json

    nan, inf = float("nan"), float("inf")
    doc = oa.logprobs_doc(True, [emitted(0, 0, -inf, [(1, 0.0), (0, nan)])], [b"a", b"b"], 2)
    json.dumps(doc, allow_nan=False)  # what Starlette's JSONResponse demands
    assert doc["content"][0]["logprob"] == oa.LOGPROB_FLOOR == doc["content"][0]["top_logprobs"][1]["logprob"]
    text = oa.logprobs_doc(False, [emitted(0, 0, -inf, [(1, 0.0)])], [b"a", b"b"], 1)
    json.dumps(text, allow_nan=False)


# --- /tokenize, /detokenize ------------------------------------------------------------------------------


def test_tokenize_takes_both_servers_spellings_and_defaults():
    llama = oa.parse_tokenize({"content": "hi", "with_pieces": True})
    assert (llama.job.prompt, llama.add_special, llama.with_pieces) == ("hi", False, True)  # llama-server's
    vllm = oa.parse_tokenize({"model": "m", "prompt": "hi", "return_token_strs": True})
    assert (vllm.job.prompt, vllm.add_special, vllm.with_pieces, vllm.token_strs) == ("hi", True, False, True)
    assert oa.parse_tokenize({"content": "hi", "add_special": True}).add_special
    assert not oa.parse_tokenize({"prompt": "hi", "add_special_tokens": False}).add_special
    chat = oa.parse_tokenize({"messages": MSG, "add_generation_prompt": False})
    assert chat.job.chat and chat.job.messages[0]["content"] == "hi" and chat.add_special
    assert chat.job.chat_template_kwargs == {"add_generation_prompt": False}
    nested = oa.parse_tokenize({"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert nested.job.chat_template_kwargs == {"add_generation_prompt": False}


@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", "missing_field"), ({"content": 5}, "content", "invalid_type"),
    ({"content": "a", "prompt": 3}, "prompt", "invalid_value"),
    ({"prompt": "a", "messages": MSG}, "messages", "invalid_value"),
    ({"content": "a", "add_special": True, "add_special_tokens": True}, "add_special_tokens",
     "invalid_value"),
    ({"prompt": "a", "return_token_strs": "yes"}, "return_token_strs", "invalid_type"),
    ({"prompt": ["a"]}, "prompt", "invalid_type"), ({"messages": []}, "messages", "invalid_type"),
    ({"content": "a", "add_special": "no"}, "add_special", "invalid_type"),
    ({"content": "a", "with_pieces": 1}, "with_pieces", "invalid_type"),
])
def test_bad_tokenize_requests_name_the_field(body, param, code):
    with pytest.raises(oa.APIError) as info:
        oa.parse_tokenize(body)
    assert (info.value.param, info.value.code) == (param, code)


@pytest.mark.parametrize("body, code", [
    ({}, "missing_field"), ({"tokens": "1,2"}, "invalid_type"), ({"tokens": [1, True]}, "invalid_type"),
    ({"tokens": [1, 300]}, "invalid_value"), ({"tokens": [-1]}, "invalid_value"),
])
def test_bad_detokenize_requests_name_the_field(body, code):
    with pytest.raises(oa.APIError) as info:
        oa.parse_detokenize(body, n_vocab=288)
    assert (info.value.param, info.value.code) == ("tokens", code)
    assert oa.parse_detokenize({"tokens": [0, 287]}, n_vocab=288) == [0, 287]


def test_tokenize_answer_shapes():
    token_bytes = [b"a", b"\xe2\x98", b"\x83"]
    doc = oa.tokenize_doc([0, 1], token_bytes, False, 64)
    assert doc == {"tokens": [0, 1], "count": 2, "max_model_len": 64}
    pieces = oa.tokenize_doc([0, 2], token_bytes, True, 64)["tokens"]
    assert pieces == [{"id": 0, "piece": "a"}, {"id": 2, "piece": [0x83]}]  # not UTF-8 alone: its bytes
    assert oa.tokenize_doc([2, 0], token_bytes, False, 64, ["A", "B", "C"])["token_strs"] == ["C", "A"]


def test_echo_is_a_completions_field_that_allows_max_tokens_0():
    job = oa.parse_text({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert job.echo and job.max_tokens == 0 and job.logprobs == 1
    assert not oa.parse_text({"prompt": "x"}).echo
    with pytest.raises(oa.APIError) as info:  # nothing to send back without the echo
        oa.parse_text({"prompt": "x", "max_tokens": 0})
    assert (info.value.param, info.value.code) == ("max_tokens", "invalid_value")
    for body, param in (({"prompt": "x", "echo": "yes"}, "echo"),):
        with pytest.raises(oa.APIError) as info:
            oa.parse_text(body)
        assert (info.value.param, info.value.code) == (param, "invalid_type")


def test_an_echoed_prompts_first_token_has_null_logprobs():
    tokens = [emitted(0, 0, None, ()), emitted(1, 1, -0.5, [(1, -0.5)])]
    doc = oa.logprobs_doc(False, tokens, [b"a", b"b"], top=1)
    assert doc == {"tokens": ["a", "b"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"b": -0.5}],
                   "text_offset": [0, 1]}
