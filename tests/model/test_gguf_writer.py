import os
from dataclasses import replace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as VT

from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.gguf_writer import (
    CONTROL,
    DEFAULT_CHATML,
    NORMAL,
    UNUSED,
    GGUFWriteError,
    ModelWriter,
    byte_level_tokenizer_spec,
    hparams_fields,
)
from strata_ray.model.hparams import HParams
from strata_ray.model.quants import quantize
from strata_ray.model.synth_presets import preset_hparams
from strata_ray.model.tokenizer import Tokenizer

ALL_PRESETS = [
    ("qwen3next", "tiny"),
    ("qwen3moe", "tiny"),
    ("qwen3next", "small"),
    ("qwen3moe", "small"),
    ("qwen3moe", "30b-a3b"),
    ("qwen3next", "80b-a3b"),
]


@pytest.mark.parametrize(("arch", "preset"), ALL_PRESETS)
def test_hparams_fields_round_trip(arch, preset):
    hp = preset_hparams(arch, preset)
    assert HParams.from_fields(hparams_fields(hp)) == hp
    hp2 = preset_hparams(arch, preset, layers=6)
    assert HParams.from_fields(hparams_fields(hp2)) == hp2


def test_qwen3next_fields_follow_llama_cpp():
    hp = preset_hparams("qwen3next", "80b-a3b")
    f = hparams_fields(hp)
    assert f["qwen3next.block_count"] == 49 and f["qwen3next.nextn_predict_layers"] == 1
    rec = f["qwen3next.attention.recurrent_layers"]
    assert len(rec) == 49 and all(type(r) is bool for r in rec)
    assert rec[:4] == [True, True, True, False] and rec[-1] is False  # MTP entry is attention
    assert f["qwen3next.full_attention_interval"] == 4
    assert f["qwen3next.ssm.inner_size"] == 4096 and f["qwen3next.ssm.state_size"] == 128
    assert f["qwen3next.rope.dimension_count"] == 64
    assert f["qwen3next.feed_forward_length"] == 5120  # active expert width, as in the real file


def test_byte_level_tokenizer_spec():
    tok = byte_level_tokenizer_spec()
    assert tok.tokens[ord(" ")] == "Ġ" and tok.tokens[ord("\n")] == "Ċ" and tok.tokens[ord("a")] == "a"
    assert len(set(tok.tokens[:256])) == 256
    assert tok.merges and all(len(m.split(" ")) == 2 for m in tok.merges)
    assert tok.tokens[tok.bos_id] == "<|endoftext|>" and tok.tokens[tok.eos_id] == "<|im_end|>"
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.token_types[tok.token_id(s)] == CONTROL
    assert tok.token_types[:256] == [NORMAL] * 256
    assert tok.chat_template == DEFAULT_CHATML
    padded = tok.padded(288)
    assert len(padded.tokens) == 288 and padded.tokens[-1] == "[PAD287]" and padded.token_types[-1] == UNUSED
    with pytest.raises(GGUFWriteError):
        tok.padded(10)


def test_extra_merges_add_tokens_in_order():
    tok = byte_level_tokenizer_spec(["h e", "l l", "he ll"])
    assert tok.tokens[256:259] == ["he", "ll", "hell"]
    with pytest.raises(GGUFWriteError, match="merge"):
        byte_level_tokenizer_spec(["nope x"])


def _tiny_hp(n_vocab):
    return replace(preset_hparams("qwen3moe", "tiny"), n_vocab=n_vocab)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A small file mixing float-quantized, raw-block, chunked and plain float tensors."""
    tok = byte_level_tokenizer_spec(["h e", "l l"])
    tok = tok.padded(288)
    hp = _tiny_hp(288)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((3, 32, 256)).astype(np.float32)
    raw = quantize(rng.standard_normal((16, 256)).astype(np.float32), T.Q4_K)
    path = tmp_path_factory.mktemp("w") / "m.gguf"
    mw = ModelWriter(path, hp, tok)
    mw.add("a.weight", (64, 256), T.Q8_0, lambda: a)
    mw.add("b.weight", (3, 32, 256), T.Q6_K, lambda: (b[i : i + 1] for i in range(3)))  # chunked
    mw.add("raw.weight", (16, 256), T.Q4_K, lambda: raw)
    mw.add("f.weight", (5,), T.F32, lambda: np.arange(5, dtype=np.float32))
    mw.add("h.weight", (4, 32), T.F16, lambda: np.ones((4, 32), np.float32))
    mw.write()
    return path, hp, tok, dict(a=a, b=b, raw=raw)


def test_written_tensors_read_back(written):
    path, hp, _, src = written
    r = gguf.GGUFReader(path)
    ts = {t.name: t for t in r.tensors}
    assert list(ts) == ["a.weight", "b.weight", "raw.weight", "f.weight", "h.weight"]
    assert ts["a.weight"].tensor_type == T.Q8_0 and list(ts["a.weight"].shape) == [256, 64]
    assert np.array_equal(ts["a.weight"].data, quantize(src["a"], T.Q8_0))
    assert ts["b.weight"].tensor_type == T.Q6_K and list(ts["b.weight"].shape) == [256, 32, 3]
    assert np.array_equal(ts["b.weight"].data, quantize(src["b"], T.Q6_K))
    assert np.array_equal(ts["raw.weight"].data, src["raw"])
    assert np.array_equal(ts["f.weight"].data, np.arange(5, dtype=np.float32))
    assert ts["h.weight"].data.dtype == np.float16 and np.all(ts["h.weight"].data == 1)
    f = GGUFFile(path)
    assert f.hparams == hp
    assert f.tensor("b.weight").shape == (3, 32, 256) and f.tensor("b.weight").ggml_type == T.Q6_K


def test_written_keys_and_types(written):
    path, hp, tok, _ = written
    r = gguf.GGUFReader(path)

    def field(k):
        return r.fields[k].contents()

    assert field("general.architecture") == "qwen3moe"
    assert field("general.quantization_version") == 2
    assert field("general.file_type") == gguf.LlamaFileType.MOSTLY_Q6_K  # the type holding most bytes
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "qwen2"
    assert field("tokenizer.ggml.tokens") == tok.tokens
    assert field("tokenizer.ggml.merges") == ["h e", "l l"]
    assert r.fields["tokenizer.ggml.token_type"].types == [VT.ARRAY, VT.INT32]
    assert field("tokenizer.ggml.add_bos_token") is False
    assert r.fields["tokenizer.ggml.bos_token_id"].types == [VT.UINT32]
    assert field("tokenizer.ggml.padding_token_id") == tok.pad_id
    assert field("tokenizer.chat_template") == DEFAULT_CHATML
    assert r.fields["qwen3moe.attention.layer_norm_rms_epsilon"].types == [VT.FLOAT32]


def test_recurrent_layers_written_as_bool_array(tmp_path):
    hp = preset_hparams("qwen3next", "tiny")
    mw = ModelWriter(tmp_path / "n.gguf", hp, byte_level_tokenizer_spec().padded(hp.n_vocab))
    mw.add("x.weight", (32,), T.F32, lambda: np.zeros(32, np.float32))
    mw.write()
    r = gguf.GGUFReader(tmp_path / "n.gguf")
    f = r.fields["qwen3next.attention.recurrent_layers"]
    assert f.types == [VT.ARRAY, VT.BOOL]
    assert f.contents() == [True, True, True, False, False]
    assert r.fields["qwen3next.block_count"].contents() == 5
    assert GGUFFile(tmp_path / "n.gguf").hparams == hp


def test_tokenizer_from_written_file(written):
    path, _, tok, _ = written
    t = Tokenizer.from_gguf(GGUFFile(path))
    ids = t.encode("<|im_start|>hello\n")
    assert ids[0] == tok.token_id("<|im_start|>") and tok.token_id("he") in ids and tok.token_id("ll") in ids
    assert t.decode(ids) == "<|im_start|>hello\n"
    assert t.eos_id == tok.eos_id
    assert "<|im_start|>assistant\n" in t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_producer_size_mismatch_leaves_no_file(tmp_path):
    mw = ModelWriter(tmp_path / "bad.gguf", _tiny_hp(288), byte_level_tokenizer_spec().padded(288))
    mw.add("a.weight", (4, 32), T.Q8_0, lambda: np.zeros((3, 32), np.float32))
    with pytest.raises(GGUFWriteError, match="a.weight"):
        mw.write()
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_bad_declarations(tmp_path):
    tok = byte_level_tokenizer_spec().padded(288)
    with pytest.raises(GGUFWriteError, match="n_vocab"):
        ModelWriter(tmp_path / "x.gguf", _tiny_hp(300), tok)
    mw = ModelWriter(tmp_path / "x.gguf", _tiny_hp(288), tok)
    with pytest.raises(GGUFWriteError, match="multiple"):
        mw.add("k.weight", (4, 128), T.Q4_K, lambda: None)
    mw.add("a.weight", (4, 32), T.Q8_0, lambda: None)
    with pytest.raises(GGUFWriteError, match="twice"):
        mw.add("a.weight", (4, 32), T.Q8_0, lambda: None)
    with pytest.raises(GGUFWriteError, match="raw rows"):
        mw2 = ModelWriter(tmp_path / "y.gguf", _tiny_hp(288), tok)
        mw2.add("a.weight", (4, 32), T.Q8_0, lambda: np.zeros((4, 33), np.uint8))
        mw2.write()


def test_writer_refuses_to_replace_a_non_regular_file(tmp_path):
    """The .part + rename scheme would replace a device or FIFO (say /dev/null) with the model file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    mw = ModelWriter(fifo, _tiny_hp(288), byte_level_tokenizer_spec().padded(288))
    with pytest.raises(GGUFWriteError, match="not a regular file"):
        mw.write()
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_producer_error_midway_stops_the_writer_and_leaves_no_file(tmp_path):
    """Many chunks through the write-behind thread: a producer failing midway stops the file cleanly."""
    mw = ModelWriter(tmp_path / "f.gguf", _tiny_hp(288), byte_level_tokenizer_spec().padded(288))

    def chunks():
        for _ in range(5):
            yield np.ones((2, 32), np.float32)
        raise OSError("disk gone")

    mw.add("a.weight", (20, 32), T.Q8_0, chunks)
    with pytest.raises(OSError, match="disk gone"):
        mw.write()
    assert list(tmp_path.iterdir()) == []
