"""Driving any OpenAI-compatible server (ours, llama-server, vLLM, ...) with streamed requests.

Standard library only, so it runs next to any server. A request streams `/v1/chat/completions` (or
`/v1/completions` with `--api completions`) with `stream_options: {include_usage: true}`; each content
chunk is an arrival for the clock in measure.py. Token counts come from the final usage chunk; a server
that sends none is counted by chunks (one token per chunk) and the prompt by our own estimate.

Without the model file, a prompt's length is counted by the server's `/tokenize` where it has one that takes
the request's messages or prompt (ours, vLLM); elsewhere (llama-server's takes `content` only) it is
estimated.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from strata_ray.bench.measure import ArrivalClock, RunTiming
from strata_ray.bench.prompts import Prompt

TIMEOUT_S = 3600.0  # a 128K-token prompt on a slow server can take many minutes


def wire_seed(seed: int) -> int:
    """A sampler seed (64 unsigned bits) as OpenAI's `seed`, an int64: one past 2**63 - 1 as its two's
    complement, which our server maps back to the same 64 bits (serve/openai_api), so a seeded bench over
    --url draws what the same --seed draws in-process; servers refuse seeds past the int64 range.
    2**64 - 1 would be -1, llama.cpp's "unseeded": check_wire_seed refuses it before the run."""
    return seed - 2**64 if seed >= 2**63 else seed


def check_wire_seed(seed: int | None) -> None:
    """ValueError (one line) for the one seed --url cannot send: 2**64 - 1, whose int64 is -1 ("unseeded")."""
    if seed is not None and wire_seed(seed) == -1:
        raise ValueError(f"--seed {seed} cannot be sent to a server: its int64 form is -1, which servers "
                         "take as unseeded; pick another seed")


class ServerError(RuntimeError):
    """The server refused a request or cannot be reached; one line."""


def base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/v1' or 'http://h:8000/v1/' -> 'http://h:8000/v1'."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class HttpRunner:
    def __init__(self, url: str, model: str | None = None, api: str = "chat", token_ids: bool = True,
                 api_key: str | None = None):
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, not {api!r}")
        self.base = base_url(url)
        self.api_key = api_key
        self.api = api
        self.token_ids = token_ids
        self._models: list[dict] | None = None
        self.model = model or self.first_model()

    # ---- plain requests --------------------------------------------------------------------------------

    def _open(self, path: str, body: dict | None = None, root: bool = False):
        """path under /v1, or under the server's root (root=True: /tokenize)."""
        url = (self.base.removesuffix("/v1") if root else self.base) + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "*/*"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace").strip().splitlines()
            first = detail[0][:200] if detail else e.reason
            raise ServerError(f"{url}: HTTP {e.code} {first}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"{url}: cannot connect ({reason})") from None

    def listed_models(self) -> list[dict]:
        """The entries the server lists at /v1/models (asked once: the model name, then its context)."""
        if self._models is None:
            with self._open("/models") as resp:
                models = json.loads(resp.read().decode("utf-8")).get("data") or []
            self._models = [m for m in models if isinstance(m, dict)]
        return self._models

    def first_model(self) -> str:
        """The first model the server lists at /v1/models ('default' when it lists none)."""
        models = self.listed_models()
        return str(models[0].get("id", "default")) if models else "default"

    def served_entry(self) -> dict | None:
        """/v1/models' entry of the model the requests reach: the one of the name asked for, else the only
        one the server lists (the one it serves, whatever the name asked for: ours and llama-server do not
        check it); None where it lists neither or has no /v1/models (a gateway's)."""
        try:
            models = self.listed_models()
        except ServerError:
            return None
        only = models[0] if len(models) == 1 else None
        return next((m for m in models if m.get("id") == self.model), only)

    def served_name(self) -> str:
        """The name of the model measured, as the server's /v1/models gives it (else the name asked for)."""
        entry = self.served_entry()
        return str(entry["id"]) if entry is not None and entry.get("id") is not None else self.model

    def served_context(self) -> int | None:
        """The context the server gives the model it is asked for: /v1/models' max_model_len (ours, vLLM);
        None where it says none or has no /v1/models."""
        entry = self.served_entry()
        return _positive_int(None if entry is None else entry.get("max_model_len"))

    def _content_fields(self, content: str) -> dict:
        """The request's prompt: one user message (thinking off) for the chat API, else the text."""
        if self.api == "chat":
            return {"messages": [{"role": "user", "content": content}],
                    "chat_template_kwargs": {"enable_thinking": False}}
        return {"prompt": content}

    def count_tokens(self, content: str) -> int | None:
        """The tokens the server would run for content sent as payload() sends it (chat template and all),
        from its /tokenize; None where it has none, or one that does not take this request's shape."""
        body = {"model": self.model, **self._content_fields(content)}
        try:
            with self._open("/tokenize", body, root=True) as resp:
                doc = json.loads(resp.read().decode("utf-8"))
        except (ServerError, ValueError):
            return None
        n = doc.get("count") if isinstance(doc, dict) else None
        if n is None and isinstance(doc, dict) and isinstance(doc.get("tokens"), list):
            n = len(doc["tokens"])
        return _positive_int(n)  # not 0: llama-server's answer to a body without `content` (an empty list)

    # ---- one timed generation --------------------------------------------------------------------------

    def payload(self, prompt: Prompt, max_tokens: int, sampling) -> dict:
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.min_p:
            body["min_p"] = sampling.min_p
        if sampling.seed is not None:
            body["seed"] = wire_seed(sampling.seed)
        body.update(self._content_fields(prompt.content))
        if self.token_ids:
            body["return_token_ids"] = True  # servers that know it (vLLM) send the ids; others ignore it
        return body

    def run(self, prompt: Prompt, max_tokens: int, sampling) -> RunTiming:
        path = "/chat/completions" if self.api == "chat" else "/completions"
        clock = ArrivalClock()
        text, ids, usage = [], [], None
        with self._open(path, self.payload(prompt, max_tokens, sampling)) as resp:
            for event in sse_events(resp):
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    piece = _choice_text(choice)
                    new_ids = choice.get("token_ids") or []
                    if piece or new_ids:
                        clock.arrived(len(new_ids) or 1)
                        text.append(piece)
                        ids.extend(int(i) for i in new_ids)
        usage = usage or {}
        prompt_tokens = int(usage.get("prompt_tokens", prompt.n_tokens))
        generated = int(usage["completion_tokens"]) if "completion_tokens" in usage else None
        timing = clock.timing(prompt_tokens, generated, token_ids=tuple(ids) if ids else None,
                              text="".join(text))
        if generated is not None and not ids and generated > 0:
            # chunks carry text, not counts: the reference method, (completion_tokens - 1) over first..last
            timing = RunTiming(**{**timing.__dict__, "decode_tokens": generated - 1})
        return timing


def _positive_int(n) -> int | None:
    """n where it is an integer > 0 (a server's count or length), else None."""
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _choice_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


def sse_events(resp):
    """The JSON objects of a text/event-stream response, until `data: [DONE]`."""
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise ServerError(f"the server sent a stream line that is not JSON: {data[:120]!r}") from None
        if isinstance(event, dict) and event.get("error"):
            err = event["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise ServerError(f"the server reported: {message}")
        yield event
