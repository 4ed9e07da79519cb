"""`python -m strata_ray.run` as a user runs it: a tiny synthetic model, real Ray actors on the CPU.

The reference for the token ids is the reference forward with every routed expert computed by the
numpy spec of the arithmetic contract (strata_ray/kernels/spec.py), in this process, without Ray.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from strata_ray.kernels.contract import ExpertLayer
from strata_ray.kernels.spec import expert_ffn_spec
from strata_ray.model.forward import Model
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.hparams import ModelFormatError
from strata_ray.model.moe import combine_rows
from strata_ray.model.synth import write_synth
from strata_ray.model.synth_presets import preset_hparams
from strata_ray.model.tokenizer import Tokenizer
from strata_ray.model.weights import load_dense_weights

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Hello, world"
MAX_TOKENS = 24
SUMMARY = re.compile(r"^strata_ray: prompt: \d+ tokens, [\d.]+ tok/s \| generated: \d+ tokens, [\d.]+ tok/s")


def run_cli(*args, stdin=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "strata_ray.run", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout,
                          **({} if stdin is not None else {"stdin": subprocess.DEVNULL}))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("run_cli") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", progress=False)
    return str(path)


class SpecExperts:
    """ExpertBackend computing every routed row with the numpy spec of the arithmetic contract."""

    def __init__(self, file: GGUFFile):
        self.file = file

    def layer(self, b: int) -> ExpertLayer:
        names = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
        g, u, d = (self.file.tensor(f"blk.{b}.{n}.weight") for n in names)
        return ExpertLayer(g.data, u.data, d.data, g.ggml_type, u.ggml_type, d.ggml_type)

    def __call__(self, layer, x, ids, weights):
        n, k = ids.shape  # x [N, E], ids/weights [N, K]
        tok = np.repeat(np.arange(n, dtype=np.int32), k)
        rows = expert_ffn_spec(x.numpy(), tok, ids.reshape(-1).numpy().astype(np.int32), self.layer(layer))
        return combine_rows(torch.from_numpy(rows).view(n, k, -1), weights)  # [N, E]


def reference_greedy(path: str, prompt_ids: list[int], n: int) -> list[int]:
    file = GGUFFile(path)
    with torch.inference_mode():
        dense = load_dense_weights(file, include_experts=False)
        model = Model(file.hparams, dense, experts=SpecExperts(file))
        state = model.new_state()
        logits = model.forward(prompt_ids, state)[-1]
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model.forward([out[-1]], state)[-1]
    return out


@pytest.fixture(scope="module")
def json_run(tiny_model):
    ids = Tokenizer.from_gguf(GGUFFile(tiny_model)).encode(PROMPT)
    r = run_cli("--model", tiny_model, "--address", "local", "--prompt-ids", ",".join(map(str, ids)),
                "--max-tokens", str(MAX_TOKENS), "--json", "--logprobs", "3")
    return ids, r


def test_a_sampled_run_names_its_seed_and_that_seed_repeats_it(tiny_model):
    """Without --seed a sampled run draws a seed: stderr and the JSON name it, and --seed with it gives the
    same ids (the README's "exact, reproducible output"). A greedy run's seed is null."""
    args = ("--model", tiny_model, "--address", "local", "--prompt", PROMPT, "--max-tokens", "8", "--json",
            "--temperature", "0.9")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    seed = json.loads(first.stdout)["seed"]
    assert isinstance(seed, int)
    assert f"strata_ray: sampled with seed {seed}; --seed {seed} draws the same tokens" in first.stderr
    again = run_cli(*args, "--seed", str(seed))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    assert json.loads(again.stdout)["seed"] == seed and "sampled with seed" not in again.stderr


def test_json_token_ids_equal_the_reference_forward(tiny_model, json_run):
    ids, r = json_run
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one JSON object on stdout
    ref = reference_greedy(tiny_model, ids, MAX_TOKENS)
    got = doc["token_ids"]
    stop_ids = Tokenizer.from_gguf(GGUFFile(tiny_model)).stop_ids
    assert got == ref[: len(got)]
    assert len(got) == MAX_TOKENS or ref[len(got)] in stop_ids
    assert doc["finish_reason"] == ("length" if len(got) == MAX_TOKENS else "stop")
    assert doc["prompt_tokens"] == len(ids) and doc["generated_tokens"] == len(got)
    assert set(doc["timings"]) >= {"prompt_seconds", "decode_seconds", "prompt_tokens_per_second",
                                   "decode_tokens_per_second"}
    assert doc["seed"] is None  # greedy
    assert len(doc["logprobs"]) == len(got)
    for chosen, top in zip(got, doc["logprobs"], strict=True):
        assert len(top) == 3 and top[0]["token_id"] == chosen  # greedy picks the most likely token
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    assert doc["token_logprobs"] == [top[0]["logprob"] for top in doc["logprobs"]]  # greedy: the best one
    lines = r.stderr.splitlines()
    assert lines[0].startswith("strata_ray: started a local Ray instance")
    assert lines[1].startswith("strata_ray: loaded tiny.gguf (qwen3next, 4 layers, 8 experts) on cpu")
    assert SUMMARY.match(lines[-1])


def test_text_streams_to_stdout(tiny_model, json_run):
    r = run_cli("--model", tiny_model, "--address", "local", "--max-tokens", str(MAX_TOKENS), stdin=PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == json.loads(json_run[1].stdout)["text"] and r.stdout
    assert SUMMARY.match(r.stderr.splitlines()[-1])


def test_a_reader_that_goes_away_ends_the_run_quietly(tiny_model):
    """`run ... | head -c 1`: said "strata:primary failed: BrokenPipeError" and exit 1. The reader here takes
    the first byte (the first token goes out at once) and closes the pipe: every later write fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    argv = ["--model", tiny_model, "--address", "local", "--prompt-ids", "1,2,3", "--max-tokens", "2000"]
    proc = subprocess.Popen([sys.executable, "-m", "strata_ray.run", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=REPO)
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err  # 128 + SIGPIPE, as a shell tool
    assert "Error" not in err and "failed" not in err, err


def expected_line(path) -> str:
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(path)
    assert "\n" not in str(e.value)
    return f"strata_ray: {e.value}\n"


def test_missing_model_file(tmp_path):
    path = tmp_path / "nope.gguf"
    r = run_cli("--model", str(path))
    assert (r.returncode, r.stderr, r.stdout) == (2, f"strata_ray: model file not found: {path}\n", "")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n" * 20)
    r = run_cli("--model", str(path))
    assert (r.returncode, r.stderr) == (2, f"strata_ray: not a GGUF file: {path}\n")


@pytest.mark.parametrize("keep", [0.5, 0.001])  # tensor data cut / header cut
def test_truncated_gguf(tiny_model, tmp_path, keep):
    data = Path(tiny_model).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    want = expected_line(path)
    assert want.startswith(f"strata_ray: truncated or corrupt GGUF file: {path}")
    r = run_cli("--model", str(path))
    assert (r.returncode, r.stderr) == (2, want)


def test_unknown_architecture(tmp_path):
    import gguf

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_cli("--model", str(path))
    assert (r.returncode, r.stderr) == (
        2, f"strata_ray: {path}: unsupported model architecture 'llama' (supported: qwen3next, qwen3moe)\n")


@pytest.mark.parametrize("fault", ["Q5_K experts", "no expert stack", "fewer blocks"])
def test_tensors_the_engine_cannot_run_fail_before_ray(tmp_path, fault):
    """Found from the header in the driver: one line and no Ray (its start would be the line before). These
    failed in the primary after Ray started (10 s on 2 cores), the missing stack as `KeyError: 2`, and the
    extra layer not at all."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType

    from tests.model.test_tensor_layout import layout_tensors, write_header

    hp = preset_hparams("qwen3moe", "tiny")
    tensors = layout_tensors(hp)
    if fault == "Q5_K experts":
        q5_k = GGMLQuantizationType.Q5_K
        tensors = {n: (shape, q5_k if n.endswith("_exps.weight") else t) for n, (shape, t) in tensors.items()}
        line = ("12 tensors are Q5_K, which this engine does not run (the first: blk.0.ffn_gate_exps.weight; "
                "it runs F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K)")
    elif fault == "no expert stack":
        del tensors["blk.2.ffn_gate_exps.weight"]
        line = "missing tensor blk.2.ffn_gate_exps.weight"
    else:
        hp = replace(hp, n_layer=3)
        line = "tensor blk.3.attn_norm.weight lies past the 3 blocks of qwen3moe.block_count"
    path = tmp_path / "bad.gguf"
    write_header(path, hp, tensors)
    r = run_cli("--model", str(path), "--device", "cpu", "--address", "local", "--prompt", "x",
                "--max-tokens", "2")
    assert (r.returncode, r.stderr, r.stdout) == (2, f"strata_ray: {path}: {line}\n", "")


@pytest.mark.parametrize(
    "args, line",
    [
        (["--max-tokens", "0"], "--max-tokens: invalid value '0' (allowed: an integer >= 1)"),
        (["--temperature", "-1"], "--temperature: invalid value '-1' (allowed: a number >= 0 and <= 100)"),
        (["--top-p", "1.5"], "--top-p: invalid value '1.5' (allowed: a number >= 0 and <= 1)"),
        (["--top-k", "x"], "--top-k: invalid value 'x' (allowed: an integer >= 0)"),
        (["--logprobs", "50"], "--logprobs: invalid value '50' (allowed: an integer from 0 to 20)"),
        (["--seed", str(2**64)],  # torch's generator takes 64 bits: refused here, not by the primary
         f"--seed: invalid value '{2**64}' (allowed: an integer from 0 to {2**64 - 1})"),
        (["--prompt-ids", "1,x"],
         "--prompt-ids: invalid value '1,x' (allowed: comma-separated token ids >= 0, e.g. 1,2,3)"),
        (["--prompt-ids", "1,288"], "--prompt-ids: token id 288 is out of range (vocabulary of 288)"),
        (["--prompt-file", "/no/such/prompt.txt"],
         "--prompt-file: cannot read /no/such/prompt.txt (No such file or directory)"),
        (["--prompt", "a", "--prompt-ids", "1"],
         "argument --prompt-ids: not allowed with argument --prompt/-p (see --help)"),
        (["--prompt-ids", "1,2", "--chat"],
         "--chat cannot be combined with --prompt-ids (token ids are used as given)"),
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "a", "--logprobs", "3"],
         "--logprobs needs --json (the log-probabilities are printed in the JSON object)"),
    ],
)
def test_bad_flag_values(tiny_model, args, line):
    r = run_cli("--model", tiny_model, *args)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"strata_ray: {line}\n", "")


def test_a_prompt_that_never_ends_is_refused_not_read_until_memory_ends(tiny_model, tmp_path, monkeypatch):
    """--prompt-file /dev/zero, or `yes |` on stdin: one line at PROMPT_LIMIT (it was read until the OOM
    killer came); a prompt at the limit is read whole."""
    import argparse
    import io

    import strata_ray.run as run_module
    from strata_ray.config import ConfigError

    if os.path.exists("/dev/zero"):
        r = run_cli("--model", tiny_model, "--prompt-file", "/dev/zero")
        assert (r.returncode, r.stderr) == (2, "strata_ray: --prompt-file: /dev/zero is longer than 64 MiB; "
                                                "a prompt is text\n")
    monkeypatch.setattr(run_module, "PROMPT_LIMIT", 8)
    (tmp_path / "p.txt").write_text("12345678")
    (tmp_path / "q.txt").write_text("123456789")
    ns = argparse.Namespace(prompt=None, prompt_file=str(tmp_path / "p.txt"))
    assert run_module.read_prompt(ns) == "12345678"
    with pytest.raises(ConfigError, match=r"q.txt is longer than 7.6\d*e-06 MiB; a prompt is text$"):
        run_module.read_prompt(argparse.Namespace(prompt=None, prompt_file=str(tmp_path / "q.txt")))
    stdin = io.TextIOWrapper(io.BytesIO(b"y\n" * 5))
    monkeypatch.setattr(sys, "stdin", stdin)
    with pytest.raises(ConfigError, match="^the prompt on stdin is longer than .* MiB; a prompt is text$"):
        run_module.read_prompt(argparse.Namespace(prompt=None, prompt_file=None))



def test_a_prompt_too_long_for_the_context_is_refused_before_ray_starts(tiny_model, tmp_path):
    """Token ids, a file, a chat-wrapped file and stdin that leave no room in the context: one line, exit 2,
    before Ray starts and the model loads (the primary refused them only after the load, minutes for a large
    model). A text is counted as the primary counts it, its chat template included; a huge one is refused
    on the lower bound, unread."""
    tok = Tokenizer.from_gguf(GGUFFile(tiny_model))
    context = GGUFFile(tiny_model).hparams.context_length

    def line(count) -> str:
        return f"strata_ray: the prompt has {count} tokens; the model's context is {context} tokens\n"

    text = "x" * (context - 5)  # fits alone, not in the chat template
    (tmp_path / "p.txt").write_text(text)
    chat = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])))
    assert len(tok.encode(text)) < context <= chat
    huge = "x" * (4 * tok.max_token_bytes * context)
    (tmp_path / "huge.txt").write_text(huge)
    for args, stdin, count in (
        (["--prompt-ids", ",".join(["5"] * context)], None, context),
        (["--prompt-ids", ",".join(["5"] * (context + 100))], None, context + 100),
        (["--prompt-file", str(tmp_path / "p.txt"), "--chat"], None, chat),
        ([], "x" * context, context),
        (["--prompt-file", str(tmp_path / "huge.txt")], None, f"at least {context}"),
    ):
        started = time.monotonic()
        r = run_cli("--model", tiny_model, "--address", "local", *args, stdin=stdin, timeout=60)
        assert (r.returncode, r.stderr, r.stdout) == (2, line(count), ""), args[:1]
        assert time.monotonic() - started < 30, args[:1]  # Python's imports; no Ray, no load


def test_the_last_prompt_that_fits_generates_one_token_and_ends_with_length(tiny_model):
    """A prompt one token short of the context runs (the driver's check counts as the primary does) and
    ends at the context: one token, "length", whatever --max-tokens asks; --prefill 64 cuts it into 63 full
    chunks and one of 63 tokens."""
    context = GGUFFile(tiny_model).hparams.context_length
    ids = ",".join(str((i * 37 + 11) % 250 + 5) for i in range(context - 1))
    r = run_cli("--model", tiny_model, "--address", "local", "--prompt-ids", ids, "--max-tokens", "2",
                "--prefill", "64", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["prompt_tokens"], doc["generated_tokens"], doc["finish_reason"]) == (context - 1, 1, "length")


def test_a_prompt_that_is_not_utf8_is_one_line(tiny_model):
    """--prompt with bytes that are not UTF-8 (a shell's $'\\xff'): it ended "UnicodeEncodeError: ...
    surrogates not allowed" and exit 1 after the load."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    argv = [os.fsencode(sys.executable), b"-m", b"strata_ray.run", b"--model", os.fsencode(tiny_model),
            b"--address", b"local", b"--prompt", b"ab\xffcd" * 2000]
    r = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, timeout=60, stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stderr, r.stdout) == (2, b"strata_ray: --prompt is not UTF-8 text\n", b"")


def test_the_same_profile_path_for_both_flags_resumes_learning(tiny_model, tmp_path, capsys):
    """--expert-profile P --expert-profile-save P: the first start (nothing at P) fills the cache in the
    default order and says so; later starts read what the last one saved. Another missing path is refused."""
    from dataclasses import replace

    from strata_ray.config import EngineConfig
    from strata_ray.experts.profile import ProfileError, rank_from_counts, write_profile
    from strata_ray.run import check_profile_files

    hp = GGUFFile(tiny_model).hparams
    p = tmp_path / "p.strp"
    cfg = EngineConfig(model=tiny_model, expert_profile=str(p), expert_profile_save=str(p))
    first = check_profile_files(cfg, hp)
    assert first.expert_profile is None and first.expert_profile_save == str(p)
    want = (f"strata_ray: --expert-profile {p}: nothing saved there yet; the expert cache fills in the "
            "default order and the learned profile is saved there\n")
    assert capsys.readouterr().err == want
    write_profile(p, rank_from_counts(np.zeros((hp.n_layer, hp.n_expert), np.int64)))
    assert check_profile_files(cfg, hp).expert_profile == str(p)
    assert capsys.readouterr().err == ""
    with pytest.raises(ProfileError):
        check_profile_files(replace(cfg, expert_profile=str(tmp_path / "other.strp")), hp)


def test_a_learned_profile_at_the_save_path_fills_the_cache_instead(tiny_model, tmp_path, capsys):
    """As the reference engine: what an earlier start saved at --expert-profile-save fills the cache instead
    of --expert-profile (one line), when it fits the model; one that does not is left to be overwritten."""
    from dataclasses import replace

    from strata_ray.config import ConfigError, EngineConfig
    from strata_ray.experts.profile import rank_from_counts, write_profile
    from strata_ray.run import check_profile_files

    hp = GGUFFile(tiny_model).hparams
    given, saved = tmp_path / "given.strp", tmp_path / "saved.strp"
    write_profile(given, rank_from_counts(np.zeros((hp.n_layer, hp.n_expert), np.int64)))
    cfg = EngineConfig(model=tiny_model, expert_profile=str(given), expert_profile_save=str(saved))
    assert check_profile_files(cfg, hp).expert_profile == str(given)  # nothing saved yet
    assert capsys.readouterr().err == ""
    write_profile(saved, rank_from_counts(np.ones((hp.n_layer, hp.n_expert), np.int64)))
    assert check_profile_files(cfg, hp).expert_profile == str(saved)
    assert capsys.readouterr().err == (
        f"strata_ray: --expert-profile-save {saved}: the expert cache fills from the profile an earlier "
        f"start learned there instead of --expert-profile {given}\n")
    write_profile(saved, rank_from_counts(np.ones((hp.n_layer + 1, hp.n_expert), np.int64)))
    assert check_profile_files(cfg, hp).expert_profile == str(given)
    err = capsys.readouterr().err
    assert err.startswith(f"strata_ray: --expert-profile-save: expert profile {saved} ") and err.endswith(
        "; not used to fill the cache (it is overwritten)\n") and err.count("\n") == 1
    notes = tmp_path / "notes.txt"  # a file that is not a profile is never overwritten, nor the model
    notes.write_text("mine")
    for path, why in ((notes, "exists and is not an STRP profile; remove it or give another path"),
                      (tiny_model, "is the --model file; give another path")):
        with pytest.raises(ConfigError) as info:
            check_profile_files(replace(cfg, expert_profile_save=str(path)), hp)
        assert str(info.value) == f"--expert-profile-save: {path} {why}"
    assert notes.read_text() == "mine"


def test_a_profile_made_on_another_model_of_the_shape_is_told(tiny_model, tmp_path, capsys):
    """A profile names the model it was made on (its routers' digest): another model's --expert-profile
    still fills the cache behind one line (the output does not depend on it), another model's learned
    profile at --expert-profile-save is not resumed from (one line; it is overwritten); this model's, or a
    profile naming none (the reference's), pass without a word."""
    from strata_ray.config import EngineConfig
    from strata_ray.experts.profile import rank_from_counts, write_profile
    from strata_ray.model.routing_digest import routing_digest
    from strata_ray.run import check_profile_files

    other_model = tmp_path / "other.gguf"
    write_synth(other_model, arch="qwen3next", preset="tiny", seed=1, progress=False)  # the same shape
    hp, mine, other = (GGUFFile(tiny_model).hparams, routing_digest(GGUFFile(tiny_model)),
                       routing_digest(GGUFFile(other_model)))
    counts = np.ones((hp.n_layer, hp.n_expert), np.int64)
    given, saved = tmp_path / "given.strp", tmp_path / "saved.strp"
    for model in (mine, None):
        write_profile(given, rank_from_counts(counts, model=model))
        cfg = EngineConfig(model=tiny_model, expert_profile=str(given))
        assert check_profile_files(cfg, hp).expert_profile == str(given)
        assert capsys.readouterr().err == ""
    write_profile(given, rank_from_counts(counts, model=other))
    cfg = EngineConfig(model=tiny_model, expert_profile=str(given), expert_profile_save=str(saved))
    assert check_profile_files(cfg, hp).expert_profile == str(given)
    err = capsys.readouterr().err
    assert err.startswith(f"strata_ray: --expert-profile: expert profile {given} was made on another model "
                          f"of this shape (its routers differ: {other.hex()[:12]} against this model's "
                          f"{mine.hex()[:12]}); its ranking fills the cache all the same")
    assert err.count("\n") == 1
    write_profile(given, rank_from_counts(counts, model=mine))
    write_profile(saved, rank_from_counts(counts, model=other))
    assert check_profile_files(cfg, hp).expert_profile == str(given)  # not the other model's learning
    err = capsys.readouterr().err
    assert err.startswith(f"strata_ray: --expert-profile-save: expert profile {saved} was made on another "
                          "model") and err.endswith("; not used to fill the cache (it is overwritten)\n")
    both = EngineConfig(model=tiny_model, expert_profile=str(saved), expert_profile_save=str(saved))
    assert check_profile_files(both, hp).expert_profile == str(saved)  # named by both flags: resumed, told
    assert "was made on another model" in capsys.readouterr().err


def test_a_save_path_that_is_a_device_or_a_fifo_is_refused_and_a_link_written_through(tiny_model, tmp_path):
    """--expert-profile-save /dev/null (or a FIFO) would have renamed a profile over the node (as root,
    /dev/null itself); /proc's folders look writable and are not: each one line at start. A symbolic link
    is accepted: the save writes the file it leads to and keeps the link."""
    from strata_ray.config import ConfigError, EngineConfig
    from strata_ray.experts.profile import rank_from_counts, read_profile, write_profile
    from strata_ray.run import check_profile_files

    hp = GGUFFile(tiny_model).hparams
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused = [(fifo, f"{fifo} is not a regular file; give a file path")]
    if os.path.exists("/dev/null"):
        refused.append(("/dev/null", "/dev/null is not a regular file; give a file path"))
    if os.path.isdir("/proc/self"):
        refused.append(("/proc/x.strp", "/proc/x.strp is not writable"))
    for path, want in refused:
        with pytest.raises(ConfigError) as info:
            check_profile_files(EngineConfig(model=tiny_model, expert_profile_save=str(path)), hp)
        assert str(info.value).startswith(f"--expert-profile-save: {want}"), str(info.value)
        assert "\n" not in str(info.value)
    assert not fifo.is_file() and os.listdir(tmp_path) == ["pipe"]
    (tmp_path / "real").mkdir()
    link, target = tmp_path / "link.strp", tmp_path / "real" / "p.strp"
    link.symlink_to(target)
    check_profile_files(EngineConfig(model=tiny_model, expert_profile_save=str(link)), hp)
    profile = rank_from_counts(np.ones((hp.n_layer, hp.n_expert), np.int64))
    write_profile(str(link), profile)  # what TieredExperts.save_profile calls
    assert link.is_symlink() and read_profile(target) == profile


@pytest.mark.parametrize("where", ["folder", "missing"])
def test_a_save_path_that_cannot_be_written_is_refused_at_start(tiny_model, tmp_path, where):
    """--expert-profile-save naming a folder, or a file in a missing folder: one line before Ray starts, not
    a failed request after the text was generated."""
    (tmp_path / "folder").mkdir()
    path = tmp_path / "folder" if where == "folder" else tmp_path / "nodir" / "p.strp"
    r = run_cli("--model", tiny_model, "--expert-profile-save", str(path), "--max-tokens", "1")
    want = (f"{path} is a folder; give a file path" if where == "folder"
            else f"folder not found: {path.parent}")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"strata_ray: --expert-profile-save: {want}\n")


def test_resuming_learning_from_the_command_line(tiny_model, tmp_path):
    """The README's resume: the same P for both flags, nothing at P yet. The first run fills in the default
    order (one line) and saves P; the second fills from it without a word about it."""
    p = tmp_path / "learned.strp"
    args = ("--model", tiny_model, "--expert-profile", str(p), "--expert-profile-save", str(p),
            "--expert-cache", "8", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--address", "local")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert f"--expert-profile {p}: nothing saved there yet" in first.stderr and p.is_file()
    second = run_cli(*args)
    assert second.returncode == 0 and "nothing saved there yet" not in second.stderr
    assert "pre-filled 8 of 8 slots from the profile" in second.stderr


def test_an_address_nothing_answers_fails_in_seconds(tiny_model):
    """ray.init retries an unanswered HOST:PORT for minutes; run probes it first: one line, exit 2. A
    malformed address is one line too."""
    import socket

    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("--model", tiny_model, "--address", f"127.0.0.1:{port}", "-p", "hi", "--max-tokens", "1",
                timeout=60)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == (
        f"strata_ray: cannot connect to the Ray cluster at 127.0.0.1:{port} (Connection refused; is `ray "
        "start --head` running there?)\n")
    for address in ("foo", "h:\u00b2"):  # '\u00b2' passes str.isdigit(), not int()
        r = run_cli("--model", tiny_model, "--address", address, "-p", "hi", "--max-tokens", "1", timeout=60)
        want = (f"strata_ray: Ray address {address!r} (--address or RAY_ADDRESS): expected HOST:PORT (e.g. "
                "10.0.0.5:6379), 'auto' or 'local'\n")
        assert (r.returncode, r.stderr) == (2, want)


def test_an_address_that_answers_http_is_refused_in_seconds(tiny_model):
    """The dashboard's port (or any web server) accepts the connection, and ray.init then waited on it
    forever, deaf to Ctrl-C; a Jobs API URL in RAY_ADDRESS was a cut-off ValueError and exit 1. Both are
    one line and exit 2 now, in seconds."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        r = run_cli("--model", tiny_model, "--address", f"127.0.0.1:{port}", "-p", "hi", "--max-tokens", "1",
                    timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == (
        f"strata_ray: 127.0.0.1:{port} is a web server (the Ray dashboard's port?), not a Ray cluster's GCS: "
        "give the address `ray start --head` prints for the cluster (port 6379 by default)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
           "RAY_ADDRESS": "http://127.0.0.1:8265"}
    r = subprocess.run([sys.executable, "-m", "strata_ray.run", "--model", tiny_model, "-p", "hi"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("strata_ray: Ray address http://127.0.0.1:8265 (--address or RAY_ADDRESS) is "
                               "a dashboard / Jobs API URL")


def test_a_ray_client_address_is_refused_before_the_model_loads(tiny_model):
    """ray:// (Ray Client) attached, placed the actors and loaded the model, then failed at the first token:
    Ray Client cannot stream an actor's generator."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    address = "ray://127.0.0.1:10001"
    r = subprocess.run([sys.executable, "-m", "strata_ray.run", "--model", tiny_model, "-p", "hi",
                        "--address", address], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"strata_ray: Ray address {address} (--address or RAY_ADDRESS) is a Ray "
                               "Client address, which cannot stream the engine's tokens")


def test_a_prompt_on_stdin_that_is_not_utf8_is_one_line(tiny_model):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "strata_ray.run", "--model", tiny_model],
                       input=b"\xff\xfe\x80abc", capture_output=True, env=env, cwd=REPO, timeout=60)
    want = b"strata_ray: the prompt on stdin is not UTF-8 text\n"
    assert (r.returncode, r.stdout, r.stderr) == (2, b"", want)


def test_ray_address_local_in_the_environment_starts_a_local_instance(tiny_model):
    """RAY_ADDRESS=local means what --address local means (not an address to probe)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "RAY_ADDRESS": "local"}
    r = subprocess.run([sys.executable, "-m", "strata_ray.run", "--model", tiny_model, "--prompt-ids", "1,2",
                        "--max-tokens", "1"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("strata_ray: started a local Ray instance")


def test_a_runs_coordinator_rounds_are_its_own():
    """Kept actors' coordinator counts every run's rounds: --json reports this run's, its status less the
    status read before the run (a key new since then counts from 0)."""
    from strata_ray.run import counts_since

    before = {"rounds": 2, "swaps": 9, "windows": 30}
    assert counts_since({"rounds": 5, "swaps": 12, "windows": 42, "new": 1}, before) == {
        "rounds": 3, "swaps": 3, "windows": 12, "new": 1}
    assert counts_since(None, before) is None and counts_since(before, None) == before


def test_a_cluster_short_of_the_engine_in_all_is_told_at_once():
    """A cluster whose totals cannot hold the engine waited 60 s for room before refusing."""
    from strata_ray.actors.launch import cluster_shortfall

    engine = [{"CPU": 0.1}, {"CPU": 1.0, "GPU": 1.0}]
    assert cluster_shortfall(engine, {"CPU": 1.0, "GPU": 1.0}) == "CPU 1 in all"
    assert cluster_shortfall(engine, {"CPU": 16.0}) == "GPU 0 in all"
    assert cluster_shortfall(engine, {"CPU": 2.0, "GPU": 2.0}) is None


def test_a_stopped_cluster_is_seen_gone():
    """The attached cluster's GCS closed (the cluster stopped under a run): gone, so no Ray call waits ~60 s
    on it; a listening GCS and a local instance we started are not."""
    import socket

    from strata_ray.actors.launch import RaySession, cluster_gone

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert not cluster_gone(RaySession(started=False, address=f"127.0.0.1:{port}"))
    assert cluster_gone(RaySession(started=False, address=f"127.0.0.1:{port}"), within=0.5)
    assert not cluster_gone(RaySession(started=True, address=f"127.0.0.1:{port}"))
    assert not cluster_gone(None)


def test_the_address_of_a_subcommand_is_read_before_ray_loads(monkeypatch, tmp_path):
    """serve imports Ray at once, and Ray reads its auth mode as it loads: main takes --address (and
    RAY_ADDRESS) first, so a token cluster's address attaches as `run`'s does."""
    from strata_ray.actors.launch import prepare_token_auth
    from strata_ray.run import address_in

    assert address_in(["--port", "1", "--address", "h:1", "--address=h:2"]) == "h:2"
    assert address_in(["--address"]) is None and address_in([]) is None
    token = tmp_path / "token"
    token.write_text("t")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for address, mode in (("local", None), ("auto", None), (None, None), ("10.0.0.5:6379", "token")):
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        prepare_token_auth(address)
        assert os.environ.get("RAY_AUTH_MODE") == mode, address
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    prepare_token_auth(None)
    assert os.environ.get("RAY_AUTH_MODE") == "token"


def test_the_dashboard_asked_for_is_told_by_its_url_without_verbose(tiny_model):
    """--address local --dashboard: the session line gives the dashboard's URL (Ray's own line is INFO,
    hidden without -v, so the URL was told nowhere), and the dashboard answers there while the run lasts."""
    import signal
    import time
    import urllib.request

    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.Popen([sys.executable, "-m", "strata_ray.run", "--model", tiny_model, "--address", "local",
                          "--dashboard", "--prompt-ids", "1,2", "--max-tokens", "2000"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=REPO)
    try:
        first = p.stderr.readline()
        m = re.fullmatch(r"strata_ray: started a local Ray instance \(with the dashboard at "
                         r"(http://[\w.\-]+:\d+); `ray start --head` beforehand to attach to a cluster "
                         r"instead\)\n", first)
        assert m, first + p.stderr.read() if p.poll() is not None else first
        deadline = time.monotonic() + 60
        while True:  # the dashboard's web server, up by now or in a moment
            try:
                with urllib.request.urlopen(m[1], timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, "the dashboard did not answer"
                time.sleep(0.5)
    finally:
        p.send_signal(signal.SIGINT)  # the 2000 tokens are not needed: the run ends as at a Ctrl-C
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
