"""OpenAI's wire format: request validation into a `Completion`, and the response, chunk and error shapes.

Pure functions over dicts, so they are tested without a server. Unknown request fields are ignored (clients
send many); known fields of the wrong type or range get a 400 naming the field (`param`), in OpenAI's
`{"error": {"message", "type", "param", "code"}}` shape.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from strata_ray.engine.context_room import prompt_fits, too_long

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # OpenAI's limit ("up to 4 sequences")
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0 to 2
MAX_LOGPROBS = 20  # top log-probabilities a token: OpenAI's chat limit (vLLM's default max_logprobs)
# OpenAI's seed is an int64: one outside is refused, not folded into the sampler's 64 bits, where it would
# share a stream with a negative seed (2**63 and -2**63 are the same bits)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """An error answered in OpenAI's shape; the message is one line."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    "authentication_error", None, "invalid_api_key")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "engine_failure")


SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"


def shutting_down(message: str = SHUTTING_DOWN) -> APIError:
    """A 503 a client may retry: the server was told to stop (serve_main's drain)."""
    return APIError(503, message, "server_error", None, "server_shutting_down")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # the engine's unsigned 64 bits (a request's negative seed in two's complement)


@dataclass(frozen=True)
class Completion:
    """A validated /v1/chat/completions or /v1/completions request."""

    chat: bool
    messages: tuple[dict, ...] = ()  # chat: [{"role", "content": str}]
    prompt: str | None = None  # /v1/completions: text ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids
    max_tokens: int | None = None  # None = until the context is full or the model stops
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    model: str | None = None
    logprobs: int | None = None  # None: none; else each token's logprob and its top `logprobs` alternatives
    echo: bool = False  # /v1/completions: the prompt's text (with logprobs, its tokens') before the answer

    @property
    def engine_logprobs(self) -> int:
        """The engine's top-K: at least 1 when logprobs are asked for (it records them only for K > 0)."""
        return 0 if self.logprobs is None else max(1, self.logprobs)


# --- request parsing --------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict[str, Any]:
    try:  # UTF-8 by ourselves, strictly (json.loads of bytes let a surrogate's own bytes, ED A0 80, and
        # UTF-16 bodies through), a BOM allowed
        text = raw.decode("utf-8-sig")
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise APIError(400, f"the request body is not valid JSON ({reason})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    # a \ud800-\udfff escape not in a pair is valid JSON but no character: the tokenizer then raised a
    # TypeError, a 500 (a JavaScript client sends one where it cut a string inside an emoji)
    if "\\ud" in text.lower():
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                           "not in a pair), which is no character", code="invalid_json") from None
    return body


def _number(body, name, lo, hi, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(name, f"expected a number, got {json.dumps(v)}", "invalid_type")
    if not (v >= lo and v <= hi):  # written so that NaN (json.loads takes it) fails
        raise invalid(name, f"must be >= {lo:g} and <= {hi:g}, got {v}")
    return float(v)


def _integer(body, name, lo, default=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise invalid(name, f"expected an integer, got {json.dumps(v)}", "invalid_type")
    if v < lo:
        raise invalid(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(name, f"must be <= {hi}, got {v}")
    return v


def _boolean(body, name, default=False, param: str | None = None):
    """body[name] as a bool (null: default); param: the name errors give (a nested field's dotted path)."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(param or name, f"expected true or false, got {json.dumps(v)}", "invalid_type")
    return v


def _sampling(body) -> Sampling:
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    return Sampling(
        temperature=_number(body, "temperature", 0.0, MAX_TEMPERATURE, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),  # OpenAI's range; 0: the most likely token
        top_k=_integer({"top_k": top_k}, "top_k", 0, 0),
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        seed=_seed(body),
    )


def _seed(body) -> int | None:
    from strata_ray.config import SEED_MAX

    if body.get("seed") == -1:  # llama.cpp's "random": unseeded (as top_k's -1 is vLLM's "off")
        return None
    seed = _integer(body, "seed", INT64_MIN, hi=INT64_MAX)
    # the sampler hashes 64 unsigned bits: a negative seed is the same 64 bits the client's int64 holds, so
    # no two accepted seeds share a stream
    return None if seed is None else seed & SEED_MAX


def _max_tokens(body, echo: bool) -> int | None:
    """At least 1, or 0 with echo (a prompt scored, nothing generated: how evaluation harnesses ask)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _integer(body, name, 0 if echo else 1)


def _stop(body) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop", "expected a string or a list of strings", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} sequences, got {len(v)}")
    return tuple(s for s in v if s)


def _stream(body) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid("stream_options", "expected an object", "invalid_type")
    # checked without stream too: a typo is a typo
    include_usage = _boolean(options, "include_usage", param="stream_options.include_usage")
    return stream, include_usage and stream


def _logprobs(body, chat: bool) -> int | None:
    """How many top alternatives each token's logprobs list, or None for no logprobs. Chat asks with
    `logprobs: true` and `top_logprobs: N`; /v1/completions with `logprobs: N` (which lists the chosen token
    too, so up to N + 1)."""
    v = body.get("logprobs")
    if chat:
        on = v not in (None, False, 0)  # 0: what this server accepted as "off" before it had logprobs
        if on and v is not True:
            raise invalid("logprobs", f"expected true or false, got {json.dumps(v)}", "invalid_type")
        top = _integer(body, "top_logprobs", 0, 0)
        if top > MAX_LOGPROBS:
            raise invalid("top_logprobs", f"must be <= {MAX_LOGPROBS}, got {top}")
        if top and not on:
            raise invalid("top_logprobs", "needs \"logprobs\": true")
        return top if on else None
    if body.get("top_logprobs") not in (None, 0):
        raise invalid("top_logprobs", "not a /v1/completions field: ask for \"logprobs\": N")
    if v is None or v is False:
        return None
    n = _integer(body, "logprobs", 0)
    if n > MAX_LOGPROBS:
        raise invalid("logprobs", f"must be <= {MAX_LOGPROBS}, got {n}")
    return n


def _unsupported(body) -> None:
    """Asks this server cannot honour: refused by name, not ignored (a client that asks for JSON mode or a
    penalty must not get plain sampling back as if it had been applied)."""
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise invalid(name, "not supported by this server (no tool calling)")
    if body.get("tool_choice") not in (None, "none", "auto"):  # "required" or a named tool: a call to make
        raise invalid("tool_choice", "not supported by this server (no tool calling)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("response_format", 'only {"type": "text"}: this server does not constrain its output')
    if body.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias", "not supported by this server")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", "only 1 is supported (one engine generates one answer at a time)")
    # output controls of OpenAI (suffix: fill-in-the-middle), vLLM (guided_*, min_tokens, ignore_eos) and
    # llama-server (grammar, json_schema): set to anything but their neutral value, they would change the
    # answer, so they are refused rather than ignored
    for name, neutral in (("suffix", ("",)), ("guided_json", ()), ("guided_regex", ("",)),
                          ("guided_choice", ([],)), ("guided_grammar", ("",)), ("json_schema", ({},)),
                          ("grammar", ("",)), ("ignore_eos", (False,)), ("min_tokens", (0,))):
        v = body.get(name)
        if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
            raise invalid(name, "not supported by this server")
    # vLLM's repetition_penalty, llama.cpp's repeat_penalty: 1 is off; OpenAI's penalties: 0 is off
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("repeat_penalty", 1)):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(name, f"expected a number, got {json.dumps(v)}", "invalid_type")
        if v != neutral:
            raise invalid(name, f"not supported by this server (only {neutral})")


def _common(body, chat: bool) -> dict[str, Any]:
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise invalid("n", "only n=1 is supported (one engine generates one answer at a time)")
    _unsupported(body)
    logprobs = _logprobs(body, chat)
    if chat and body.get("echo") not in (None, False):
        raise invalid("echo", "a /v1/completions field (the prompt's text and logprobs before the answer)")
    echo = not chat and _boolean(body, "echo")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"expected a string, got {json.dumps(model)}", "invalid_type")
    stream, include_usage = _stream(body)
    return dict(max_tokens=_max_tokens(body, echo), sampling=_sampling(body), stop=_stop(body), stream=stream,
                include_usage=include_usage, model=model, logprobs=logprobs, echo=echo)


def _content_text(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text"} parts joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise invalid(where, 'only text parts ({"type": "text", "text": ...}) are supported')
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(where, f"expected a string or a list of text parts, got {json.dumps(content)}",
                  "invalid_type")


def _messages(body) -> tuple[tuple[dict, ...], dict]:
    """A chat request's messages and chat_template_kwargs (add_generation_prompt settled to a bool)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty list of {\"role\", \"content\"} objects",
                      "missing_field" if messages is None else "invalid_type")
    parsed = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, "expected an object with role and content", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {json.dumps(role)}")
        if m.get("content") is None and role != "assistant":  # as OpenAI: only an assistant's turn (its tool
            # calls) may come without content; a user's turn without it was served as an empty one
            raise invalid(f"{where}.content", f"a {role} message needs content (a string or a list of text "
                          "parts)", "missing_field")
        parsed.append({**{k: v for k, v in m.items() if k != "content"},
                       "content": _content_text(m.get("content"), f"{where}.content")})
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "expected an object", "invalid_type")
    if kwargs and "messages" in kwargs:
        raise invalid("chat_template_kwargs.messages", "not allowed: the messages come from the request")
    if kwargs:  # null: the default, true (prompt_ids passes the template true unless the request says)
        add = _boolean(kwargs, "add_generation_prompt", True, "chat_template_kwargs.add_generation_prompt")
        kwargs = {**kwargs, "add_generation_prompt": add}
    return tuple(parsed), dict(kwargs or {})


def parse_chat(body: dict[str, Any]) -> Completion:
    messages, kwargs = _messages(body)
    return Completion(chat=True, messages=messages, chat_template_kwargs=kwargs, **_common(body, chat=True))


@dataclass(frozen=True)
class TokenizeJob:
    """A /tokenize request: the text (or chat) whose ids a completion would run, and how to answer."""

    job: Completion
    add_special: bool  # False: no BOS even where the model adds one
    with_pieces: bool = False  # llama-server's [{"id", "piece"}] instead of bare ids
    token_strs: bool = False  # vLLM's return_token_strs: each id's vocabulary spelling too


def parse_tokenize(body: dict[str, Any]) -> TokenizeJob:
    """/tokenize as llama-server (`content`, `add_special` default false, `with_pieces`) and vLLM (`prompt`
    or `messages`, `add_special_tokens` default true, `add_generation_prompt`, `return_token_strs`) send it;
    the ids are those the completion endpoints run."""
    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) > 1:
        raise invalid(given[1], f"give one of content, prompt or messages, not {' and '.join(given)}")
    if not given:
        raise invalid("prompt", "is required (or content, or messages)", "missing_field")
    if given == ["messages"]:
        messages, kwargs = _messages(body)
        if "add_generation_prompt" not in kwargs:  # vLLM's top-level spelling
            kwargs["add_generation_prompt"] = _boolean(body, "add_generation_prompt", True)
        job = Completion(chat=True, messages=messages, chat_template_kwargs=kwargs)
    else:
        text = body[given[0]]
        if not isinstance(text, str):
            raise invalid(given[0], "expected a string (or \"messages\": a chat)", "invalid_type")
        job = Completion(chat=False, prompt=text)
    if body.get("add_special") is not None and body.get("add_special_tokens") is not None:
        raise invalid("add_special_tokens", "give add_special or add_special_tokens, not both")
    name = "add_special" if body.get("add_special") is not None else "add_special_tokens"
    add_special = _boolean(body, name, given != ["content"])  # each server's own default
    return TokenizeJob(job, add_special, _boolean(body, "with_pieces"), _boolean(body, "return_token_strs"))


def parse_detokenize(body: dict[str, Any], n_vocab: int) -> list[int]:
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        code = "missing_field" if ids is None else "invalid_type"
        raise invalid("tokens", "expected a list of token ids", code)
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise invalid("tokens", f"token id {bad} is out of range (vocabulary of {n_vocab})")
    return ids


def parse_text(body: dict[str, Any]) -> Completion:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return Completion(chat=False, prompt=prompt, **_common(body, chat=False))
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if is_ids and prompt:
        return Completion(chat=False, prompt_ids=tuple(prompt), **_common(body, chat=False))
    if prompt is None:
        raise invalid("prompt", "is required", "missing_field")
    raise invalid("prompt", "expected a string or a list of token ids (one prompt per request)",
                  "invalid_type")


# --- prompt -> token ids ----------------------------------------------------------------------------------


def encode(job: Completion, tokenizer, add_bos: bool, context: int | None = None) -> list[int]:
    """The ids of the request's text prompt or chat (the chat template applied); context: refused (400)
    where the text is too long for it whatever its tokens."""
    from strata_ray.model.tokenizer import ChatTemplateError

    text = job.prompt
    if job.chat:
        try:
            kwargs = dict(job.chat_template_kwargs)  # add_generation_prompt: true unless the request says
            add = kwargs.pop("add_generation_prompt", True)
            text = tokenizer.apply_chat_template(list(job.messages), add_generation_prompt=add, **kwargs)
        except (ChatTemplateError, TypeError) as e:
            raise invalid("messages", str(e).splitlines()[0]) from None
    if context is not None:
        least = tokenizer.fewest_tokens(text)  # a prompt that cannot fit is refused before its encode
        if not prompt_fits(least, context, job.max_tokens):
            raise context_exceeded(f"at least {least}", context, "messages" if job.chat else "prompt")
    return tokenizer.encode(text, add_bos=add_bos)


def context_exceeded(tokens: str, context: int, param: str) -> APIError:
    return APIError(400, too_long(tokens, context), param=param, code="context_length_exceeded")


def tokenize_doc(ids: list[int], token_bytes: Sequence[bytes], with_pieces: bool, context: int,
                 token_strs: Sequence[str] | None = None) -> dict:
    """/tokenize's answer in both servers' shapes: llama-server's `tokens` (ids, or {"id", "piece"} with
    with_pieces: the piece's text, or its bytes where they are not UTF-8 alone) and vLLM's `count`,
    `max_model_len` and, given the vocabulary's spellings, `token_strs`."""
    tokens: list = ids
    if with_pieces:
        tokens = [{"id": i, "piece": _piece(token_bytes[i])} for i in ids]
    doc = {"tokens": tokens, "count": len(ids), "max_model_len": context}
    if token_strs is not None:
        doc["token_strs"] = [token_strs[i] for i in ids]
    return doc


def _piece(b: bytes) -> str | list[int]:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def prompt_ids(job: Completion, tokenizer, add_bos: bool, context: int) -> list[int]:
    """Token ids of the request's prompt, checked against the vocabulary and the context."""
    param = "messages" if job.chat else "prompt"
    if job.prompt_ids is not None:
        ids = list(job.prompt_ids)
        bad = next((t for t in ids if not 0 <= t < tokenizer.n_vocab), None)
        if bad is not None:
            raise invalid("prompt", f"token id {bad} is out of range (vocabulary of {tokenizer.n_vocab})")
    else:
        ids = encode(job, tokenizer, add_bos, context)
    if not ids:
        raise invalid(param, "the prompt is empty")
    if not prompt_fits(len(ids), context, job.max_tokens):
        raise context_exceeded(str(len(ids)), context, param)
    return ids


# --- responses --------------------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(chat: bool, text: str | None, finish: str | None, delta: bool,
            logprobs: dict | None = None) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if delta:
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


LOGPROB_FLOOR = -9999.0  # a -inf or NaN log-probability, as vLLM sends it (JSON has no infinities)


def token_text(token_bytes: bytes) -> str:
    """A token's text: its UTF-8, or for a piece of a character split over tokens `bytes:\\xe2\\x98` (as
    OpenAI spells one), so that two such pieces never share a name (a completions top_logprobs key)."""
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else LOGPROB_FLOOR


def logprobs_doc(chat: bool, tokens, token_bytes: Sequence[bytes], top: int) -> dict[str, Any]:
    """A choice's `logprobs` in OpenAI's shape for tokens (text_stream.EmittedToken: id, offset, logprob,
    top pairs), `top` alternatives each; chat's `bytes` are each token's exact bytes."""

    def text(i: int) -> str:
        return token_text(token_bytes[i])

    if chat:
        def entry(i: int, lp: float) -> dict[str, Any]:
            return {"token": text(i), "logprob": _finite(lp), "bytes": list(token_bytes[i])}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top[:top]]} for t in tokens],
                "refusal": None}
    tops: list[dict | None] = []
    for t in tokens:  # the chosen token always listed, so up to top + 1 (OpenAI's completions)
        if t.logprob is None:  # an echoed prompt's first token: null, as OpenAI sends it
            tops.append(None)
            continue
        alternatives: dict[str, float] = {}
        for i, lp in t.top[:top]:
            alternatives.setdefault(text(i), _finite(lp))  # best first: a repeated name keeps its best
        alternatives[text(t.token_id)] = _finite(t.logprob)
        tops.append(alternatives)
    return {"tokens": [text(t.token_id) for t in tokens],
            "token_logprobs": [None if t.logprob is None else _finite(t.logprob) for t in tokens],
            "top_logprobs": tops, "text_offset": [t.offset for t in tokens]}


def response(chat: bool, rid: str, model: str, text: str, finish: str, prompt_tokens: int,
             completion_tokens: int, timings: dict | None = None,
             logprobs: dict | None = None, fingerprint: str | None = None) -> dict[str, Any]:
    """fingerprint: the server's system_fingerprint (runner.system_fingerprint), on every answer and chunk."""
    doc = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
           "model": model, "system_fingerprint": fingerprint,
           "choices": [_choice(chat, text, finish, delta=False, logprobs=logprobs)],
           "usage": usage(prompt_tokens, completion_tokens)}
    if timings is not None:
        doc["timings"] = timings
    return doc


def chunk(chat: bool, rid: str, model: str, text: str | None = None, finish: str | None = None,
          role: bool = False, logprobs: dict | None = None, created: int | None = None,
          usage_slot: bool = False, fingerprint: str | None = None) -> dict[str, Any]:
    """One SSE chunk; created: the stream's one timestamp (every chunk of a stream carries the same);
    usage_slot: `"usage": null`, as OpenAI sends on every chunk before the last where include_usage asks."""
    choice = _choice(chat, text, finish, delta=True, logprobs=logprobs)
    if role:
        choice["delta"] = {"role": "assistant", "content": ""}
    doc = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": int(time.time()) if created is None else created, "model": model,
           "system_fingerprint": fingerprint, "choices": [choice]}
    if usage_slot:
        doc["usage"] = None
    return doc


def usage_chunk(chat: bool, rid: str, model: str, prompt_tokens: int, completion_tokens: int,
                created: int | None = None, fingerprint: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": fingerprint, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(doc: dict[str, Any] | str) -> str:
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)}\n\n"


def model_entry(model: str, context: int, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "strata-ray",
            "max_model_len": context}


def models(model: str, context: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(model, context, created)]}
