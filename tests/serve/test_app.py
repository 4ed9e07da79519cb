"""The server end to end: real Ray Serve, real HTTP, the real engine (see conftest.py)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from strata_ray.engine.engine import GenerationRequest
from strata_ray.serve.app import health_state

REPO = Path(__file__).resolve().parents[2]
HELLO = [{"role": "user", "content": "What is a Python list?"}]


def sse_events(response: requests.Response) -> list:
    out = []
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def greedy_chat(server, messages=HELLO, max_tokens=12, **extra) -> dict:
    r = server.post("/v1/chat/completions",
                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


# --- answers ---------------------------------------------------------------------------------------------


def test_health_needs_no_key_and_says_loaded(server):
    r = requests.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    doc = r.json()
    assert doc["loaded"] is True and doc["api_key"] is True and doc["max_context"] > 0
    assert doc["status"] == "ok"
    assert requests.head(server.url + "/health", timeout=10).status_code == 200  # probes that send HEAD


@pytest.mark.parametrize("loaded, error, answer", [
    (False, None, (503, "loading")), (True, None, (200, "ok")), (False, "no such file", (503, "error")),
])
def test_health_says_503_until_the_model_serves(loaded, error, answer):
    assert health_state(loaded, error) == answer


def test_greedy_chat_equals_the_engine(server, engine):
    doc = greedy_chat(server)
    expected = engine.generate(GenerationRequest(prompt=HELLO[0]["content"], chat=True, max_tokens=12))
    choice = doc["choices"][0]
    assert doc["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert doc["usage"]["prompt_tokens"] == expected.prompt_tokens
    assert doc["usage"]["completion_tokens"] == len(expected.token_ids)
    assert choice["finish_reason"] == ("length" if len(expected.token_ids) == 12 else "stop")
    assert doc["timings"]["predicted_n"] == len(expected.token_ids)


def test_streaming_equals_non_streaming_with_usage_last(server):
    whole = greedy_chat(server)
    r = server.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 12, "temperature": 0,
                                             "stream": True, "stream_options": {"include_usage": True}},
                    stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage, finish = events[-2], events[-3]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == whole["choices"][0]["message"]["content"]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert len({e["created"] for e in events[:-1]}) == 1  # one timestamp a stream, as OpenAI's
    assert all(e["usage"] is None for e in events[:-2])  # OpenAI's null before the usage chunk


def test_an_empty_streamed_answer_still_says_its_role_and_counts_as_the_plain_one(server):
    """A stop string at the answer's first character: the stream's chunks are the role, the finish and the
    usage; the usage is the plain answer's (tokens the engine made past the stop were counted before)."""
    full = greedy_chat(server, max_tokens=8)["choices"][0]["message"]["content"]
    if not full:
        pytest.skip("the model's answer is empty")
    body = {"messages": HELLO, "max_tokens": 8, "temperature": 0, "stop": [full[0]]}
    plain = server.post("/v1/chat/completions", body).json()
    assert plain["choices"][0]["message"]["content"] == ""
    events = sse_events(server.post("/v1/chat/completions", {**body, "stream": True,
                                    "stream_options": {"include_usage": True}}, stream=True))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-3]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    assert events[-2]["usage"] == plain["usage"]


def test_completions_stream_and_not(server, engine):
    body = {"prompt": "The Python standard library", "max_tokens": 10, "temperature": 0}
    doc = server.post("/v1/completions", body).json()
    expected = engine.generate(GenerationRequest(prompt=body["prompt"], max_tokens=10))
    assert doc["object"] == "text_completion" and doc["choices"][0]["text"] == expected.text
    events = sse_events(server.post("/v1/completions", {**body, "stream": True}, stream=True))
    assert events[-1] == "[DONE]" and not any("usage" in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected.text


def test_logprobs_chat_and_completions_streamed_or_not(server, engine):
    doc = greedy_chat(server, logprobs=True, top_logprobs=3)
    choice = doc["choices"][0]
    content = choice["logprobs"]["content"]
    prompt = HELLO[0]["content"]
    want = engine.generate(GenerationRequest(prompt=prompt, chat=True, max_tokens=12, logprobs=3))
    assert len(content) == doc["usage"]["completion_tokens"] == len(want.token_ids)
    spelled = bytes(b for c in content for b in c["bytes"]).decode("utf-8", "replace")
    assert spelled == choice["message"]["content"]
    best = [top[0][1] for top in want.top_logprobs]  # greedy: the chosen token's
    assert [c["logprob"] for c in content] == pytest.approx(best, abs=1e-5)
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c["top_logprobs"]) == 3
        assert c["top_logprobs"][0] == {"token": c["token"], "logprob": c["logprob"], "bytes": c["bytes"]}
    body = {"messages": HELLO, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    streamed = sse_events(server.post("/v1/chat/completions", {**body, "stream": True}, stream=True))
    chunks = [e["choices"][0] for e in streamed[:-1]]
    assert [c for ch in chunks if ch["logprobs"] for c in ch["logprobs"]["content"]] == content
    assert greedy_chat(server)["choices"][0]["logprobs"] is None  # only when asked

    body = {"prompt": "The Python standard library", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    text = server.post("/v1/completions", body).json()["choices"][0]
    lp = text["logprobs"]
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(tokens) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(offsets) > 0
    assert offsets[0] == 0 and offsets == sorted(offsets)
    if "\ufffd" not in text["text"]:  # every token whole characters: the tokens spell the text
        assert "".join(tokens) == text["text"]
        assert all(text["text"][o:].startswith(t) for o, t in zip(offsets, tokens, strict=True))
    for tok, lp_, top in zip(tokens, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == lp_ and len(top) <= 3  # the chosen token always listed
    events = sse_events(server.post("/v1/completions", {**body, "stream": True}, stream=True))
    streamed_tokens = [t for e in events[:-1] if e["choices"][0]["logprobs"]
                       for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == tokens


def test_echo_scores_a_prompt_as_evaluation_harnesses_ask(server, engine):
    # lm-evaluation-harness's loglikelihood request: the prompt echoed with its logprobs, nothing generated
    prompt = "The Python standard library is large"
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    ids = engine.tokenizer.encode(prompt)
    want = engine.generate(GenerationRequest(prompt_ids=tuple(ids), max_tokens=0, prompt_logprobs=1))
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-5)
    assert "".join(lp["tokens"]) == prompt and lp["text_offset"][0] == 0
    for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert tok in top and 1 <= len(top) <= 2  # is_greedy: the chosen token is the best one listed
    # with a generation after it: the prompt, then what the request without echo answers
    plain = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    both = server.post("/v1/completions", {**body, "max_tokens": 6}).json()["choices"][0]
    assert both["text"] == prompt + plain["choices"][0]["text"]
    assert all(o >= len(prompt) for o in both["logprobs"]["text_offset"][len(ids):])
    streamed = server.post("/v1/completions", {**body, "max_tokens": 6, "stream": True}, stream=True)
    events = sse_events(streamed)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == both["text"]
    assert_error(server.post("/v1/completions", {"prompt": prompt, "max_tokens": 0}), 400, "max_tokens",
                 "invalid_value")


def test_tokenize_gives_the_ids_a_completion_runs_and_detokenize_inverts_it(server, engine):
    text = "The Python standard library \u2603"
    doc = server.post("/tokenize", {"content": text}).json()
    assert doc["tokens"] == engine.tokenizer.encode(text, add_bos=False)
    assert doc["count"] == len(doc["tokens"])
    ctx = server.get("/v1/models").json()["data"][0]["max_model_len"]
    assert doc["max_model_len"] == ctx
    done = server.post("/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == doc["count"]
    chat = server.post("/tokenize", {"messages": HELLO}).json()
    assert chat["count"] == greedy_chat(server, max_tokens=1)["usage"]["prompt_tokens"]
    bare = server.post("/tokenize", {"messages": HELLO, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]
    pieces = server.post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == doc["tokens"]
    back = server.post("/detokenize", {"tokens": doc["tokens"]}).json()
    assert back == {"content": text, "prompt": text}
    assert_error(server.post("/detokenize", {"tokens": [10**9]}), 400, "tokens", "invalid_value")
    assert_error(server.post("/tokenize", {"content": 3}), 400, "content", "invalid_type")
    assert requests.post(server.url + "/tokenize", json={"content": "a"}, timeout=10).status_code == 401


def test_greedy_text_equals_run_json(server, model_path):
    """The server and `python -m strata_ray.run --json` give the same greedy text for the same prompt."""
    prompt = "The for statement"
    doc = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0}).json()
    run = subprocess.run(
        [sys.executable, "-m", "strata_ray.run", "--model", str(model_path), "--prompt", prompt,
         "--max-tokens", "16", "--json", "--address", "local", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert run.returncode == 0, run.stderr
    assert doc["choices"][0]["text"] == json.loads(run.stdout)["text"]


def test_stop_string_cuts_the_text(server):
    full = greedy_chat(server, max_tokens=24)["choices"][0]["message"]["content"]
    if len(full) < 8:
        pytest.skip("the model's answer is too short to cut")
    stop = full[4:7]
    doc = greedy_chat(server, max_tokens=24, stop=[stop, "never-in-the-text-\u2603"])
    assert doc["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert doc["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_repeats_with_template_kwargs(server):
    body = {"messages": HELLO, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "seed": 1234, "chat_template_kwargs": {"enable_thinking": False}}
    a = server.post("/v1/chat/completions", body).json()
    b = server.post("/v1/chat/completions", body).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_models(server):
    doc = server.get("/v1/models").json()
    assert doc["object"] == "list" and doc["data"][0]["id"] == server.model_path.name.removesuffix(".gguf")
    # one model's entry, as the OpenAI clients' models.retrieve asks
    assert server.get("/v1/models/" + doc["data"][0]["id"]).json() == doc["data"][0]
    assert_error(server.get("/v1/models/no-such-model"), 404, "model", "model_not_found")


# --- errors ----------------------------------------------------------------------------------------------


def assert_error(r: requests.Response, status: int, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_a_lone_surrogate_is_a_400_in_openais_shape(server):
    # a JavaScript client's string cut inside an emoji: the tokenizer raised, a plain-text 500
    for path, body in (("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
                       ("/v1/completions", b'{"prompt": "a\\udc00b", "stream": true}'),
                       ("/tokenize", b'{"content": "\\ud800"}')):
        assert_error(server.post(path, body), 400, code="invalid_json")


def test_api_key(server):
    body = json.dumps({"messages": HELLO, "max_tokens": 1})
    key = server.api_key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                    {"Authorization": "Bearer" + key}, {"Authorization": "Basic " + key}):
        r = requests.post(server.url + "/v1/chat/completions", data=body, headers=headers, timeout=30)
        assert_error(r, 401, code="invalid_api_key")
    # the scheme is case-insensitive (RFC 9110)
    r = requests.post(server.url + "/v1/chat/completions", data=body, timeout=60,
                      headers={"Authorization": "bearer " + server.api_key})
    assert r.status_code == 200, r.text
    for path in ("/v1/models", "/v1/status", "/metrics"):
        assert_error(requests.get(server.url + path, timeout=30), 401)


@pytest.mark.parametrize("body, param, code", [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    ({"max_tokens": 4}, "messages", "missing_field"),
    ({"messages": "hello"}, "messages", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": HELLO, "temperature": -1}, "temperature", "invalid_value"),
    ({"messages": HELLO, "top_p": -0.5}, "top_p", "invalid_value"),
    ({"messages": HELLO, "top_k": 2.5}, "top_k", "invalid_type"),
    ({"messages": HELLO, "min_p": 2}, "min_p", "invalid_value"),
    ({"messages": HELLO, "seed": "x"}, "seed", "invalid_type"),
    ({"messages": HELLO, "seed": 2**70}, "seed", "invalid_value"),
    ({"messages": HELLO, "max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": HELLO, "max_tokens": "10"}, "max_tokens", "invalid_type"),
    ({"messages": HELLO, "stop": 7}, "stop", "invalid_type"),
    ({"messages": HELLO, "stream": "yes"}, "stream", "invalid_type"),
    ({"messages": HELLO, "stream": True, "stream_options": []}, "stream_options", "invalid_type"),
    ({"messages": HELLO, "n": 2}, "n", "invalid_value"),
    ({"messages": HELLO, "chat_template_kwargs": "x"}, "chat_template_kwargs", "invalid_type"),
])
def test_bad_chat_requests(server, body, param, code):
    assert_error(server.post("/v1/chat/completions", body), 400, param, code)


def test_bad_completion_requests(server):
    ctx = server.get("/v1/models").json()["data"][0]["max_model_len"]
    assert_error(server.post("/v1/completions", {"max_tokens": 2}), 400, "prompt", "missing_field")
    assert_error(server.post("/v1/completions", {"prompt": {"a": 1}}), 400, "prompt", "invalid_type")
    assert_error(server.post("/v1/completions", {"prompt": [10**9]}), 400, "prompt", "invalid_value")
    assert_error(server.post("/v1/completions", {"prompt": [5] * (ctx + 1)}), 400, "prompt",
                 "context_length_exceeded")
    long_text = " ".join(f"w{i}" for i in range(ctx))  # > ctx tokens whatever the merges
    assert_error(server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                 400, "messages", "context_length_exceeded")
    assert_error(server.get("/v1/nowhere"), 404)


def test_a_prompt_of_the_whole_context_is_scored_with_echo_and_max_tokens_0(server):
    """An evaluation harness's loglikelihood request over the whole context makes no token, so it needs no
    row after the prompt: answered, every prompt token scored; with a token to make it is a 400."""
    ctx = server.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": [5] * ctx, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["usage"] == {"prompt_tokens": ctx, "completion_tokens": 0, "total_tokens": ctx}
    choice = doc["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == ctx and choice["finish_reason"] == "length"
    assert_error(server.post("/v1/completions", {**body, "max_tokens": 1}), 400, "prompt",
                 "context_length_exceeded")


@pytest.mark.parametrize("path, field, ok, past, extra", [
    ("/v1/chat/completions", "stop", [f"never-{i}" for i in range(4)], [f"never-{i}" for i in range(5)], {}),
    ("/v1/chat/completions", "temperature", 2, math.nextafter(2, 3), {"seed": 1}),
    ("/v1/chat/completions", "top_p", 1, math.nextafter(1, 2), {}),
    ("/v1/chat/completions", "top_p", 0, math.nextafter(0, -1), {"temperature": 1, "seed": 1}),
    ("/v1/chat/completions", "seed", 2**63 - 1, 2**63, {}),
    ("/v1/chat/completions", "seed", -(2**63), -(2**63) - 1, {}),
    ("/v1/chat/completions", "top_logprobs", 20, 21, {"logprobs": True}),
    ("/v1/completions", "logprobs", 20, 21, {}),
])
def test_openais_limits_answer_the_boundary_and_refuse_one_past_it(server, path, field, ok, past, extra):
    body = {"messages": HELLO} if path == "/v1/chat/completions" else {"prompt": "The json module"}
    body = {**body, "max_tokens": 1, **extra}
    r = server.post(path, {**body, field: ok})
    assert r.status_code == 200, r.text
    if field in ("top_logprobs", "logprobs"):  # all of them listed (completions' with the chosen one too)
        logprobs = r.json()["choices"][0]["logprobs"]
        top = logprobs["content"][0]["top_logprobs"] if "content" in logprobs else logprobs["top_logprobs"][0]
        assert len(top) >= 20
    r = server.post(path, {**body, field: past})
    assert_error(r, 400, field, "invalid_value")
    assert r.json()["error"]["message"].startswith(f"{field}: ")


def test_system_fingerprint_is_one_a_server_on_every_answer_and_chunk(server):
    fp = greedy_chat(server, max_tokens=2)["system_fingerprint"]
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fp), fp
    assert greedy_chat(server, max_tokens=2)["system_fingerprint"] == fp
    text = {"prompt": "The json module", "max_tokens": 2, "temperature": 0}
    assert server.post("/v1/completions", text).json()["system_fingerprint"] == fp
    for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", text)):
        r = server.post(path, {**body, "max_tokens": 3, "temperature": 0, "stream": True,
                               "stream_options": {"include_usage": True}}, stream=True)
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
        assert chunks[-1]["usage"] and all(c["system_fingerprint"] == fp for c in chunks), chunks
    assert server.get("/v1/status").json()["system_fingerprint"] == fp


# --- scheduling ------------------------------------------------------------------------------------------


def requests_done(server) -> dict:
    return server.get("/metrics", params={"requests": "all"}).json()


def test_disconnect_cancels_and_frees_the_engine(server):
    before = requests_done(server)["totals"]
    r = server.post("/v1/completions", {"prompt": "The Python standard library", "max_tokens": 3000,
                                        "temperature": 0, "stream": True}, stream=True)
    lines = r.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    r.close()  # the client goes away after the first tokens
    started = time.monotonic()
    doc = greedy_chat(server, max_tokens=2)
    assert doc["choices"][0]["finish_reason"] in ("stop", "length")
    assert time.monotonic() - started < 15, "the cancelled generation kept the engine busy"
    metrics = requests_done(server)
    assert metrics["totals"]["cancelled"] == before["cancelled"] + 1
    cancelled = next(x for x in metrics["requests"] if x["endpoint"] == "/v1/completions")
    assert cancelled["finish_reason"] == "cancelled" and 0 < cancelled["generated"] < 3000
    assert metrics["live"]["state"] == "idle" and metrics["live"]["queued"] == 0


def test_a_stop_refuses_new_requests_and_ends_an_open_stream_with_an_error_event(model_path, tmp_path):
    """SIGTERM while a stream runs past the grace: a request sent after it gets a 503 a client may retry, the
    stream ends with an error event and [DONE] (it was cut mid-token: curl's "partial transfer"), and the
    server still exits 0."""
    from tests.serve.conftest import start_server

    srv = start_server(model_path, tmp_path, shutdown_grace=1)
    try:
        r = srv.post("/v1/completions", {"prompt": "The Python standard library", "max_tokens": 3000,
                                         "temperature": 0, "stream": True}, stream=True)
        lines = r.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line).startswith("data: {")  # tokens flow
        srv.proc.send_signal(signal.SIGTERM)
        late = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down", late.text
        events = [line[len("data: "):] for line in lines if line]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and "generation finished" in error["message"]
        assert srv.proc.wait(timeout=60) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    assert "strata_ray: stopped" in srv.log.read_text()[-2000:]


def test_load_50_requests_from_4_threads(server):
    before = requests_done(server)["totals"]
    results: list = []
    lock = threading.Lock()

    def worker(k: int):
        for i in range(k, 50, 4):
            body = {"prompt": f"{i}", "max_tokens": 2, "temperature": 0, "stream": i % 3 == 0}
            r = server.post("/v1/completions", body, stream=body["stream"])
            ok = r.status_code == 200 and (sse_events(r)[-1] == "[DONE]" if body["stream"] else
                                           r.json()["usage"]["completion_tokens"] <= 2)
            with lock:
                results.append((i, r.status_code, ok))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=170)
    assert sorted(i for i, _, _ in results) == list(range(50))
    assert all(ok for _, _, ok in results), [r for r in results if not r[2]]
    totals = requests_done(server)["totals"]
    assert totals["requests"] - before["requests"] == 50
    assert totals["completed"] - before["completed"] == 50


def test_the_context_boundary_and_long_prompts_beside_short_ones(server):
    """Sent together from threads: prompts one and two tokens short of the context (one streamed, with no
    max_tokens) answer up to the context and end with "length" (usage: the context at most); one of the
    context is a 400 in OpenAI's shape at once, while the long ones run; the short ones all answer."""
    ctx = server.get("/v1/models").json()["data"][0]["max_model_len"]

    def ids(n: int) -> list[int]:
        return [(i * 37 + 11) % 250 + 5 for i in range(n)]

    jobs = {
        "last": ({"prompt": ids(ctx - 1), "max_tokens": 2}, 1),
        "two": ({"prompt": ids(ctx - 2), "stream": True, "stream_options": {"include_usage": True}}, 2),
        "over": ({"prompt": ids(ctx), "max_tokens": 1}, None),
        **{f"short{i}": ({"prompt": f"def f{i}():", "max_tokens": 4}, 4) for i in range(6)},
    }
    answers: dict = {}

    def send(name: str, body: dict) -> None:
        started = time.monotonic()
        r = server.post("/v1/completions", {**body, "temperature": 0}, stream=body.get("stream", False))
        answers[name] = (r, sse_events(r) if body.get("stream") else None, time.monotonic() - started)

    threads = [threading.Thread(target=send, args=(name, body)) for name, (body, _) in jobs.items()]
    for t in threads:
        t.start()
        time.sleep(0.02)  # in this order
    for t in threads:
        t.join(timeout=170)
    r, _, seconds = answers.pop("over")
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert r.json()["error"]["message"] == f"the prompt has {ctx} tokens; the model's context is {ctx} tokens"
    assert seconds < answers["last"][2]  # refused beside the engine, not after the long prompt before it
    for name, (r, events, _) in answers.items():
        assert r.status_code == 200, (name, r.text)
        if events is not None:
            assert events[-1] == "[DONE]"
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
            usage = events[-2]["usage"]
        else:
            finish, usage = r.json()["choices"][0]["finish_reason"], r.json()["usage"]
        room = jobs[name][1]  # max_tokens or the context's room: all of it, unless a stop token came first
        assert (finish == "length") == (usage["completion_tokens"] == room), (name, finish, usage)
        assert usage["total_tokens"] <= ctx and usage["completion_tokens"] <= room, (name, usage)


# --- status and metrics ----------------------------------------------------------------------------------


def test_status_and_metrics(server):
    greedy_chat(server, max_tokens=3)
    st = server.get("/v1/status").json()
    assert st["loaded"] and st["context"]["native"] > 0 and st["uptime_s"] > 0
    assert st["activity"]["requests"] >= 1 and st["last_timings"]["prompt_n"] > 0
    info = st["engine"]
    tiers = st["tiers"].values()
    assert sum(t["experts"] for t in tiers) == info["n_layer"] * info["n_expert"]  # every expert has a tier
    assert sum(t["hits"] for t in tiers) == max(t["lookups"] for t in tiers) > 0  # each entry computed once
    assert "ram" in st["machine"]
    m = server.get("/metrics").json()
    assert {"engine", "live", "requests", "totals", "tiers", "hardware"} <= set(m)
    last = m["requests"][0]
    assert last["timings"]["predicted_n"] == last["generated"] and last["tiers"]
    text = server.get("/metrics", params={"format": "prometheus"})
    assert text.headers["content-type"].startswith("text/plain")
    assert "strata_requests_total" in text.text and "strata_tier_hits_total{tier=" in text.text


def test_page_is_served(server):
    r = requests.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and "<title>strata-ray</title>" in r.text


# --- placement ---------------------------------------------------------------------------------------------


def test_placement_problem_names_what_is_missing():
    from strata_ray.serve.app import placement_problem

    assert placement_problem(1, 0, {"CPU": 2.0}) is None
    assert placement_problem(2, 1, {"CPU": 16.0, "GPU": 2.0}) is None
    assert placement_problem(2, 1, {"CPU": 16.0, "GPU": 1.0}).startswith(
        "2 replica(s) of 1 GPU(s) need 2 GPUs")
    assert "has 2 " in placement_problem(3, 0, {"CPU": 2.0})


def test_replicas_that_can_never_be_placed_fail_in_one_line_instead_of_waiting(tmp_path):
    """A real local cluster and more replicas than it has CPUs: Serve would wait for them forever."""
    from tests.serve.conftest import free_port

    done = subprocess.run(
        [sys.executable, "-m", "strata_ray.run", "serve", "--address", "local", "--device", "cpu",
         "--replicas", "1000", "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "1000 replica(s) need 1000 CPUs; the Ray cluster has" in last, done.stderr[-2000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without GPUs")
def test_gpus_asked_for_on_a_cluster_without_any_fail_in_one_line():
    """`--gpu 0` where Ray finds no GPU: one line and exit 2, not a CPU server behind a note."""
    from tests.serve.conftest import free_port

    done = subprocess.run(
        [sys.executable, "-m", "strata_ray.run", "serve", "--address", "local", "--gpu", "0",
         "--port", str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "GPUs 0 asked for" in last and "has none" in last, done.stderr[-2000:]


def test_a_fault_of_the_server_answers_in_openais_shape():
    """The handler behind every unexpected exception (a plain-text 500 before: clients could not parse it)."""
    import asyncio

    from strata_ray.serve.app import api

    handler = api.exception_handlers[Exception]
    response = asyncio.run(handler(None, FileNotFoundError("/srv/secret/path")))
    assert response.status_code == 500
    err = json.loads(response.body)["error"]
    assert err["message"] == "internal error (FileNotFoundError); the server's log has the details"
    assert err["type"] == "server_error" and "/srv" not in response.body.decode()
