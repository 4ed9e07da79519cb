"""HostStore: zero-copy views of every expert layer (trunk and MTP) and byte-exact blobs."""

import numpy as np
import pytest

from strata_ray.experts.host_store import HostStore, expert_layers_of, experts_block_quantized
from strata_ray.kernels.contract import F16, Q8_0
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.gguf_writer import ModelWriter, byte_level_tokenizer_spec
from strata_ray.model.hparams import ModelFormatError
from strata_ray.model.synth import write_synth
from strata_ray.model.synth_presets import preset_hparams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", expert_type="Q4_0", progress=False)
    return GGUFFile(path)


def test_layers_cover_trunk_and_mtp(tiny):
    hp = tiny.hparams
    assert expert_layers_of(tiny) == list(range(hp.n_layer + hp.n_nextn))
    assert experts_block_quantized(tiny)


def test_views_are_the_file_bytes_without_copies(tiny):
    store = HostStore(tiny, pin_gib=0)
    info = tiny.tensor("blk.2.ffn_down_exps.weight")
    layer = store.layer(2)
    assert np.shares_memory(layer.down, info.data)  # zero-copy
    assert layer.gate_type == tiny.tensor("blk.2.ffn_gate_exps.weight").ggml_type


def test_blob_is_gate_up_down_in_order(tiny):
    store = HostStore(tiny, pin_gib=0)
    lay = store.layouts[1]
    blob = store.blob_bytes(1, 5)
    assert len(blob) == lay.nbytes == store.max_blob
    parts = [tiny.tensor(f"blk.1.ffn_{n}_exps.weight").data[5].tobytes() for n in ("gate", "up", "down")]
    assert blob == b"".join(parts)
    assert store.total_bytes == lay.nbytes * tiny.hparams.n_expert * len(store.layers)
    assert store.pinned_bytes == 0  # no CUDA here (and pin_gib=0)


def test_arena_holds_the_same_bytes_outside_the_file_map(tiny):
    """move_to_arena (what STRATA_ARENA_PIN_GIB does on CUDA, here without page-locking): whole layers
    up to the cap, byte-exact, no longer views of the file, and the expert kernels give the same rows."""
    from strata_ray.kernels.expert_cpu import expert_ffn_cpu

    store, plain = HostStore(tiny, pin_gib=0), HostStore(tiny, pin_gib=0)
    per_layer = store.layouts[0].nbytes * store.n_expert
    store.move_to_arena(2.5 * per_layer / 2**30, register=False)  # two whole layers fit, not three
    assert store.arena_bytes == 2 * per_layer and store.pinned_bytes == 0
    moved = [b for b in store.layers if not np.shares_memory(store.layer(b).gate, plain.layer(b).gate)]
    assert moved == [0, 1]
    assert store.pinned_parts(0, 3) is None  # not page-locked: copies go through staging
    x = np.random.default_rng(0).standard_normal((2, store.layer(0).n_embd)).astype(np.float32)
    tok, exp = np.array([0, 1, 1]), np.array([3, 3, 7])
    for b in (0, 1, 2):
        assert store.blob_bytes(b, 3) == plain.blob_bytes(b, 3)
        rows, want = expert_ffn_cpu(x, tok, exp, store.layer(b)), expert_ffn_cpu(x, tok, exp, plain.layer(b))
        assert np.array_equal(rows, want)
    store.close()
    assert store.arena_bytes == 0


def test_a_refused_page_lock_leaves_the_layers_in_the_file_map(tiny, monkeypatch, caplog):
    """"Pinned where the OS allows": when cudaHostRegister refuses a layer (injected here: this host has no
    CUDA), that layer and the later ones stay views of the file map, one line says so, and the load goes on
    with the same bytes and rows."""
    from strata_ray.experts.host_arena import HostArenaError, HostBlock
    from strata_ray.kernels.expert_cpu import expert_ffn_cpu

    def refuse(block):
        block.close()  # as the real failure does before raising
        raise HostArenaError("could not page-lock 0.0 GiB of host memory (cudaHostRegister error 2; lower "
                             "STRATA_ARENA_PIN_GIB)")

    monkeypatch.setattr(HostBlock, "register", refuse)
    store, plain = HostStore(tiny, pin_gib=0), HostStore(tiny, pin_gib=0)
    with caplog.at_level("WARNING", logger="strata_ray.experts"):
        store.move_to_arena(100.0, register=True)
    assert store.arena_bytes == store.pinned_bytes == 0 and "cudaHostRegister error 2" in store.pin_error
    assert [r.getMessage() for r in caplog.records] == [
        f"host store: {store.pin_error}; layers 0-{max(store.layers)} stay in the file map, unpinned (their "
        "copies go through staging buffers)"]
    assert all(np.shares_memory(store.layer(b).gate, plain.layer(b).gate) for b in store.layers)
    x = np.random.default_rng(1).standard_normal((1, store.layer(0).n_embd)).astype(np.float32)
    for b in store.layers:
        assert store.pinned_addresses(b) is None and store.blob_bytes(b, 2) == plain.blob_bytes(b, 2)
        assert np.array_equal(expert_ffn_cpu(x, np.array([0]), np.array([2]), store.layer(b)),
                              expert_ffn_cpu(x, np.array([0]), np.array([2]), plain.layer(b)))


@pytest.mark.parametrize("float_part", ["gate", "up", "down"])
def test_float_expert_tensor_is_refused_by_name(tmp_path, float_part):
    hp = preset_hparams("qwen3moe", "tiny")
    mw = ModelWriter(tmp_path / "m.gguf", hp, byte_level_tokenizer_spec().padded(hp.n_vocab))
    x, e, f = hp.n_expert, hp.n_embd, hp.n_ff_exp
    for part, shape in (("gate", (x, f, e)), ("up", (x, f, e)), ("down", (x, e, f))):
        mw.add(f"blk.0.ffn_{part}_exps.weight", shape, F16 if part == float_part else Q8_0,
               lambda shape=shape: np.zeros(shape, np.float32))
    mw.write()
    with pytest.raises(ModelFormatError) as err:
        HostStore(GGUFFile(tmp_path / "m.gguf"))
    assert str(err.value) == (f"blk.0.ffn_{float_part}_exps.weight is F16; the expert tiers need "
                              "Q8_0, Q4_0, Q4_K or Q6_K experts")


def _fused_file(tmp_path):
    """Layer 0's gate and up as one fused ffn_gate_up_exps tensor, layer 1's apart (Q8_0, random values)."""
    hp = preset_hparams("qwen3moe", "tiny")
    mw = ModelWriter(tmp_path / "fused.gguf", hp, byte_level_tokenizer_spec().padded(hp.n_vocab))
    x, e, f = hp.n_expert, hp.n_embd, hp.n_ff_exp
    rng = np.random.default_rng(7)
    parts = {"blk.0.ffn_gate_up_exps.weight": (x, 2 * f, e), "blk.0.ffn_down_exps.weight": (x, e, f),
             "blk.1.ffn_gate_exps.weight": (x, f, e), "blk.1.ffn_up_exps.weight": (x, f, e),
             "blk.1.ffn_down_exps.weight": (x, e, f)}
    for name, shape in parts.items():
        values = rng.standard_normal(shape).astype(np.float32)
        mw.add(name, shape, Q8_0, lambda values=values: values)
    mw.write()
    return GGUFFile(tmp_path / "fused.gguf")


def test_a_fused_gate_up_layer_is_split_into_contiguous_memory(tmp_path, caplog):
    """A fused gate_up layer's halves are strided views of the map, which the CPU kernels would copy whole at
    every call: the store moves that layer into memory of its own (the same bytes, C-contiguous, the same
    rows), and leaves the unfused layer in the map."""
    from strata_ray.kernels.contract import ExpertLayer
    from strata_ray.kernels.cpu_pool import CpuPool
    from strata_ray.kernels.expert_cpu import expert_ffn_cpu

    file = _fused_file(tmp_path)
    fused = file.tensor("blk.0.ffn_gate_up_exps.weight").data
    n_ff = fused.shape[1] // 2
    with caplog.at_level("INFO", logger="strata_ray.experts"):
        store = HostStore(file, pin_gib=0)
    lay = store.layer(0)
    assert all(a.flags.c_contiguous for a in (lay.gate, lay.up, lay.down))
    assert not np.shares_memory(lay.gate, fused) and store.arena_bytes == sum(a.nbytes for a in
                                                                             (lay.gate, lay.up, lay.down))
    assert np.array_equal(lay.gate, fused[:, :n_ff]) and np.array_equal(lay.up, fused[:, n_ff:])
    assert np.shares_memory(store.layer(1).gate, file.tensor("blk.1.ffn_gate_exps.weight").data)
    assert "1 fused gate_up layers split into their own memory" in caplog.text
    strided = ExpertLayer(fused[:, :n_ff], fused[:, n_ff:], lay.down, Q8_0, Q8_0, Q8_0)
    x = np.random.default_rng(1).standard_normal((3, lay.n_embd)).astype(np.float32)
    tok, exp = np.array([0, 1, 2, 2]), np.array([5, 0, 5, 3])
    with CpuPool(1) as one:
        assert np.array_equal(expert_ffn_cpu(x, tok, exp, lay, pool=one).view(np.int32),
                              expert_ffn_cpu(x, tok, exp, strided, pool=one).view(np.int32))


def test_a_fused_layer_without_room_stays_strided_and_says_so(tmp_path, monkeypatch, caplog):
    import strata_ray.experts.host_store as host_store

    monkeypatch.setattr(host_store, "spare_memory_gib", lambda: 0.0)
    with caplog.at_level("WARNING", logger="strata_ray.experts"):
        store = HostStore(_fused_file(tmp_path), pin_gib=0)
    assert not store.layer(0).gate.flags.c_contiguous and store.arena_bytes == 0
    assert "1 fused gate_up layers stay in the file map" in caplog.text
