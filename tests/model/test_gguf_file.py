"""GGUFFile: fields, tensors (zero-copy views), split shards, hparams for both archs, and every error line."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata_ray.model import quants
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.hparams import ModelFormatError

Q = gguf.GGMLQuantizationType
TOKENS = ["a", "b", "Ġ", "<|im_end|>"]


def add_arch_keys(w: gguf.GGUFWriter, arch: str, block_count: int = 4) -> None:
    p = arch + "."
    w.add_uint32(p + "block_count", block_count)
    w.add_uint32(p + "context_length", 4096)
    w.add_uint32(p + "embedding_length", 64)
    w.add_uint32(p + "attention.head_count", 4)
    w.add_uint32(p + "attention.head_count_kv", 2)
    w.add_uint32(p + "attention.key_length", 16)
    w.add_uint32(p + "expert_count", 8)
    w.add_uint32(p + "expert_used_count", 2)
    w.add_uint32(p + "expert_feed_forward_length", 32)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(p + "rope.freq_base", 1e6)
    if arch == "qwen3next":
        w.add_uint32(p + "expert_shared_feed_forward_length", 48)
        w.add_uint32(p + "rope.dimension_count", 4)
        w.add_uint32(p + "ssm.conv_kernel", 4)
        w.add_uint32(p + "ssm.state_size", 16)
        w.add_uint32(p + "ssm.group_count", 2)
        w.add_uint32(p + "ssm.time_step_rank", 4)
        w.add_uint32(p + "ssm.inner_size", 64)


def write_gguf(
    path: Path,
    arch: str = "qwen3moe",
    tensors: dict[str, tuple[np.ndarray, int]] | None = None,
    extra=None,
    split_max_tensors: int = 0,
) -> Path:
    """A small model file: arch keys, a toy vocab, and tensors {name: (float32 array, ggml type)}."""
    w = gguf.GGUFWriter(str(path), arch=arch, split_max_tensors=split_max_tensors)
    if arch in ("qwen3moe", "qwen3next"):
        add_arch_keys(w, arch)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1, 1, 1, 3])
    if extra:
        extra(w)
    if tensors is None:
        tensors = {"token_embd.weight": (np.arange(4 * 64, dtype=np.float32).reshape(4, 64), Q.F32)}
    for name, (x, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, x.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_tensors_and_zero_copy_views(tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((4, 64)).astype(np.float32)
    exps = rng.standard_normal((8, 32, 64)).astype(np.float32)  # [X, n_ff, n_embd]
    path = write_gguf(
        tmp_path / "m.gguf",
        tensors={
            "token_embd.weight": (emb, Q.F32),
            "blk.0.ffn_up_exps.weight": (exps, Q.Q8_0),
            "blk.0.attn_norm.weight": (emb[0], Q.F16),
        },
    )
    f = GGUFFile(path)
    assert f.arch == "qwen3moe"
    assert f.fields["tokenizer.ggml.tokens"] == TOKENS
    assert f.fields["tokenizer.ggml.token_type"] == [1, 1, 1, 3]
    assert f.fields["qwen3moe.rope.freq_base"] == 1e6
    assert f.fields["general.architecture"] == "qwen3moe"

    t = f.tensor("token_embd.weight")
    assert (t.ggml_type, t.shape, t.data.dtype, t.n_bytes) == (Q.F32, (4, 64), np.float32, 4 * 64 * 4)
    np.testing.assert_array_equal(t.data, emb)
    assert t.data.flags.writeable  # copy-on-write map: torch.from_numpy shares it without a warning
    raw = path.read_bytes()[t.file_offset : t.file_offset + t.n_bytes]
    assert raw == emb.tobytes()

    q = f.tensor("blk.0.ffn_up_exps.weight")
    assert q.shape == (8, 32, 64) and q.data.shape == (8, 32, 64 // 32 * 34) and q.data.dtype == np.uint8
    np.testing.assert_array_equal(q.data, gguf.quants.quantize(exps, Q.Q8_0))
    assert f.tensor("blk.0.attn_norm.weight").data.dtype == np.float16
    assert f.has("token_embd.weight") and not f.has("output.weight")


def test_reads_same_values_as_gguf_reader(tmp_path):
    def extra(w):
        w.add_token_merges(["a b", "Ġ a"])
        w.add_string("tokenizer.chat_template", "{{ messages }} ✓")
        w.add_bool("tokenizer.ggml.add_bos_token", False)
        w.add_array("test.floats", [0.5, 1.5])
        w.add_int64("test.i64", -(2**40))
        w.add_float64("test.f64", 0.1)

    path = write_gguf(tmp_path / "m.gguf", extra=extra)
    ours = GGUFFile(path).fields
    ref = gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours[key] == field.contents(), key
    assert set(ours) == {k for k in ref.fields if not k.startswith("GGUF.")}


def test_hparams_qwen3moe(tmp_path):
    hp = GGUFFile(write_gguf(tmp_path / "m.gguf")).hparams
    assert (hp.arch, hp.n_layer, hp.n_nextn, hp.n_embd, hp.head_dim, hp.n_vocab) == (
        "qwen3moe",
        4,
        0,
        64,
        16,
        4,
    )
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp, hp.recurrent) == (8, 2, 32, 0, ())


def test_hparams_qwen3next_interval_and_nextn(tmp_path):
    def extra(w):
        w.add_uint32("qwen3next.full_attention_interval", 2)
        w.add_uint32("qwen3next.nextn_predict_layers", 1)

    hp = GGUFFile(write_gguf(tmp_path / "m.gguf", arch="qwen3next", extra=extra)).hparams
    assert (hp.n_layer, hp.n_nextn, hp.block_count, hp.has_mtp) == (3, 1, 4, True)
    assert hp.recurrent == (True, False, True)
    assert (hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_inner, hp.ssm_head_v_dim) == (
        16,
        2,
        4,
        64,
        16,
    )
    assert (hp.n_ff_shexp, hp.n_rot) == (48, 4)


def test_hparams_qwen3next_recurrent_layers_override_interval(tmp_path):
    def extra(w):
        w.add_uint32("qwen3next.full_attention_interval", 4)
        w.add_array("qwen3next.attention.recurrent_layers", [False, True, True, False])

    hp = GGUFFile(write_gguf(tmp_path / "m.gguf", arch="qwen3next", extra=extra)).hparams
    assert hp.n_nextn == 0 and hp.recurrent == (False, True, True, False)


def split_model(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    xs = {
        f"blk.{i}.ffn_down_exps.weight": rng.standard_normal((2, 64, 32)).astype(np.float32) for i in range(3)
    }
    write_gguf(tmp_path / "m.gguf", tensors={k: (v, Q.Q8_0) for k, v in xs.items()}, split_max_tensors=2)
    return tmp_path / "m-00001-of-00002.gguf", xs


def test_split_files_merge_all_shards(tmp_path):
    first, xs = split_model(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    for given in (first, tmp_path / "m-00002-of-00002.gguf"):  # any shard opens the whole model
        f = GGUFFile(given)
        assert sorted(f.tensors) == sorted(xs)
        assert f.hparams.arch == "qwen3moe" and f.fields["split.count"] == 2
        for name, x in xs.items():
            np.testing.assert_array_equal(f.tensor(name).data, gguf.quants.quantize(x, Q.Q8_0))
        assert f.tensor("blk.2.ffn_down_exps.weight").path.endswith("m-00002-of-00002.gguf")


def test_missing_shard_is_one_line(tmp_path):
    first, _ = split_model(tmp_path)
    second = tmp_path / "m-00002-of-00002.gguf"
    second.unlink()
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(first)
    assert str(e.value) == f"missing shard {second} of split model m-00001-of-00002.gguf (2 shards)"


def test_error_missing_file(tmp_path):
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(tmp_path / "nope.gguf")
    assert str(e.value) == f"model file not found: {tmp_path / 'nope.gguf'}"


@pytest.mark.parametrize("path, what", [("folder", "a folder"), ("/dev/null", "not a regular file")])
def test_error_a_path_that_is_not_a_file(tmp_path, path, what):
    (tmp_path / "folder").mkdir()
    path = tmp_path / path
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(path)
    assert str(e.value) == f"model file {path} is {what}; give a .gguf file"


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 this is a zip", b'{"json": 1}'])
def test_error_not_gguf(tmp_path, content):
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(p)
    assert str(e.value) == f"not a GGUF file: {p}"


@pytest.mark.parametrize("keep", [6, 30, 200, -100, -1])
def test_error_truncated(tmp_path, keep):
    """Cut in the version, a key, a later key, the tensor data, its last byte."""
    full = write_gguf(tmp_path / "m.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(full[:keep])
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(p)
    msg = str(e.value)
    assert msg.startswith(f"truncated or corrupt GGUF file: {p} (") and msg.endswith(")") and "\n" not in msg


def test_error_corrupt_counts(tmp_path):
    data = bytearray(write_gguf(tmp_path / "m.gguf").read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # tensor count
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"^truncated or corrupt GGUF file: .*\(implausible counts"):
        GGUFFile(p)


def test_error_shape_too_large_for_the_file(tmp_path):
    name = b"t"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
    head += struct.pack("<I3Q", 3, 2**32, 2**32, 2**8) + struct.pack("<IQ", Q.F32, 0)  # 2^72 elements
    p = tmp_path / "huge.gguf"
    p.write_bytes(head + bytes(-len(head) % 32 + 64))
    with pytest.raises(ModelFormatError, match=r"^truncated or corrupt GGUF file: .*\(data of tensor t runs"):
        GGUFFile(p)


def test_corrupt_file_is_unmapped_at_once(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(write_gguf(tmp_path / "m.gguf").read_bytes()[:-8])  # tensor data cut short
    before = len(list(Path("/proc/self/fd").iterdir()))
    errors = []
    for _ in range(3):
        try:
            GGUFFile(p)
        except ModelFormatError as e:
            errors.append(e)  # a caller that keeps the error must not keep the file mapped
    assert len(errors) == 3 and errors[0].__context__ is None
    assert len(list(Path("/proc/self/fd").iterdir())) == before


def test_error_unknown_arch(tmp_path):
    def extra(w):
        w.add_uint32("llama.block_count", 2)

    path = write_gguf(tmp_path / "m.gguf", arch="llama", extra=extra)
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(path)
    assert str(e.value) == f"{path}: unsupported model architecture 'llama' (supported: qwen3next, qwen3moe)"


def test_a_key_problem_names_the_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", extra=lambda w: w.add_uint32("qwen3moe.expert_used_count", 9))
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(path)
    assert str(e.value) == f"{path}: GGUF key qwen3moe.expert_used_count is 9, more than the 8 experts"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file without read permission")
def test_a_file_without_read_permission_is_one_line(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.chmod(0)
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(path)
    assert str(e.value) == f"cannot read model file {path} (Permission denied)"


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_a_file_whose_reads_fail_is_one_line():
    """/proc/self/mem is a regular file whose first bytes cannot be read (EIO): it was a traceback."""
    with pytest.raises(ModelFormatError) as e:
        GGUFFile("/proc/self/mem")
    assert str(e.value) == "cannot read model file /proc/self/mem (Input/output error)"


def test_swapped_shards_are_told_as_such(tmp_path):
    """Shard 2 (no model keys) named as shard 1 read as `unsupported model architecture None`."""
    first, _ = split_model(tmp_path)
    second = tmp_path / "m-00002-of-00002.gguf"
    parked = tmp_path / "parked"
    first.rename(parked)
    second.rename(first)
    parked.rename(second)
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(second)
    assert str(e.value) == (f"shard {first} of split model m-00002-of-00002.gguf is shard 2 by its split.no "
                            "key (were the shards renamed?)")


def test_check_model_names_the_file(tmp_path):
    """GGUFFile opens a file of any tensors; check_model holds them to the layout (test_tensor_layout)."""
    path = write_gguf(tmp_path / "m.gguf")
    f = GGUFFile(path)
    with pytest.raises(ModelFormatError) as e:
        f.check_model()
    assert str(e.value) == f"{path}: missing tensor output_norm.weight"


def test_check_model_finds_a_missing_vocabulary(tmp_path):
    """A file whose hparams carry vocab_size opens without tokenizer.ggml.tokens: the primary found it."""
    from strata_ray.model.synth import write_synth

    path = tmp_path / "m.gguf"
    write_synth(path, "qwen3moe", "tiny", progress=False)
    data = path.read_bytes()
    key = b"tokenizer.ggml.tokens"
    assert data.count(key) == 1
    path.write_bytes(data.replace(key, b"tokenizer.ggml.tokenZ"))  # the key renamed, the same length
    f = GGUFFile(path)
    with pytest.raises(ModelFormatError) as e:
        f.check_model()
    assert str(e.value) == f"{path}: missing GGUF key tokenizer.ggml.tokens (vocabulary)"


def test_error_missing_tensor(tmp_path):
    f = GGUFFile(write_gguf(tmp_path / "m.gguf"))
    with pytest.raises(ModelFormatError) as e:
        f.tensor("blk.0.attn_qkv.weight")
    assert str(e.value) == "missing tensor blk.0.attn_qkv.weight"


def test_every_supported_type_reads_back_like_gguf_reader(tmp_path):
    """All seven types written by GGUFWriter: our views dequantize to what gguf's own reader gives."""
    rng = np.random.default_rng(2)
    types = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K]
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    add_arch_keys(w, "qwen3moe")
    w.add_token_list(TOKENS)
    for t in types:
        x = rng.standard_normal((2, 3, 256)).astype(np.float32)
        w.add_tensor(f"t.{t.name}", quants.quantize(x, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    f, ref = GGUFFile(path), gguf.GGUFReader(path)
    for rt in ref.tensors:
        info = f.tensor(rt.name)
        assert (info.ggml_type, info.shape, info.n_bytes) == (rt.tensor_type, (2, 3, 256), rt.n_bytes)
        assert info.data.dtype == rt.data.dtype and info.data.shape == rt.data.shape
        np.testing.assert_array_equal(
            quants.dequantize_tensor(info), gguf.quants.dequantize(rt.data, rt.tensor_type)
        )
