"""Byte-level BPE tokenizer and chat template, built from the GGUF `tokenizer.*` keys (model-format.md §6).

Encoding runs in HF `tokenizers` (same construction as transformers' GGUF `Qwen2Tokenizer`); decoding maps
every token to its bytes here, so `decode` and the streaming decoder agree byte for byte.
"""

from __future__ import annotations

import codecs
import json
from datetime import datetime
from functools import cache, cached_property
from typing import TYPE_CHECKING

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from strata_ray.model.hparams import ModelFormatError

if TYPE_CHECKING:
    from strata_ray.model.gguf_file import GGUFFile

# token_type values (llama.cpp llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# pre-tokenizer split regexes by `tokenizer.ggml.pre` (llama.cpp llama-vocab.cpp); anything else: GPT-2's
PRE_TOKENIZER_REGEX = {
    "qwen2": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
        r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
    "llama-bpe": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
        r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    ),
}
DEFAULT_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NFC_PRE = {"qwen2"}  # HF Qwen2Tokenizer normalizes NFC; llama.cpp does not (identical for NFC input)

# Used when a file carries no template: ChatML, the format of every Qwen3 model.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
STOP_TOKEN_TEXTS = ("<|im_end|>", "<|endoftext|>")


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its raise_exception) or failed to render; one line."""


# texts longer than this (characters) encode through encode_batch, which releases the GIL: encode holds it,
# and a 3 MB prompt held the server's event loop for ~3 s (/health unanswered); short texts keep encode, so
# an everyday prompt never starts the library's thread pool
LONG_TEXT = 1 << 16


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2 `bytes_to_unicode` inverted: the printable character that spells each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_encoder() -> dict[int, str]:
    return {b: c for c, b in byte_decoder().items()}


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): render the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; HF templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(f"chat template does not parse: {e.message} (line {e.lineno})") from None


def check_tokenizer_keys(fields) -> list[str]:
    """The vocabulary of a GGUF's tokenizer keys; ModelFormatError where this engine builds no tokenizer from
    them. GGUFFile.check_model calls it in the driver too: the primary found it after Ray and the load."""
    model = fields.get("tokenizer.ggml.model", "gpt2")
    if model != "gpt2":
        raise ModelFormatError(f"unsupported tokenizer model {model!r} (supported: gpt2 byte-level BPE)")
    if "tokenizer.ggml.tokens" not in fields:
        raise ModelFormatError("missing GGUF key tokenizer.ggml.tokens (vocabulary)")
    return fields["tokenizer.ggml.tokens"]


class StreamDecoder:
    """Token ids in, text out, only ever complete UTF-8 characters (a character split over tokens waits)."""

    def __init__(self, token_bytes: list[bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        """End of stream: whatever bytes are still pending (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None,
        pre: str = "qwen2",
        eot_id: int | None = None,
        pad_id: int | None = None,
    ):
        if len(token_types) != len(tokens):
            raise ModelFormatError(f"tokenizer has {len(tokens)} tokens but {len(token_types)} token types")
        self.tokens, self.token_types, self.pre = tokens, token_types, pre
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.chat_template = chat_template
        self.n_vocab = len(tokens)
        self._hf = self._build_hf(tokens, token_types, merges, pre)
        self._token_bytes: list[bytes] | None = None
        self._template: jinja2.Template | None = None

        ids = {t: i for i, t in enumerate(tokens)}
        self.stop_ids: set[int] = {i for i in (eos_id, eot_id) if i is not None}
        self.stop_ids |= {ids[t] for t in STOP_TOKEN_TEXTS if t in ids}

    @classmethod
    def from_spec(
        cls,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None,
        pre: str = "qwen2",
        pad_id: int | None = None,
    ) -> Tokenizer:
        """Without a file (fields as in gguf_writer.TokenizerSpec, so `from_spec(**asdict(spec))` works)."""
        return cls(tokens, token_types, merges, bos_id, eos_id, chat_template, pre, pad_id=pad_id)

    @classmethod
    def from_gguf(cls, file: GGUFFile) -> Tokenizer:
        f = file.fields
        tokens = check_tokenizer_keys(f)
        return cls(
            tokens,
            f.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)),
            f.get("tokenizer.ggml.merges", []),
            f.get("tokenizer.ggml.bos_token_id"),
            f.get("tokenizer.ggml.eos_token_id"),
            f.get("tokenizer.chat_template"),
            str(f.get("tokenizer.ggml.pre", "default")),
            f.get("tokenizer.ggml.eot_token_id"),
            f.get("tokenizer.ggml.padding_token_id"),
        )

    @staticmethod
    def _build_hf(tokens: list[str], types: list[int], merges: list[str], pre: str) -> HFTokenizer:
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for m in merges:  # checked here: tokenizers panics (a BaseException) on a merge result not in vocab
            left, sep, right = m.partition(" ")
            if not sep or left not in vocab or right not in vocab or left + right not in vocab:
                raise ModelFormatError(f"tokenizer merge {m!r} does not combine two tokens of the vocabulary")
            pairs.append((left, right))
        bpe = BPE(vocab=vocab, merges=pairs, unk_token=None, fuse_unk=False, byte_fallback=False)
        tk = HFTokenizer(bpe)
        if pre in NFC_PRE:
            tk.normalizer = normalizers.NFC()
        regex = PRE_TOKENIZER_REGEX.get(pre, DEFAULT_REGEX)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tk.decoder = decoders.ByteLevel()
        # specials (<|im_start|>) match as whole tokens in input text; user-defined ones too, unnormalized
        tk.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, y in zip(tokens, types, strict=True)
                if y == CONTROL
            ]
        )
        tk.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, y in zip(tokens, types, strict=True)
                if y == USER_DEFINED
            ]
        )
        return tk

    # ---- text <-> ids --------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if len(text) > LONG_TEXT:  # the same ids, the GIL released while they are made
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    @property
    def token_bytes(self) -> list[bytes]:
        """The bytes of each id (byte-level spelling undone; added tokens are their own UTF-8 text)."""
        if self._token_bytes is None:
            dec = byte_decoder()
            out = []
            for tok, typ in zip(self.tokens, self.token_types, strict=True):
                if typ in (CONTROL, USER_DEFINED) or any(c not in dec for c in tok):
                    out.append(tok.encode("utf-8"))
                else:
                    out.append(bytes(dec[c] for c in tok))
            self._token_bytes = out
        return self._token_bytes

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one id spells: a text of B bytes takes at least B / this many tokens, before the
        normalizer (serve's early context check allows for NFC's shrinking)."""
        return max(map(len, self.token_bytes), default=1)

    def fewest_tokens(self, text: str) -> int:
        """A floor on len(encode(text)), found without encoding it: no id spells more than max_token_bytes
        bytes, and the normalizer's NFC makes a text at most 4x shorter (3 Hangul jamo -> one syllable is 3x).
        A prompt that cannot fit the context is refused on it before its encode (a 20 MB prompt took 22 s of
        CPU to be refused after it)."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // (4 * max(1, self.max_token_bytes)))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        tb = self.token_bytes
        bad = next((i for i in ids if not 0 <= i < len(tb)), None)
        if bad is not None:  # a negative id would silently index from the end
            raise ValueError(f"token id {bad} is out of range (vocabulary of {len(tb)} tokens)")
        if skip_special:
            ids = [i for i in ids if self.token_types[i] != CONTROL]
        return b"".join(tb[i] for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.token_bytes)

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled exactly `text` (e.g. '<|im_end|>'), or None."""
        return self._hf.token_to_id(text)

    def _token_text(self, token_id: int | None) -> str:
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < self.n_vocab else ""

    # ---- chat ----------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the GGUF's Jinja chat template (ChatML when absent) like transformers does."""
        if self._template is None:
            self._template = _compile_template(self.chat_template or CHATML_TEMPLATE)
        special = {"bos_token": self._token_text(self.bos_id), "eos_token": self._token_text(self.eos_id)}
        try:
            return self._template.render(
                **{**special, **kwargs}, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
