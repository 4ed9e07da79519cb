"""Token ids -> client text with stop strings held back and cut (a real byte-level tokenizer)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

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
