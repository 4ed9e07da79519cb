"""Token ids -> client text with stop strings held back and cut (a real byte-level tokenizer)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from strata_ray.engine.generate import TokenLogprob
from strata_ray.model.gguf_writer import byte_level_tokenizer_spec
from strata_ray.model.tokenizer import Tokenizer
from strata_ray.serve.text_stream import TextStream


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_spec(**asdict(byte_level_tokenizer_spec()))


def run(tok, text: str, stop=(), extra_ids=()):
    ids = tok.encode(text) + list(extra_ids)
    stream = TextStream(tok, stop)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.finish())
    return pieces, stream


def test_plain_text_round_trips_with_multibyte_characters(tok):
    text = "caf\u00e9 \u2603 snow \U0001f600!"
    pieces, stream = run(tok, text)
    assert "".join(pieces) == text == stream.text
    assert "\ufffd" not in "".join(pieces)  # a character split over byte tokens waits until complete


def test_stop_ids_produce_no_text(tok):
    pieces, _ = run(tok, "hello", extra_ids=[tok.eos_id])
    assert "".join(pieces) == "hello"


def test_stop_string_cuts_and_is_never_sent(tok):
    pieces, stream = run(tok, "one two STOP three", stop=["STOP"])
    assert "".join(pieces) == "one two " and stream.stopped
    assert all("S" not in p for p in pieces)


def test_partial_stop_prefix_is_held_then_released(tok):
    stream = TextStream(tok, ["END"])
    out = "".join(stream.push(i) for i in tok.encode("a EN"))
    assert out == "a " and not stream.stopped  # "EN" might become "END"
    out += "".join(stream.push(i) for i in tok.encode("D?"))
    assert out == "a " and stream.stopped
    stream2 = TextStream(tok, ["END"])
    text = "".join(stream2.push(i) for i in tok.encode("a ENx")) + stream2.finish()
    assert text == "a ENx" and not stream2.stopped


def test_earliest_of_several_stop_strings_wins(tok):
    pieces, _ = run(tok, "abc\nxyz;", stop=[";", "\n"])
    assert "".join(pieces) == "abc"


# --- logprobs carried beside the text ----------------------------------------------------------------------


def logprob_of(token_id: int) -> TokenLogprob:
    return TokenLogprob(-float(token_id), ((token_id, -float(token_id)),))


def run_with_logprobs(tok, text: str, stop=()):
    """(text sent, tokens taken after each push and at the end) for text's tokens pushed with logprobs."""
    ids = tok.encode(text)
    stream = TextStream(tok, stop)
    sent, taken = "", []
    for i in ids:
        sent += stream.push(i, logprob_of(i))
        taken.append(stream.take_tokens())
    sent += stream.finish()
    taken.append(stream.take_tokens())
    return ids, sent, taken, stream


def test_every_token_comes_out_once_in_order_with_its_offset(tok):
    text = "caf\u00e9 \u2603 snow \U0001f600!"  # characters of 2, 3 and 4 bytes, split over byte tokens
    ids, sent, taken, _ = run_with_logprobs(tok, text)
    flat = [t for batch in taken for t in batch]
    assert sent == text and [t.token_id for t in flat] == ids
    assert [t.logprob for t in flat] == [-float(i) for i in ids]
    assert flat[0].top == ((ids[0], -float(ids[0])),)
    # each token's offset is where its text starts: the text of the tokens before it decodes to text[:offset]
    for k, t in enumerate(flat):
        assert tok.decode(ids[:k]).rstrip("\ufffd") == text[: t.offset]
    # a token is taken no earlier than its first character is sent (a split character waits for its last byte)
    sent_so_far = 0
    for k, batch in enumerate(taken[:-1]):
        sent_so_far = len(tok.decode(ids[: k + 1]).rstrip("\ufffd"))
        assert all(t.offset < sent_so_far for t in batch)


def test_a_stop_string_keeps_its_tokens_and_those_after_it(tok):
    ids, sent, taken, stream = run_with_logprobs(tok, "one two STOP three", stop=["STOP"])
    flat = [t for batch in taken for t in batch]
    assert sent == "one two " and stream.stopped
    assert "".join(tok.decode([t.token_id]) for t in flat) == "one two "
    assert all(t.offset < len(sent) for t in flat)


def test_held_text_and_its_tokens_wait_together(tok):
    stream = TextStream(tok, ["END"])
    got = [stream.push(i, logprob_of(i)) for i in tok.encode("a EN")]
    assert "".join(got) == "a " and "".join(tok.decode([t.token_id]) for t in stream.take_tokens()) == "a "
    assert stream.finish() == "EN"
    assert "".join(tok.decode([t.token_id]) for t in stream.take_tokens()) == "EN"


@pytest.fixture(scope="module")
def merged():
    """The embedded model's tokenizer: BPE merges, so a token spans several characters."""
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.loader import default_model_path

    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


def test_a_stop_string_inside_a_token_lists_that_token_and_none_after(merged):
    text = "The quick brown fox jumps over the lazy dog"
    ids = merged.encode(text)
    starts = [len(merged.decode(ids[:k])) for k in range(len(ids))]
    k = next(k for k in range(1, len(ids)) if len(merged.decode([ids[k]])) >= 3)  # a token of 3+ characters
    stop = text[starts[k] + 1 : starts[k] + 3]  # from its second character: the cut falls inside it
    assert text.find(stop) == starts[k] + 1
    stream = TextStream(merged, [stop])
    sent = "".join(stream.push(i, logprob_of(i)) for i in ids) + stream.finish()
    listed = stream.take_tokens()
    assert sent == text[: starts[k] + 1] and stream.stopped
    assert [t.token_id for t in listed] == ids[: k + 1]  # the token the cut falls in, and those before it
    assert [t.offset for t in listed] == starts[: k + 1]


def test_tokens_without_logprobs_are_not_kept(tok):
    stream = TextStream(tok)
    assert stream.push(tok.encode("a")[0]) == "a" and stream.take_tokens() == []
