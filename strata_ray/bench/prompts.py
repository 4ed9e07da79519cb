"""The prompts flashbench sends: fixed-corpus prompts of an exact token length, the story, and the gates.

Every prompt is one user message of a chat: `head + body + tail`, where the body is a token slice of a
fixed corpus (Python's language reference, `pydoc_data.topics`, which ships with every interpreter) or
of fixed standard-library source (the code gate). A benchmark prompt starts with a random
`[bench-id <16 hex>]` so no prefix cache can help; the gates use an all-zero id so they are the same
every time.

With a tokenizer (our engine, or `--url` with `--model`), prompts are assembled at the token level: the
chat template is rendered around a placeholder and each part encoded separately, so the prompt has
exactly the requested number of tokens. Without one (`--url` alone) a server that counts tokens at its
/tokenize (`count_tokens`) sizes the text: its length is scaled by wanted / counted until the count is within
COUNTED_TOLERANCE below the wanted number (a few requests). Without that the length is estimated at
CHARS_PER_TOKEN characters per token until a server's usage report gives the true count of a prompt
(`observe`): later estimates are scaled by its true / estimated ratio, and a prompt cut to an estimated
fit keeps ESTIMATE_SLACK of the room.
"""

from __future__ import annotations

import importlib.util
import secrets
from dataclasses import dataclass

CHARS_PER_TOKEN = 3.3  # estimate for servers whose tokenizer we do not have
ESTIMATED_OVERHEAD_TOKENS = 90  # head, tail and chat template, without a tokenizer
CONTEXT_MARGIN = 8  # tokens kept free below the model's context so prompt + generation always fit
# an estimated prompt keeps within this share of the room: the observed ratio comes from other text (a
# longer prompt reads further into the corpus, whose density differs; a review measured a 32K cut at 95%
# over a 32K context by ~60 tokens on a tokenizer trained elsewhere)
ESTIMATE_SLACK = 0.9
COUNTED_TOLERANCE = 0.01  # a counted prompt may fall this share short of the tokens asked for, never over
COUNTED_STEPS = 8  # /tokenize requests a prompt at most
ZERO_ID = "0" * 16
PLACEHOLDER = "\x00STRATA_BODY\x00"

# Short fixed text: with a byte-level vocabulary every character is a token, and tests use tiny contexts.
BENCH_HEAD = "[bench-id {id}]\nRead this excerpt of the Python reference:\n\n"
BENCH_TAIL = "\n\nNow explain it at length, with examples. Do not stop early."
STORY_PROMPT = (
    "[bench-id {id}]\nWrite a long story, about 3,000 words, about a lighthouse keeper who finds a "
    "message in a bottle and decides to answer it. Do not stop early."
)
GATE_CHAT = "Explain in plain words how a refrigerator works, step by step."
GATE_MATH = (
    "A train leaves a station at 09:40 and travels 210 km at an average speed of 84 km/h. It then waits "
    "12 minutes and travels another 96 km at 72 km/h. At what time does it arrive? Show your reasoning step "
    "by step."
)
GATE_CODE_HEAD = (
    "[bench-id {id}]\nYou are an expert Python reviewer. Review the following standard-library code: "
    "find bugs, explain what each function does, and suggest improvements.\n\n```python\n"
)
GATE_CODE_TAIL = "\n```\n\nWrite your review now."
GATE_LONG_HEAD = (
    "[bench-id {id}]\nRead the following excerpt of the Python language reference carefully.\n\n"
)
GATE_LONG_TAIL = "\n\nSummarise the excerpt above section by section, in order."
# Fixed pure-Python standard-library modules whose source makes the code gate's body.
CODE_MODULES = ("heapq", "bisect", "textwrap", "fnmatch", "shlex", "graphlib", "colorsys", "difflib")
GATE_CODE_TOKENS = 4096
GATE_LONG_TOKENS = 20480


class PromptError(ValueError):
    """A prompt that cannot be built for this model (context too small); one line."""


@dataclass(frozen=True)
class Prompt:
    name: str
    content: str  # the user message, as sent to an OpenAI-compatible server
    ids: tuple[int, ...] | None  # chat-templated token ids for our engine; None without a tokenizer
    n_tokens: int  # exact with a tokenizer, else an estimate
    note: str | None = None  # e.g. why the prompt was cut


def random_bench_id() -> str:
    return secrets.token_hex(8)


def corpus_documents() -> list[str]:
    """The language reference, one document per topic, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics)]


def code_documents() -> list[str]:
    """Source of CODE_MODULES (read from the files, not imported)."""
    docs = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as f:
                docs.append(f.read())
    return docs


class TokenCorpus:
    """Token ids of a list of documents, encoded lazily (only as far as asked) and repeated if too short."""

    def __init__(self, tokenizer, documents: list[str]):
        self.tokenizer = tokenizer
        self.documents = documents
        self.ids: list[int] = []
        self._next_doc = 0

    def take(self, n: int) -> list[int]:
        if not self.documents:
            raise PromptError("the prompt corpus is empty in this Python installation")
        while len(self.ids) < n:
            doc = self.documents[self._next_doc % len(self.documents)]
            self.ids.extend(self.tokenizer.encode(doc + "\n\n"))
            self._next_doc += 1
        return self.ids[:n]


class PromptBuilder:
    """Builds prompts for one model. tokenizer None = estimate lengths (a foreign server)."""

    def __init__(self, tokenizer=None, context_length: int | None = None, add_bos: bool = False,
                 count_tokens=None):
        """count_tokens: without a tokenizer, content -> the server's token count of it as a request (or
        None); prompts are then sized by it instead of estimated."""
        self.tokenizer = tokenizer
        self.count_tokens = None if tokenizer else count_tokens
        self.context_length = context_length
        self.add_bos = add_bos  # as the engine tokenizes a prompt (GGUF tokenizer.ggml.add_bos_token)
        self._corpus = TokenCorpus(tokenizer, corpus_documents()) if tokenizer else None
        self._code = TokenCorpus(tokenizer, code_documents()) if tokenizer else None
        self._char_corpus: str | None = None
        self.scale = 1.0  # without a tokenizer: a server's true tokens / our estimate, last observed

    # ---- fitting to the model's context ----------------------------------------------------------------

    def max_prompt_tokens(self, gen_tokens: int) -> int | None:
        """The longest prompt that leaves room for gen_tokens (None = unknown context)."""
        if self.context_length is None:
            return None
        return self.context_length - gen_tokens - CONTEXT_MARGIN

    def check_room(self, gen_tokens: int) -> None:
        """PromptError where gen_tokens generated ones leave no room for a prompt in the model's context (an
        unknown context: none): bench checks it from the model's header, before the load."""
        limit = self.max_prompt_tokens(gen_tokens)
        if limit is not None and limit < 1:
            raise self._no_room(gen_tokens)

    def _no_room(self, gen_tokens: int) -> PromptError:
        return PromptError(f"no prompt fits the model's context of {self.context_length} tokens beside "
                           f"{gen_tokens} generated ones")

    def fit(self, n_tokens: int, gen_tokens: int) -> tuple[int, str | None]:
        """(tokens to use, note) for a prompt of n_tokens followed by gen_tokens generated ones."""
        limit = self.max_prompt_tokens(gen_tokens)
        if limit is not None and self.tokenizer is None and self.count_tokens is None:  # an estimate near
            # the limit may be over it
            limit = int(limit * ESTIMATE_SLACK)
        if limit is None or n_tokens <= limit:
            return n_tokens, None
        if limit < 1:  # was "cut from 1024 to -2960 tokens", then a second line about that prompt
            raise self._no_room(gen_tokens)
        return limit, (
            f"prompt cut from {n_tokens} to {limit} tokens to fit the model's context of "
            f"{self.context_length} with {gen_tokens} generated tokens"
        )

    # ---- assembly --------------------------------------------------------------------------------------

    def chat_parts(self, head: str, tail: str) -> tuple[list[int], list[int], str, str]:
        """(ids before the body, ids after it, head, tail) with the chat template applied around them."""
        tok = self.tokenizer
        rendered = tok.apply_chat_template([{"role": "user", "content": head + PLACEHOLDER + tail}])
        before, _, after = rendered.partition(PLACEHOLDER)
        return tok.encode(before, add_bos=self.add_bos), tok.encode(after), head, tail

    def assemble(self, name: str, head: str, tail: str, corpus: TokenCorpus | None, n_tokens: int,
                 note: str | None = None) -> Prompt:
        """A prompt of n_tokens tokens in all (template included) whose body is the start of corpus."""
        if self.tokenizer is None:
            return self._estimate(name, head, tail, n_tokens, note)
        pre, post, head, tail = self.chat_parts(head, tail)
        n_body = n_tokens - len(pre) - len(post)
        if n_body < 1:
            raise PromptError(
                f"{name}: a prompt of {n_tokens} tokens is shorter than its fixed text "
                f"({len(pre) + len(post) + 1} tokens at least)"
            )
        body = corpus.take(n_body)
        content = head + self.tokenizer.decode(body) + tail
        return Prompt(name, content, tuple(pre + body + post), n_tokens, note)

    def _estimate(self, name: str, head: str, tail: str, n_tokens: int, note: str | None) -> Prompt:
        if self._char_corpus is None:
            self._char_corpus = "\n\n".join(corpus_documents())
        chars = max(1, int((n_tokens / self.scale - ESTIMATED_OVERHEAD_TOKENS) * CHARS_PER_TOKEN))
        if self.count_tokens is not None:
            return self._counted(name, head, tail, n_tokens, chars, note)
        return Prompt(name, head + self._body(chars) + tail, None, n_tokens, note)

    def _body(self, chars: int) -> str:
        text = self._char_corpus
        return (text * (chars // len(text) + 1))[:chars]

    def _counted(self, name: str, head: str, tail: str, n_tokens: int, chars: int,
                 note: str | None) -> Prompt:
        """The longest body the server counts at most n_tokens for (within COUNTED_TOLERANCE): from the
        estimate, each step aims just under n_tokens along the line through the last two counts (the chat
        template and the fixed text are a share of the count that the body's length does not move)."""
        aim = n_tokens * (1 - COUNTED_TOLERANCE / 2)
        seen: list[tuple[int, int, str]] = []  # (chars, counted, content)
        for _ in range(COUNTED_STEPS):
            content = head + self._body(chars) + tail
            counted = self.count_tokens(content)
            if counted is None:  # the server stopped counting: an estimate after all
                break
            seen.append((chars, counted, content))
            there = n_tokens * (1 - COUNTED_TOLERANCE) <= counted <= n_tokens
            if there or (chars == 1 and counted > n_tokens):  # or the fixed text alone is longer: sent so
                break
            (c0, n0, _), (c1, n1, _) = seen[-2] if len(seen) > 1 else (0, 0, ""), seen[-1]
            if len(seen) > 1 and n1 != n0 and (n1 - n0) * (c1 - c0) > 0:
                step = c1 + (aim - n1) * (c1 - c0) / (n1 - n0)  # secant
            else:
                step = c1 * aim / n1  # proportional, the template's share unknown yet
            step = max(1, int(step))
            chars = step if step != chars else max(1, chars + (1 if counted < n_tokens else -1))
        if not seen:
            return Prompt(name, head + self._body(chars) + tail, None, n_tokens, note)
        under = [s for s in seen if s[1] <= n_tokens]
        _, counted, content = max(under, key=lambda s: s[1]) if under else min(seen, key=lambda s: s[1])
        return Prompt(name, content, None, counted, note)

    def observe(self, prompt: Prompt, prompt_tokens: int) -> None:
        """A server counted prompt_tokens for a prompt we estimated: the later estimates are scaled by the
        ratio (a foreign tokenizer's; ~2.4x as many tokens as estimated on the tiny test model's). Still an
        estimate: the template's share and the text's density differ between prompts, so fit keeps
        ESTIMATE_SLACK of the room, and a prompt near the context can still be over it (the server then
        refuses it in one line; --model gives exact lengths)."""
        estimated = prompt.n_tokens / self.scale  # as _estimate sized it
        estimate = self.tokenizer is None and self.count_tokens is None and prompt.ids is None
        if estimate and prompt_tokens > 0 and estimated > 0:
            self.scale = prompt_tokens / estimated

    def message(self, name: str, content: str, note: str | None = None) -> Prompt:
        """A short fixed prompt (no body): the chat template around content."""
        if self.tokenizer is None:
            counted = None if self.count_tokens is None else self.count_tokens(content)
            estimate = int(len(content) / CHARS_PER_TOKEN) + 10
            return Prompt(name, content, None, counted or estimate, note)
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": content}])
        ids = self.tokenizer.encode(rendered, add_bos=self.add_bos)
        return Prompt(name, content, tuple(ids), len(ids), note)

    # ---- the prompts -----------------------------------------------------------------------------------

    def bench_prompt(self, n_tokens: int, gen_tokens: int, bench_id: str | None = None) -> Prompt:
        """A corpus prompt of n_tokens (cut to fit the context) with a random bench id."""
        n, note = self.fit(n_tokens, gen_tokens)
        head = BENCH_HEAD.format(id=bench_id or random_bench_id())
        return self.assemble(f"ctx{n_tokens}", head, BENCH_TAIL, self._corpus, n, note)

    def story_prompt(self, bench_id: str | None = None) -> Prompt:
        return self.message("story", STORY_PROMPT.format(id=bench_id or random_bench_id()))

    def story_tokens(self, story: Prompt, wanted: int) -> tuple[int, str | None]:
        """How many story tokens fit after the story prompt."""
        if self.context_length is None:
            return wanted, None
        room = self.context_length - story.n_tokens - CONTEXT_MARGIN
        if wanted <= room:
            return wanted, None
        return room, f"story cut from {wanted} to {room} tokens to fit the model's context of " \
            f"{self.context_length}"

    def gate_prompts(self, gen_tokens: int) -> list[Prompt]:
        """chat, code (~4K tokens), math: fixed, greedy, compared by token ids."""
        n, note = self.fit(GATE_CODE_TOKENS, gen_tokens)
        code = self.assemble("code", GATE_CODE_HEAD.format(id=ZERO_ID), GATE_CODE_TAIL, self._code, n, note)
        return [self.message("chat", GATE_CHAT), self.canonical(code), self.message("math", GATE_MATH)]

    def longgate_prompts(self, gen_tokens: int) -> list[Prompt]:
        """One ~20K-token corpus prompt."""
        n, note = self.fit(GATE_LONG_TOKENS, gen_tokens)
        head = GATE_LONG_HEAD.format(id=ZERO_ID)
        return [self.canonical(self.assemble("long", head, GATE_LONG_TAIL, self._corpus, n, note))]

    def canonical(self, prompt: Prompt) -> Prompt:
        """The prompt tokenized from its text, as a server would, so a saved gate prompt (its text) gives
        the same ids again; a corpus slice decoded and encoded again can differ at its edges."""
        return self.message(prompt.name, prompt.content, prompt.note)


def parse_token_count(text: str) -> int:
    """'8192', '8k', '8K' (x1024) or '1m' -> tokens. Raises ValueError with the allowed forms."""
    from strata_ray.config import decimal

    s = text.strip().lower()  # a list's items: "8k, 32k" as "8k,32k"
    scale = 1
    if s.endswith("k"):
        s, scale = s[:-1], 1024
    elif s.endswith("m"):
        s, scale = s[:-1], 1024 * 1024
    try:
        value = decimal(s) * scale
    except ValueError:
        raise ValueError("token counts such as 8192 or 8k (k = 1024)") from None
    if value < 1:
        raise ValueError("token counts >= 1, such as 8192 or 8k (k = 1024)")
    return value
