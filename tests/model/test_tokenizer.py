"""Tokenizer from GGUF keys: BPE encode/decode, specials, the qwen2 split, streaming UTF-8, chat templates."""

from __future__ import annotations

import json
import random
import string
import threading
import time

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.hparams import ModelFormatError
from strata_ray.model.tokenizer import LONG_TEXT, ChatTemplateError, Tokenizer, byte_encoder

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog. Hello world! héllo wörld 123 4567\n\n  indented"] * 20
TEXTS = [
    "the quick brown fox",
    "Hello world!\n\n  indented\tand tabs   ",
    "héllo wörld, naïve café — 12345 ∑ 日本語 🦊🦊",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]


def trained_vocab() -> tuple[list[str], list[int], list[str]]:
    """A real byte-level BPE (256-byte alphabet + learned merges) plus ChatML specials as CONTROL tokens."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator(CORPUS, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens + SPECIALS, [1] * len(tokens) + [3] * len(SPECIALS), merges


# the least a qwen3moe GGUFFile needs besides the vocabulary (its hparams are parsed on open)
ARCH_KEYS = {
    "block_count": 1,
    "context_length": 64,
    "embedding_length": 8,
    "attention.head_count": 2,
    "attention.head_count_kv": 1,
    "expert_count": 2,
    "expert_used_count": 1,
    "expert_feed_forward_length": 8,
}
TEMPLATE = (
    "{%- for m in messages %}\n"
    "    {%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system message must come first') }}{%- endif %}\n"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    tokens, types, merges = trained_vocab()
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    for key, v in ARCH_KEYS.items():
        w.add_uint32(f"qwen3moe.{key}", v)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(gguf_path))


def test_round_trip_and_merges_apply(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("the quick brown fox")
    assert len(ids) < len("the quick brown fox") // 2  # learned merges were used, not bytes
    assert tok.encode("日本") == [tok.token_id(byte_encoder()[b]) for b in "日本".encode()]  # unseen: bytes


def test_specials_are_single_ids(tok):
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert im_start not in tok.encode("<|im_start")  # an incomplete special is plain text
    assert tok.stop_ids == {tok.eos_id, im_end}
    assert tok.bos_id == tok.eos_id == tok.token_id("<|endoftext|>")
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id and tok.encode("hi")[0] != tok.bos_id
    assert tok.decode(ids, skip_special=True) == "user\nhi"


def test_matches_transformers_qwen2_tokenizer(tok, gguf_path):
    """Independent reference: transformers builds its own Qwen2Tokenizer from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_qwen2_splits_digits_one_by_one_default_does_not():
    enc = byte_encoder()
    tokens = [enc[b] for b in range(256)] + ["12", "123"]
    types = [1] * len(tokens)
    merges = ["1 2", "12 3"]
    qwen2 = Tokenizer.from_spec(tokens, types, merges, None, None, None)
    generic = Tokenizer.from_spec(tokens, types, merges, None, None, None, pre="default")
    assert qwen2.encode("123") == [ord("1"), ord("2"), ord("3")]
    assert generic.encode("123") == [257]
    assert qwen2.stop_ids == set() and qwen2.bos_id is None


def test_stream_decoder_emits_only_complete_utf8(tok):
    text = "a€b 🦊 é"
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text == tok.decode(ids)
    assert "" in pieces  # the fox (4 bytes) and € (3 bytes) span several tokens: partial pushes emit nothing
    assert all("\ufffd" not in p for p in pieces)
    fox = tok.encode("🦊")
    assert len(fox) == 4
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in fox] == ["", "", "", "🦊"]
    dec = tok.stream_decoder()
    assert dec.push(fox[0]) == "" and dec.flush() == "\ufffd"  # stream ended mid-character


def test_chat_template_from_gguf(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = tok.apply_chat_template(msgs)
    assert (
        out
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    with pytest.raises(ChatTemplateError, match="^chat template: system message must come first$"):
        tok.apply_chat_template(msgs[::-1])


def test_chat_template_helpers_and_sandbox():
    enc = byte_encoder()
    tokens = [enc[b] for b in range(256)] + SPECIALS
    types = [1] * 256 + [3] * 3

    def render(template, **kw):
        t = Tokenizer.from_spec(tokens, types, [], None, 256, template)
        return t.apply_chat_template([{"role": "user", "content": "<b>&'x'</b>"}], **kw)

    assert (
        render("{{ messages[0] | tojson }}") == '{"role": "user", "content": "<b>&\'x\'</b>"}'
    )  # no HTML escape
    assert render("{{ eos_token }}|{{ bos_token }}|{{ tools | length }}", tools=[1, 2]) == "<|endoftext|>||2"
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert render("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "01"
    assert render("{% generation %}ok{% endgeneration %}") == "ok"
    assert render("  {% if true %}\nA\n  {% endif %}\n") == "A\n"  # trim_blocks + lstrip_blocks, as in HF
    with pytest.raises(ChatTemplateError):
        render("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        render("{{ messages.append(1) }}")  # immutable sandbox
    with pytest.raises(ModelFormatError, match=r"^chat template does not parse: .* \(line 1\)$"):
        render("{% for %}")


def test_from_spec_takes_a_writer_spec():
    """gguf_writer.TokenizerSpec fields map one to one onto from_spec (no file needed)."""
    tokens, types, merges = trained_vocab()
    spec = dict(tokens=tokens, token_types=types, merges=merges, bos_id=None, eos_id=len(tokens) - 1,
                chat_template=None, pre="qwen2", pad_id=len(tokens) - 3)  # fmt: skip
    t = Tokenizer.from_spec(**spec)
    assert t.pad_id == len(tokens) - 3 and t.decode(t.encode("héllo wörld")) == "héllo wörld"


def test_chatml_fallback_without_template():
    tokens, types, merges = trained_vocab()
    t = Tokenizer.from_spec(tokens, types, merges, None, len(tokens) - 1, None)
    out = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_errors_are_one_line():
    enc = byte_encoder()
    tokens = [enc[b] for b in range(256)]
    with pytest.raises(ModelFormatError) as e:
        Tokenizer.from_spec(tokens, [1] * 256, ["a b"], None, None, None)  # "ab" is not a token
    assert str(e.value) == "tokenizer merge 'a b' does not combine two tokens of the vocabulary"
    with pytest.raises(ModelFormatError, match=r"^tokenizer has 256 tokens but 3 token types$"):
        Tokenizer.from_spec(tokens, [1] * 3, [], None, None, None)


def test_unsupported_tokenizer_model(gguf_path):
    f = GGUFFile(gguf_path)
    f.fields = {**f.fields, "tokenizer.ggml.model": "llama"}
    with pytest.raises(ModelFormatError) as e:
        Tokenizer.from_gguf(f)
    assert str(e.value) == "unsupported tokenizer model 'llama' (supported: gpt2 byte-level BPE)"


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_decode_refuses_out_of_range_ids_in_one_line(tok, bad):
    with pytest.raises(ValueError) as e:
        tok.decode([1, bad])
    assert str(e.value) == f"token id {bad} is out of range (vocabulary of {tok.n_vocab} tokens)"


def _unseen_words(n_chars: int, seed: int) -> str:
    """Words the tokenizer's cache has not seen (so the encode does the work): letters with a space a 6th."""
    rnd = random.Random(seed)
    return "".join(rnd.choices(string.ascii_lowercase + " " * 5, k=n_chars))


def test_a_long_text_encodes_to_the_same_ids_with_the_gil_released(tok):
    text = _unseen_words(LONG_TEXT * 12, seed=1)  # ~0.8 MB
    assert tok.encode(text) == tok._hf.encode(text, add_special_tokens=False).ids
    short = text[:LONG_TEXT]  # the two paths agree at the threshold (encode below it, encode_batch above)
    assert tok.encode(short) == tok._hf.encode_batch([short], add_special_tokens=False)[0].ids
    other = _unseen_words(LONG_TEXT * 12, seed=2)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(other), done.set()))
    start = time.perf_counter()
    worker.start()
    wakes = 0
    while not done.is_set():  # the main thread runs while the worker encodes (a server's event loop)
        time.sleep(0.01)
        wakes += 1
    worker.join()
    elapsed = time.perf_counter() - start
    # holding the GIL (encode), the main thread woke once or twice in the whole encode
    assert wakes >= min(10, elapsed / 0.05), (wakes, elapsed)
