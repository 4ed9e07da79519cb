import hashlib
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.quants import dequantize_tensor
from strata_ray.model.synth import (
    EMBD_COS,
    SynthModel,
    _is_gguf,
    expected_cos_u,
    residual_gain,
    synth_main,
    synth_type,
    write_synth,
    zipf_exponent,
)
from strata_ray.model.synth_presets import SynthError, preset_hparams
from strata_ray.model.tensor_layout import tensor_layout

ARCHS = ("qwen3next", "qwen3moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for arch in ARCHS:
        path = d / f"tiny-{arch}.gguf"
        write_synth(path, arch, "tiny", seed=0, progress=False)
        out[arch] = path
    return out


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_tensors_match_layout_and_types(tiny, arch):
    hp = preset_hparams(arch, "tiny")
    layout = tensor_layout(hp)
    r = gguf.GGUFReader(tiny[arch])
    assert [t.name for t in r.tensors] == [n for n, _ in layout]
    for t, (name, shape) in zip(r.tensors, layout, strict=True):
        assert tuple(int(x) for x in reversed(t.shape)) == shape, name
        assert t.tensor_type == synth_type(name, shape, T.Q4_K), name
    f = GGUFFile(tiny[arch])
    assert f.hparams == hp
    assert {n: (i.shape, i.ggml_type) for n, i in f.tensors.items()} == {
        n: (s, synth_type(n, s, T.Q4_K)) for n, s in layout
    }
    assert f.tensor("blk.0.ffn_gate_exps.weight").ggml_type == T.Q4_K
    assert f.tensor("blk.0.ffn_gate_inp.weight").ggml_type == T.F32
    assert f.tensor("output.weight").ggml_type == T.Q8_0
    assert f.fields["tokenizer.ggml.model"] == "gpt2" and len(f.fields["tokenizer.ggml.tokens"]) == hp.n_vocab
    assert "<|im_start|>" in f.fields["tokenizer.chat_template"]


def test_tiny_qwen3next_has_mtp(tiny):
    f = GGUFFile(tiny["qwen3next"])
    assert f.hparams.n_nextn == 1 and f.fields["qwen3next.block_count"] == f.hparams.n_layer + 1
    assert f.has("blk.4.nextn.eh_proj.weight") and f.has("blk.4.ffn_down_exps.weight")


def test_deterministic_for_a_seed(tiny, tmp_path):
    write_synth(tmp_path / "again.gguf", "qwen3next", "tiny", seed=0, progress=False)
    assert _sha(tmp_path / "again.gguf") == _sha(tiny["qwen3next"])
    write_synth(tmp_path / "other.gguf", "qwen3next", "tiny", seed=1, progress=False)
    assert _sha(tmp_path / "other.gguf") != _sha(tiny["qwen3next"])


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_statistics(tiny, arch):
    f = GGUFFile(tiny[arch])
    hp = f.hparams
    gate = dequantize_tensor(f.tensor("blk.1.ffn_gate_exps.weight"))
    down = dequantize_tensor(f.tensor("blk.1.ffn_down_exps.weight"))
    assert gate.std() == pytest.approx(1 / math.sqrt(hp.n_embd), rel=0.05)
    assert down.std() == pytest.approx(residual_gain(hp.n_layer) / math.sqrt(hp.n_ff_exp), rel=0.05)
    assert not np.array_equal(gate[0], gate[1])  # experts differ
    norm = dequantize_tensor(f.tensor("blk.0.attn_norm.weight"))
    assert norm.min() >= 0.9 and norm.max() <= 1.1
    emb = dequantize_tensor(f.tensor("token_embd.weight"))
    assert np.sqrt((emb**2).mean()) == pytest.approx(1.0, rel=0.05)
    u = SynthModel(hp, 0).signs / math.sqrt(hp.n_embd)
    cos = emb @ u / np.linalg.norm(emb, axis=1)
    assert cos.mean() == pytest.approx(EMBD_COS, rel=0.1)
    if arch == "qwen3next":
        a = dequantize_tensor(f.tensor("blk.0.ssm_a"))
        assert (a < 0).all()
        assert np.isfinite(dequantize_tensor(f.tensor("blk.0.ssm_dt.bias"))).all()


def _route_mass(router, x, k):
    logits = x @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, -1)[:, :k]
    w = np.take_along_axis(p, idx, -1)
    w /= w.sum(-1, keepdims=True)
    mass = np.zeros(router.shape[0])
    np.add.at(mass, idx.ravel(), w.ravel())
    return mass / mass.sum()


@pytest.mark.parametrize("arch", ARCHS)
def test_router_popularity_is_skewed(tiny, arch):
    """Hidden states ~ embeddings of random tokens plus layer-output noise, normed: the top quarter of each
    layer's experts gets clearly more than a quarter of the routing mass, and every expert is used."""
    f = GGUFFile(tiny[arch])
    hp = f.hparams
    emb = dequantize_tensor(f.tensor("token_embd.weight"))
    rng = np.random.default_rng(0)
    norm_name = "post_attention_norm" if arch == "qwen3next" else "ffn_norm"
    hot = []
    for layer in range(hp.n_layer):
        h = emb[rng.integers(0, hp.n_vocab, 4000)]
        h = h + rng.standard_normal(h.shape) * math.sqrt((layer + 0.5) / hp.n_layer)
        x = (
            h
            / np.sqrt((h**2).mean(-1, keepdims=True))
            * dequantize_tensor(f.tensor(f"blk.{layer}.{norm_name}.weight"))
        )
        mass = _route_mass(
            dequantize_tensor(f.tensor(f"blk.{layer}.ffn_gate_inp.weight")), x, hp.n_expert_used
        )
        top = np.sort(mass)[::-1]
        assert top[: hp.n_expert // 4].sum() > 0.4, (layer, top)
        assert top[-1] > 0.005, (layer, top)
        hot.append(int(np.argmax(mass)))
    assert len(set(hot)) > 1  # each layer has its own popularity order


def test_mtp_router_is_skewed_too(tiny):
    """eh_proj carries u from its inputs (embedding, final hidden) to its output, so the MTP layer's router
    sees the direction its Zipf bias is aligned with."""
    f = GGUFFile(tiny["qwen3next"])
    hp = f.hparams
    E, L, rng = hp.n_embd, hp.n_layer, np.random.default_rng(0)
    u = SynthModel(hp, 0).signs / math.sqrt(E)

    def with_cos(c, n=4000):
        g = rng.standard_normal((n, E))
        g -= np.outer(g @ u, u)
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        return (c * u + math.sqrt(1 - c * c) * g) * math.sqrt(E)

    x = np.concatenate([with_cos(EMBD_COS), with_cos(EMBD_COS / math.sqrt(2))], axis=1)
    h = x @ dequantize_tensor(f.tensor(f"blk.{L}.nextn.eh_proj.weight")).T
    assert np.sqrt((h**2).mean()) == pytest.approx(1.0, rel=0.15)
    assert (h @ u / np.linalg.norm(h, axis=1)).mean() == pytest.approx(expected_cos_u(hp, L), rel=0.2)
    x = h / np.sqrt((h**2).mean(-1, keepdims=True))
    mass = _route_mass(dequantize_tensor(f.tensor(f"blk.{L}.ffn_gate_inp.weight")), x, hp.n_expert_used)
    assert np.sort(mass)[::-1][: hp.n_expert // 4].sum() > 0.4


def test_zipf_exponent_hits_target_share():
    for n_expert, k in ((8, 2), (128, 8), (512, 10)):
        s = zipf_exponent(n_expert, k)
        assert s > 0
        logits = (
            -s * np.log1p(np.arange(n_expert))
            + np.random.default_rng(5).standard_normal((3000, n_expert)) * 1.3
        )
        chosen = np.argpartition(-logits, k, axis=1)[:, :k]
        assert np.mean(chosen < n_expert // 4) == pytest.approx(0.55, abs=0.03)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_runs_through_reference_forward(tiny, arch):
    forward = pytest.importorskip("strata_ray.model.forward")
    weights = pytest.importorskip("strata_ray.model.weights")
    f = GGUFFile(tiny[arch])
    model = forward.Model(f.hparams, weights.load_dense_weights(f, "cpu", include_experts=True))
    ids = torch.randint(0, f.hparams.n_vocab, (64,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        state = model.new_state()
        logits, hidden = model.forward(ids, state, return_hidden=True)
        assert torch.isfinite(logits).all() and 0.3 < logits.std() < 5
        if f.hparams.has_mtp:
            assert torch.isfinite(model.mtp_logits(hidden[:-1], ids[1:], state)).all()


@pytest.mark.parametrize("expert_type", ["Q4_0", "Q8_0", "Q6_K"])
def test_expert_types(tmp_path, expert_type):
    path = tmp_path / "e.gguf"
    argv = ["--arch", "qwen3moe", "--preset", "tiny", "--layers", "1", "--expert-type", expert_type]
    assert synth_main([*argv, "-o", str(path), "--no-progress"]) == 0
    f = GGUFFile(path)
    assert f.hparams.n_layer == 1
    info = f.tensor("blk.0.ffn_down_exps.weight")
    assert info.ggml_type == T[expert_type]
    assert np.isfinite(dequantize_tensor(info)).all()


@pytest.mark.parametrize("arch", ["qwen3next", "qwen3moe"])
def test_fused_gate_up_holds_the_unfused_rows(tmp_path, arch):
    """--fused-gate-up: each layer's gate and up experts as one ffn_gate_up_exps [X, 2I, E], gate rows first,
    byte for byte the unfused file's rows (MTP layer included); the other tensors unchanged."""
    argv = ["--arch", arch, "--preset", "tiny", "--layers", "2", "--expert-type", "Q4_0", "--no-progress"]
    assert synth_main([*argv, "-o", str(tmp_path / "u.gguf")]) == 0
    assert synth_main([*argv, "--fused-gate-up", "-o", str(tmp_path / "f.gguf")]) == 0
    plain, fused = GGUFFile(tmp_path / "u.gguf"), GGUFFile(tmp_path / "f.gguf")
    n_fused = 0
    for name, info in plain.tensors.items():
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            both = fused.tensor(name.rsplit(".ffn_", 1)[0] + ".ffn_gate_up_exps.weight").data
            n_ff = both.shape[1] // 2
            half = both[:, :n_ff] if "gate_exps" in name else both[:, n_ff:]
            assert not fused.has(name) and np.array_equal(half, info.data), name
            n_fused += 1
        else:
            assert np.array_equal(fused.tensor(name).data, info.data), name
    assert n_fused == 2 * len([n for n in plain.tensors if n.endswith("ffn_down_exps.weight")]) > 0


def test_dense_type(tmp_path):
    """--dense-type Q6_K: the projections Q6_K where their rows are whole super-blocks, the embedding and
    MTP projection Q8_0 (their values carry the shared direction), norms and the router float."""
    path = tmp_path / "d.gguf"
    argv = ["--arch", "qwen3next", "--preset", "tiny", "--layers", "1", "--dense-type", "Q6_K"]
    assert synth_main([*argv, "-o", str(path), "--no-progress"]) == 0
    f = GGUFFile(path)
    assert f.tensor("blk.0.attn_qkv.weight").ggml_type == T.Q6_K
    assert f.tensor("output.weight").ggml_type == T.Q6_K
    assert f.tensor("token_embd.weight").ggml_type == T.Q8_0
    assert f.tensor("blk.0.ffn_gate_inp.weight").ggml_type == T.F32
    assert np.isfinite(dequantize_tensor(f.tensor("blk.0.attn_qkv.weight"))).all()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "tiny", "-o", "x.gguf"], "needs --arch"),
        (
            ["--arch", "qwen3next", "--preset", "tiny", "--dense-type", "Q4_0", "-o", "x.gguf"],
            "invalid choice",
        ),
        (["--arch", "qwen3next", "--preset", "30b-a3b", "-o", "x.gguf"], "use --arch qwen3moe"),
        (["--arch", "qwen3next", "--preset", "huge", "-o", "x.gguf"], "invalid choice"),
        (["--arch", "qwen3next", "--preset", "tiny", "--layers", "0", "-o", "x.gguf"], "from 1 to 1024"),
        # it built the tensor list first: 1.4 GB and 21 s at 100000, a MemoryError beyond
        (["--arch", "qwen3next", "--preset", "tiny", "--layers", "100000", "-o", "x.gguf"], "from 1 to 1024"),
        (
            ["--arch", "qwen3next", "--preset", "tiny", "--expert-type", "Q5_K", "-o", "x.gguf"],
            "invalid choice",
        ),
        (["--arch", "qwen3next", "--preset", "tiny"], "required"),
        (["--arch", "qwen3next", "--preset", "tiny", "-o", "/no/such/dir/x.gguf"], "does not exist"),
        (["--arch", "qwen3next", "--preset", "tiny", "--seed", "-1", "-o", "x.gguf"],
         "--seed: invalid value '-1' (allowed: an integer >= 0)"),
        (["--arch", "qwen3next", "--preset", "tiny", "-o", "."], "-o .: exists and is not a regular file"),
        (["--arch", "qwen3next", "--preset", "tiny", "-o", ""], "-o: an empty path"),
        # Path() dropped the slash: a file named "newdir" was written
        (["--arch", "qwen3next", "--preset", "tiny", "-o", "newdir/"], "-o newdir/: names a folder"),
        (["--arch", "qwen3next", "--preset", "tiny", "-o", "loop1"], "-o loop1: a loop of symbolic links"),
        # a folder nobody writes in, root included (it said "not enough disk space: 0.0 GB free")
        (["--arch", "qwen3next", "--preset", "tiny", "-o", "/proc/x.gguf"],
         "-o /proc/x.gguf: cannot write in /proc"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink("loop2", tmp_path / "loop1")  # two links that lead to each other: no file to write through
    os.symlink("loop1", tmp_path / "loop2")
    assert synth_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("strata_ray synth: ") and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop1", "loop2"]  # nothing written
    assert (tmp_path / "loop1").is_symlink() and (tmp_path / "loop2").is_symlink()


def test_an_existing_file_at_o_is_never_overwritten_unasked(tmp_path, capsys):
    argv = ["--arch", "qwen3next", "--preset", "tiny", "--layers", "1", "--no-progress", "-o"]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert synth_main([*argv, str(notes), "--force"]) == 2 and notes.read_text() == "mine"  # never a non-GGUF
    assert "exists and is not a GGUF file; remove it or give another path" in capsys.readouterr().err
    model = tmp_path / "m.gguf"
    assert synth_main([*argv, str(model)]) == 0
    before = model.read_bytes()
    capsys.readouterr()
    assert synth_main([*argv, str(model), "--seed", "5"]) == 2 and model.read_bytes() == before
    want = f"strata_ray synth: -o {model}: exists and is a GGUF file: --force overwrites it\n"
    assert capsys.readouterr().err == want
    assert synth_main([*argv, str(model), "--seed", "5", "--force"]) == 0 and model.read_bytes() != before
    assert "1 layer (+1 MTP)" in capsys.readouterr().out
    empty = tmp_path / "empty.gguf"
    empty.touch()  # as `mktemp` leaves it: nothing to lose
    assert synth_main([*argv, str(empty)]) == 0 and _is_gguf(empty)


def test_cli_success_and_implied_arch(tmp_path, capsys):
    assert (
        synth_main(
            ["--preset", "tiny", "--arch", "qwen3next", "-o", str(tmp_path / "a.gguf"), "--no-progress"]
        )
        == 0
    )
    assert "qwen3next" in capsys.readouterr().out
    with pytest.raises(SynthError, match="80b-a3b"):
        preset_hparams("qwen3moe", "80b-a3b")
    assert preset_hparams(None, "80b-a3b").arch == "qwen3next"
    assert preset_hparams(None, "30b-a3b").arch == "qwen3moe"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_is_one_line_and_leaves_no_file(tmp_path, sig):
    """SIGINT (or SIGTERM / SIGHUP: `timeout`, a closed terminal, which left the whole .part file) while the
    writer streams: exit 130, one line, neither the model nor its .part left behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "big.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "strata_ray.run", "synth", "--arch", "qwen3next",
                             "--preset", "80b-a3b", "--layers", "4", "--no-progress", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    deadline = time.monotonic() + 120
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)  # inside the stream
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "strata_ray synth: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_a_file_or_link_at_the_old_part_name_is_left_alone(tmp_path):
    """The writer's temporary file is its own (O_EXCL, a random name): a fixed PATH.part was overwritten and
    deleted, and a symbolic link there had its target overwritten by the model."""
    notes, victim = tmp_path / "m.gguf.part", tmp_path / "victim.txt"
    notes.write_text("my notes")
    victim.write_text("keep me")
    (tmp_path / "n.gguf.part").symlink_to(victim)
    for name in ("m.gguf", "n.gguf"):
        argv = ["--arch", "qwen3moe", "--preset", "tiny", "--no-progress", "-o", str(tmp_path / name)]
        assert synth_main(argv) == 0
        assert (tmp_path / name).is_file() and not (tmp_path / name).is_symlink()
    assert notes.read_text() == "my notes" and victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.part", "n.gguf", "n.gguf.part",
                                                          "victim.txt"]


def test_force_writes_through_a_symbolic_link_to_its_model(tmp_path):
    """--force over a link to a GGUF replaces the model the link leads to and keeps the link (it replaced the
    link with a file and left its target as it was), as --expert-profile-save writes through links."""
    real, link = tmp_path / "real.gguf", tmp_path / "link.gguf"
    base = ["--arch", "qwen3moe", "--preset", "tiny", "--no-progress"]
    assert synth_main([*base, "--seed", "1", "-o", str(real)]) == 0
    first = real.read_bytes()
    link.symlink_to(real)
    assert synth_main([*base, "--seed", "2", "--force", "-o", str(link)]) == 0
    assert link.is_symlink() and real.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.gguf", "real.gguf"]


def test_an_interrupt_before_the_stream_leaves_no_temporary_file(tmp_path, monkeypatch):
    """From the temporary file's making on, any interrupt removes it (its random name is nobody's to clean):
    one raised while the header's fields were added left it behind."""
    import strata_ray.model.gguf_writer as gw

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gw, "_add_field", interrupted)
    argv = ["--arch", "qwen3moe", "--preset", "tiny", "--no-progress", "-o", str(tmp_path / "a.gguf")]
    assert synth_main(argv) == 130
    assert list(tmp_path.iterdir()) == []


def test_sighup_ignored_by_nohup_stays_ignored_while_writing():
    """`nohup` sets SIGHUP to be ignored: the write must go on after the terminal closes; SIGTERM at its
    default becomes the interrupt, and both are as they were after."""
    import signal

    from strata_ray.model.synth import _terminate_as_interrupt

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with _terminate_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))  # the interrupt
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_a_link_into_another_folder_is_checked_and_written_there(tmp_path):
    """The space and writability checks look at the folder the file is written in (a link's target's), and
    a link into a folder that does not exist is one line before any work."""
    (tmp_path / "big").mkdir()
    link = tmp_path / "m.gguf"
    link.symlink_to(tmp_path / "big" / "m.gguf")  # dangling until written
    argv = ["--arch", "qwen3moe", "--preset", "tiny", "--no-progress", "-o", str(link)]
    assert synth_main(argv) == 0
    assert link.is_symlink() and (tmp_path / "big" / "m.gguf").is_file()
    gone = tmp_path / "n.gguf"
    gone.symlink_to(tmp_path / "missing" / "n.gguf")
    with pytest.raises(SynthError, match="whose folder does not exist"):
        write_synth(gone, arch="qwen3moe", preset="tiny")
