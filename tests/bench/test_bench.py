"""flashbench end to end on a tiny synthetic model: the bench JSON, the gates, the --url client, the Ray path.

The model is the tiny qwen3next synth preset with its context shortened to 256 tokens, so the ~4K-token
code gate prompt and the longer bench contexts are cut to fit (and say so), and every run stays short.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from strata_ray.bench import targets
from strata_ray.bench.cli import bench_main
from strata_ray.bench.gate import first_difference
from strata_ray.bench.prompts import PromptBuilder, PromptError, parse_token_count

CONTEXT = 256
FAST = ["--gen", "4", "--story-tokens", "6", "--no-warmup"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from strata_ray.model.quants import T
    from strata_ray.model.synth import build_writer
    from strata_ray.model.synth_presets import preset_hparams

    path = tmp_path_factory.mktemp("bench") / "tiny-ctx256.gguf"
    hp = replace(preset_hparams("qwen3next", "tiny"), context_length=CONTEXT)
    build_writer(path, hp, T["Q4_K"], name="tiny-ctx256").write()
    return str(path)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = bench_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- bench -----------------------------------------------------------------------------------------------


def test_quick_bench_writes_every_field(model_path, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "--local", "--model", model_path, "--quick", "--contexts", "160,1k",
                             "--json-out", str(out_json), *FAST)
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    for key in ("format", "kind", "mode", "time", "argv", "plan", "engine_flags", "model", "device", "git",
                "versions", "results"):
        assert key in doc, key
    assert doc["mode"] == "local" and doc["plan"]["repeats"] == 1
    assert doc["engine_flags"]["model"] == model_path and "peer_device" in doc["engine_flags"]
    assert doc["model"]["arch"] == "qwen3next" and doc["model"]["context_length"] == CONTEXT
    assert doc["device"]["engine_device"] == "cpu"
    assert set(doc["versions"]) >= {"torch", "ray", "numpy", "strata_ray"}
    assert doc["git"] is None or len(doc["git"]["commit"]) == 40
    small, cut = doc["results"]["contexts"]
    assert small["prompt_tokens"] == 160 and small["note"] is None
    assert cut["context"] == 1024 and cut["prompt_tokens"] < CONTEXT and "cut from 1024" in cut["note"]
    for c in (small, cut):
        assert c["prefill_tps"] > 0 and len(c["runs"]) == 1
        assert c["decode_tps"] > 0 if c["decode_tps"] is not None else c["decode_note"]  # a rate, or why not
        assert c["runs"][0]["engine_prompt_s"] > 0
    assert doc["results"]["story"]["tokens"] == 6 and doc["results"]["story"]["runs"]
    assert "prefill tok/s" in out and "cut from 1024" in out and "cut from 1024" in err


def test_plot_without_matplotlib_is_one_line_before_running(model_path, tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, out, err = run_cli(capsys, "--local", "--model", model_path, "--contexts", "160",
                                 "--plot", str(tmp_path / "p.png"), *FAST)
        assert code == 2 and err.strip().count("\n") == 0 and "matplotlib" in err and out == ""
        return
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--contexts", "160", "--repeats", "1",
                           "--plot", str(tmp_path / "p.png"), *FAST)
    assert code == 0, err
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("head", [[], ["gate", "--against", "r.json"]])
def test_a_bad_command_line_speaks_as_bench(capsys, head):
    """argparse's own errors carry the prefix of bench's other errors."""
    with pytest.raises(SystemExit) as e:
        bench_main([*head, "--bogus"])
    assert (e.value.code, capsys.readouterr().err) == (
        2, "strata_ray bench: unrecognized arguments: --bogus (see --help)\n")


def test_bench_reads_the_profile_flags_as_run_does(model_path, tmp_path, capsys):
    """The same missing P for --expert-profile and --expert-profile-save: a first start (one line), and the
    learned profile is saved there; a folder as the save path is one line before the model loads."""
    p = tmp_path / "p.strp"
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--contexts", "160", "--repeats", "1",
                           "--expert-profile", str(p), "--expert-profile-save", str(p), *FAST)
    assert code == 0, err
    assert f"--expert-profile {p}: nothing saved there yet" in err and p.is_file()
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--expert-profile-save", str(tmp_path))
    assert (code, err) == (2, f"strata_ray bench: --expert-profile-save: {tmp_path} is a folder; give a file "
                              "path\n")


def test_bad_flags_end_in_one_line(model_path, tmp_path, capsys):
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--contexts", "8x")
    assert code == 2 and "--contexts" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "--local", "--model", str(tmp_path / "missing.gguf"))
    assert code == 2 and err.count("\n") == 1
    # the --url flags without --url: a forgotten --url, refused instead of ignored
    for flag, value in (("--api", "completions"), ("--served-model", "m"), ("--api-key", "k")):
        code, _, err = run_cli(capsys, "--local", "--model", model_path, flag, value)
        assert (code, err) == (2, f"strata_ray bench: {flag} applies with --url only\n")
    # the Ray flags where no Ray runs: they were accepted and did nothing
    for target, flags in ((["--local"], ["--address", "bogus"]), (["--local"], ["--replace-actors"]),
                          (["--url", "http://127.0.0.1:9"], ["--address", "auto"])):
        code, _, err = run_cli(capsys, *target, "--model", model_path, *flags)
        assert (code, err) == (2, f"strata_ray bench: {flags[0]} applies to the Ray actors only, not with "
                                  f"{target[0]}\n")
    # one generated token leaves no decode to time (it reported 0.00 tok/s)
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--gen", "1")
    assert (code, err) == (2, "strata_ray bench: --gen: invalid value '1' (allowed: an integer >= 2)\n")
    missing = str(tmp_path / "no.json")
    code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--against", missing)
    assert code == 2 and "file not found" in err and err.count("\n") == 1


@pytest.mark.parametrize("command, flag", [("run", "--json-out"), ("run", "--plot"), ("gate", "--save")])
def test_an_output_that_cannot_be_written_is_refused_before_the_run(model_path, tmp_path, capsys, command,
                                                                    flag):
    """The JSON, the plot and a gate reference are written after the whole run: a missing folder or a
    folder as the path is refused at once (before the model loads), and no .tmp file is left behind."""
    (tmp_path / "adir").mkdir()
    head = [] if command == "run" else [command]
    for path, want in ((tmp_path / "nodir" / "r.json", f"folder not found: {tmp_path / 'nodir'}"),
                       (tmp_path / "adir", f"{tmp_path / 'adir'} is a folder; give a file path")):
        code, _, err = run_cli(capsys, *head, "--local", "--model", model_path, flag, str(path))
        assert (code, err) == (2, f"strata_ray bench: {flag}: {want}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


def test_an_output_never_replaces_the_model(model_path, capsys):
    before = Path(model_path).read_bytes()[:4096]
    code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--save", model_path)
    assert (code, err) == (2, f"strata_ray bench: --save: {os.path.abspath(model_path)} is the --model file; "
                              "give another path\n")
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--json-out", model_path)
    assert code == 2 and "is the --model file" in err and Path(model_path).read_bytes()[:4096] == before


def test_an_output_of_the_same_kind_is_replaced_and_another_kind_refused(model_path, tmp_path, capsys):
    """Another JSON object too (a serve.json passed the "{" check and was replaced by a gate reference)."""
    notes, ref, config = tmp_path / "notes.txt", tmp_path / "ref.json", tmp_path / "serve.json"
    notes.write_text("mine")
    config.write_text('{"host": "0.0.0.0", "port": 8000}')
    for path in (notes, config):
        for flag, kind in (("--save", "a gate reference"), ("--json-out", "a JSON report")):
            head = ["gate"] if flag == "--save" else []
            code, _, err = run_cli(capsys, *head, "--local", "--model", model_path, flag, str(path))
            assert (code, err) == (2, f"strata_ray bench: {flag}: {path} exists and is not {kind}; remove it "
                                      "or give another path\n")
    assert notes.read_text() == "mine" and config.read_text() == '{"host": "0.0.0.0", "port": 8000}'
    for _ in range(2):  # an earlier reference at the path: replaced
        code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "-n", "2", "--save",
                               str(ref))
        assert code == 0, err


def test_results_that_cannot_be_written_go_to_stdout_instead(tmp_path, capsys):
    from strata_ray.bench.report import write_or_show

    gone = tmp_path / "gone" / "r.json"  # its folder removed during the run (a full disk fails the same way)
    assert not write_or_show(str(gone), '{"results": 1}\n', "--json-out")
    out, err = capsys.readouterr()
    assert out == '{"results": 1}\n'
    assert err == (f"strata_ray bench: --json-out {gone}: cannot write (No such file or directory); the "
                   "results follow on stdout instead\n")
    assert write_or_show(str(tmp_path / "r.json"), "{}\n", "--save") and capsys.readouterr() == ("", "")


def test_an_atomic_write_that_fails_leaves_nothing_behind(tmp_path):
    from strata_ray.atomic_file import write_atomic

    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "adir", "{}")
    (tmp_path / "r.json.tmp").write_text("the user's own")  # never the temporary file's name
    write_atomic(tmp_path / "r.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "r.json", "r.json.tmp"]
    assert (tmp_path / "r.json").read_text() == "{}\n"
    assert (tmp_path / "r.json.tmp").read_text() == "the user's own"
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~mask  # as open() makes it (not 0600)


@pytest.mark.parametrize("command, flag", [("run", "--json-out"), ("run", "--plot"), ("gate", "--save")])
def test_an_empty_output_path_is_refused_not_dropped(model_path, capsys, command, flag):
    """An empty --json-out or --plot ran the whole bench and wrote nothing; an empty --save was read as no
    --save and the gate then loaded a reference of None (a TypeError). One line before any work now."""
    head = [] if command == "run" else [command]
    code, _, err = run_cli(capsys, *head, "--local", "--model", model_path, flag, "")
    assert (code, err) == (2, f"strata_ray bench: {flag}: an empty path; give the file to write\n")


def test_a_context_listed_twice_is_measured_once_and_said_so(capsys):
    """A context named twice is one measurement, told as "listed twice" (it said "the same as context 1024
    after the cut" where nothing was cut); a context the cut brings to an earlier one's size still says so."""
    from strata_ray.bench.cli import fit_contexts
    from strata_ray.bench.measure import BenchPlan

    plan = BenchPlan(contexts=(100, 100, 300, 400), gen_tokens=16, repeats=1, story_tokens=0)
    kept = fit_contexts(plan, PromptBuilder(context_length=CONTEXT))  # 300 and 400 both cut to 208
    assert kept.contexts == (100, 300)
    err = capsys.readouterr().err
    assert "note: context 100 is listed twice; measured once" in err
    assert "note: context 400 is the same as context 300 after the cut; measured once" in err


@pytest.mark.parametrize("flag, line", [
    ("--contexts", "--contexts: invalid value '' (allowed: token counts such as 8192 or 8k (k = 1024))"),
    ("--repeats", "--repeats: invalid value '' (allowed: an integer >= 1)"),
])
def test_an_empty_contexts_or_repeats_is_refused_not_the_default(model_path, capsys, flag, line):
    code, _, err = run_cli(capsys, "--local", "--model", model_path, flag, "")
    assert (code, err) == (2, f"strata_ray bench: {line}\n")


@pytest.mark.parametrize("command", [["--contexts", "64", "--story-tokens", "0", "--no-warmup"],
                                     ["gate", "--save", "ref.json"]])
def test_generated_tokens_that_fill_the_context_are_one_line(model_path, tmp_path, capsys, monkeypatch,
                                                              command):
    """--gen (or the gate's --max-tokens) at the model's context or past it: it said "prompt cut from 64 to
    -56 tokens", then that a prompt of -56 tokens was shorter than its fixed text, after the model's load.
    Now one line from the model's header, and no target opens (no load, no Ray)."""
    import strata_ray.bench.cli as bench_cli

    def no_target(*_):
        raise AssertionError("the target opened")

    monkeypatch.setattr(bench_cli, "open_target", no_target)
    gen = ["--gen", str(CONTEXT)] if command[0] != "gate" else ["--max-tokens", str(CONTEXT)]
    command = [tmp_path / c if c.endswith(".json") else c for c in command]
    code, out, err = run_cli(capsys, *map(str, command), "--local", "--model", model_path, *gen)
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (f"strata_ray bench: no prompt fits the model's context of {CONTEXT} "
                                    f"tokens beside {CONTEXT} generated ones")
    assert "cut from" not in err and not (tmp_path / "ref.json").exists()
    with pytest.raises(PromptError, match=f"^no prompt fits the model's context of {CONTEXT} tokens"):
        PromptBuilder(context_length=CONTEXT).check_room(CONTEXT - 8)
    PromptBuilder(context_length=CONTEXT).check_room(CONTEXT - 16)  # room left
    PromptBuilder().check_room(10**9)  # an unknown context: no refusal
    builder = PromptBuilder(None, CONTEXT)  # an estimate (a foreign server): the same refusal
    with pytest.raises(PromptError, match=f"^no prompt fits the model's context of {CONTEXT} tokens"):
        builder.fit(64, CONTEXT - 8)
    assert builder.fit(64, CONTEXT - 16)[0] >= 1  # room left: a cut prompt, as before


def test_a_seed_beyond_64_bits_is_one_line_before_the_model_loads(model_path, capsys):
    code, _, err = run_cli(capsys, "--local", "--model", model_path, "--seed", str(2**64))
    assert (code, err) == (2, f"strata_ray bench: --seed: invalid value '{2**64}' "
                              f"(allowed: an integer from 0 to {2**64 - 1})\n")


def test_prompts_have_exact_lengths_and_random_prefixes(model_path):
    from strata_ray.bench.targets import open_model_file

    file, _, tok = open_model_file(model_path)
    builder = PromptBuilder(tok, None)  # no context limit: nothing cut
    a, b = builder.bench_prompt(900, 8), builder.bench_prompt(900, 8)
    assert len(a.ids) == a.n_tokens == 900 and a.note is None
    assert a.ids != b.ids and a.content.startswith("[bench-id ")
    chat, code, math = builder.gate_prompts(256)
    assert abs(code.n_tokens - 4096) < 64 and chat.ids == builder.gate_prompts(256)[0].ids
    assert parse_token_count("8k") == 8192 and parse_token_count("1000") == 1000
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 2], [1, 2, 3]) == 2


def test_a_server_that_counts_tokens_sizes_the_prompts_without_the_tokenizer(model_path):
    from strata_ray.bench.targets import open_model_file

    _, _, tok = open_model_file(model_path)
    asked = []

    def count(content: str) -> int:  # what a server's /tokenize answers: the chat-templated prompt's tokens
        asked.append(content)
        return len(tok.encode(tok.apply_chat_template([{"role": "user", "content": content}])))

    builder = PromptBuilder(None, 4096, count_tokens=count)
    for n in (180, 333, 2000):
        asked.clear()
        p = builder.bench_prompt(n, 8)
        assert 0.99 * n <= p.n_tokens <= n and p.n_tokens == count(p.content) and p.ids is None
        assert len(asked) <= 9  # at most COUNTED_STEPS, and the check here
    short = builder.bench_prompt(64, 8)  # shorter than the fixed text (153 tokens here): that text, counted
    assert short.n_tokens == count(short.content) > 64
    assert builder.fit(5000, 8) == (4096 - 8 - 8, "prompt cut from 5000 to 4080 tokens to fit the model's "
                                    "context of 4096 with 8 generated tokens")  # counted: no slack
    story = builder.story_prompt()
    assert story.n_tokens == count(story.content)
    estimated = PromptBuilder(None, 4096, count_tokens=lambda _content: None)  # a server that stopped
    assert estimated.bench_prompt(333, 8).n_tokens == 333  # the estimate, as without a counter


def test_the_warm_up_runs_the_story_then_the_smallest_depth(model_path):
    """run_plan's untimed warm-up: the short story prompt (the decode's kernels), then a prompt of the
    smallest context (the prompt path's first-use compiles at that size), each a few tokens; then the timed
    runs; plan_steps counts them all."""
    from strata_ray.bench.measure import WARMUP_GEN_TOKENS, BenchPlan, LocalRunner, plan_steps, run_plan
    from strata_ray.bench.targets import open_model_file
    from strata_ray.config import EngineConfig
    from strata_ray.engine.engine import Engine
    from strata_ray.engine.sampling import SamplingParams

    class Recording(LocalRunner):  # the real engine, its prompts noted
        def run(self, prompt, max_tokens, sampling):
            seen.append((prompt.name, prompt.n_tokens, max_tokens))
            return super().run(prompt, max_tokens, sampling)

    _, _, tok = open_model_file(model_path)
    runner, seen = Recording(Engine(EngineConfig(model=model_path, device="cpu"))), []
    plan = BenchPlan(contexts=(200, 160), gen_tokens=3, repeats=1, story_tokens=0)
    steps = []
    run_plan(runner, PromptBuilder(tok, None), plan, SamplingParams(), progress=steps.append)
    assert seen[1:] == [("ctx160", 160, WARMUP_GEN_TOKENS), ("ctx200", 200, 3), ("ctx160", 160, 3)]
    assert seen[0][0] == "story" and seen[0][1] > 0 and seen[0][2] == WARMUP_GEN_TOKENS
    assert steps[:2] == ["warm-up", "warm-up"] and len(steps) == plan_steps(plan) == 4
    assert plan_steps(replace(plan, warmup=False)) == 2 and plan_steps(replace(plan, contexts=())) == 1


def test_a_ctrl_c_keeps_what_the_sweep_measured(model_path):
    """A Ctrl-C in a long sweep returned nothing ("interrupted"): now the contexts measured before it, the
    one it fell in with its finished runs, and interrupted: true."""
    from strata_ray.bench.measure import BenchPlan, LocalRunner, run_plan
    from strata_ray.bench.targets import open_model_file
    from strata_ray.config import EngineConfig
    from strata_ray.engine.engine import Engine
    from strata_ray.engine.sampling import SamplingParams

    class CtrlCAt(LocalRunner):  # the real engine; the user's Ctrl-C arrives as the n-th run starts
        def __init__(self, engine, n):
            super().__init__(engine)
            self.left = n

        def run(self, prompt, max_tokens, sampling):
            self.left -= 1
            if self.left == 0:
                raise KeyboardInterrupt
            return super().run(prompt, max_tokens, sampling)

    _, _, tok = open_model_file(model_path)
    engine = Engine(EngineConfig(model=model_path, device="cpu"))
    plan = BenchPlan(contexts=(160, 200), gen_tokens=3, repeats=2, story_tokens=6, warmup=False)
    got = run_plan(CtrlCAt(engine, 4), PromptBuilder(tok, None), plan, SamplingParams())  # in ctx200's 2nd
    assert got["interrupted"] and got["story"] is None
    assert [(c["context"], len(c["runs"])) for c in got["contexts"]] == [(160, 2), (200, 1)]
    from strata_ray.bench import report

    plan_doc = {"quick": False, "contexts": [160, 200], "gen_tokens": 3, "repeats": 2, "story_tokens": 6,
                "warmup": False, "sampling": {}}
    doc = report.build_report("bench", "local", got, plan=plan_doc, config=None,
                              model=report.model_info(None, None), device=report.device_info("cpu"),
                              server=None, argv=[])
    assert report.table(doc).splitlines()[-1] == "interrupted: medians of the 2, 1 run(s) measured"
    whole = run_plan(CtrlCAt(engine, 99), PromptBuilder(tok, None), plan, SamplingParams())
    assert "interrupted" not in whole and whole["story"] is not None
    assert run_plan(CtrlCAt(engine, 1), PromptBuilder(tok, None), plan, SamplingParams())["contexts"] == []


# ---- gates -----------------------------------------------------------------------------------------------


def test_gate_passes_against_itself_and_fails_on_one_different_token(model_path, tmp_path, capsys):
    ref = str(tmp_path / "ref.json")
    sampled = ["--local", "--model", model_path, "--temperature", "1"]
    code, out, err = run_cli(capsys, "gate", *sampled, "--seed", "1", "--max-tokens", "6", "--save", ref)
    assert code == 0, err
    doc = json.loads(open(ref).read())
    assert doc["kind"] == "gate" and [o["name"] for o in doc["outputs"]] == ["chat", "code", "math"]
    assert "cut from 4096" in doc["outputs"][1]["note"] and "note: code" in err

    code, out, err = run_cli(capsys, "gate", *sampled, "--against", ref)  # the saved seed: identical
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "GATE: PASS"

    # a flag that changes the reference's sampling can never match it: refused, not a FAIL
    code, out, err = run_cli(capsys, "gate", *sampled, "--seed", "2", "--against", ref)
    assert (code, out) == (2, "") and err == ("strata_ray bench: --seed 2 differs from the reference's 1: "
                                              "--against runs the reference's sampling (drop the flag)\n")
    greedy, local = str(tmp_path / "greedy.json"), ["gate", "--local", "--model", model_path]
    code, _, err = run_cli(capsys, *local, "--max-tokens", "3", "--save", greedy)
    assert code == 0, err
    code, out, err = run_cli(capsys, *local, "--seed", "7", "--top-k", "40", "--against", greedy)
    assert code == 0 and out.strip().splitlines()[-1] == "GATE: PASS", err  # greedy: they change nothing
    code, _, err = run_cli(capsys, *local, "--temperature", "1", "--seed", "7", "--against", greedy)
    assert (code, err) == (2, "strata_ray bench: --temperature 1.0 differs from the reference's 0.0: "
                              "--against runs the reference's sampling (drop the flag)\n")
    code, _, err = run_cli(capsys, "gate", *sampled, "--max-tokens", "3", "--against", ref)
    assert (code, err) == (2, "strata_ray bench: --max-tokens applies with --save (--against runs the "
                              "reference's count)\n")
    doc["outputs"][1]["token_ids"][2] = (doc["outputs"][1]["token_ids"][2] + 1) % doc["model"]["n_vocab"]
    open(ref, "w").write(json.dumps(doc))  # one token of the code prompt's changed
    code, out, err = run_cli(capsys, "gate", *sampled, "--against", ref)
    assert code == 1
    lines = out.strip().splitlines()
    assert lines[-1] == "GATE: FAIL (1 of 3 differ)"
    first = next(ln for ln in lines if "first difference at token" in ln)
    assert "first difference at token 2" in first and "reference" in first and "now" in first


def test_min_p_is_a_sampling_flag_as_in_run(model_path, tmp_path, capsys):
    from argparse import Namespace

    from strata_ray.bench.cli import parse_sampling

    flags = {"temperature": "1", "top_k": None, "top_p": None, "min_p": "0.1", "seed": "3"}
    assert parse_sampling(Namespace(**flags)).min_p == 0.1
    saved = {"min_p": 0.2}  # a reference's, where the flag is not given
    assert parse_sampling(Namespace(**{**flags, "min_p": None}), saved).min_p == 0.2
    code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--min-p", "2", "--save",
                           str(tmp_path / "r.json"))
    want = "strata_ray bench: --min-p: invalid value '2' (allowed: a number >= 0 and <= 1)\n"
    assert (code, err) == (2, want)


def test_a_gate_that_can_never_pass_is_refused(model_path, tmp_path, capsys):
    ref = str(tmp_path / "ref.json")
    code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--temperature", "0.8",
                           "--save", ref)
    assert (code, err) == (2, "strata_ray bench: --save: a sampled gate (--temperature > 0) needs --seed: "
                              "without one no later run can draw the same tokens\n")
    doc = {"format": 1, "kind": "gate", "gen_tokens": 4, "outputs": [GOOD_OUTPUT],
           "model": {"arch": "qwen3moe", "n_layer": 2, "n_vocab": 288}}
    open(ref, "w").write(json.dumps(doc))  # made with another model
    code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--against", ref)
    want = (f"strata_ray bench: --against: {ref} was made with another model (arch qwen3moe, n_layer 2; "
            "this one: arch qwen3next, n_layer 4)")
    assert code == 2 and err.splitlines()[-1] == want
    open(ref, "w").write(json.dumps({**doc, "format": 99}))
    code, _, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--against", ref)
    assert (code, err) == (2, f"strata_ray bench: --against: {ref} is a gate reference of format 99; this "
                              "version reads format 1 (make one with --save)\n")


GOOD_OUTPUT = {"name": "chat", "prompt": "hi", "prompt_tokens": 3, "token_ids": [1, 2], "text": "ab",
               "note": None}


@pytest.mark.parametrize("fields, problem", [
    ({"gen_tokens": "x"}, 'gen_tokens "x" is not an integer >= 1'),
    ({"gen_tokens": -3}, "gen_tokens -3 is not an integer >= 1"),
    ({"outputs": []}, "no outputs to compare"),
    ({"outputs": [1]}, "outputs[0] is not an object with name, prompt, text and token_ids"),
    ({"outputs": [{"name": "a"}]}, "outputs[0] is not an object with name, prompt, text and token_ids"),
    ({"outputs": [{**GOOD_OUTPUT, "token_ids": ["1"]}]},
     "outputs[0] is not an object with name, prompt, text and token_ids"),
    ({"sampling": 3}, "sampling is not an object"),
    ({"sampling": {"temperature": "hot"}}, 'sampling.temperature "hot" is not a number'),
    ({"sampling": {"seed": 1.5}}, "sampling.seed 1.5 is not an integer"),
    ({"sampling": {"temperature": -1}}, "sampling: temperature must be >= 0, got -1"),
    ({"sampling": {"top_p": -1}}, "sampling: top_p must be in [0, 1], got -1"),
    ({"sampling": {"temperature": 1e308, "seed": 1}}, "sampling.temperature 1e+308 is above 100"),
    # it ran, and could only fail: no run draws an unseeded sample's tokens again (--save refuses to make one)
    ({"sampling": {"temperature": 0.8}}, "sampled (temperature > 0) without a seed: no run can draw its "
                                         "tokens again"),
])
def test_a_malformed_gate_reference_is_one_line_before_the_model_loads(model_path, tmp_path, capsys, fields,
                                                                       problem):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"format": 1, "kind": "gate", "gen_tokens": 4, "outputs": [GOOD_OUTPUT],
                               **fields}))
    code, out, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--against", str(ref))
    assert (code, out) == (2, "")
    assert err == (f"strata_ray bench: --against: {ref} is not a valid gate reference ({problem}); "
                   "make one with --save\n")


def test_a_reference_that_never_ends_is_one_line(model_path, capsys):
    """/dev/zero as the reference was read until the host's memory ran out (exit 137)."""
    code, out, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--against", "/dev/zero")
    assert (code, out) == (2, "")
    assert err == ("strata_ray bench: --against: /dev/zero is longer than 64 MiB; a gate reference is a few "
                   "MiB at most\n")


@pytest.mark.slow
def test_a_request_error_in_the_primary_is_its_own_line_through_ray(model_path, tmp_path):
    """A saved prompt past the model's context, refused by the primary: its line, where the bench printed the
    first line of Ray's wrapper (the task's header, "ray::Primary.generate_stream() (pid=...")."""
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"format": 1, "kind": "gate", "gen_tokens": 4,
                               "outputs": [{**GOOD_OUTPUT, "prompt": "x " * 20000}]}))
    ray_tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # as test_bench_through_the_ray_actors
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp}
    done = subprocess.run(
        [sys.executable, "-m", "strata_ray.run", "bench", "gate", "--address", "local", "--model", model_path,
         "--against", str(ref)], capture_output=True, text=True, timeout=240, env=env)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("strata_ray bench: the prompt has "), done.stderr[-2000:]
    assert "context" in last and "ray::" not in last


def test_a_reference_with_ids_outside_the_vocabulary_is_refused_before_the_run(model_path, tmp_path, capsys):
    """Checked once the model (its vocabulary) is loaded, before any prompt runs."""
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"format": 1, "kind": "gate", "gen_tokens": 4,
                               "outputs": [{**GOOD_OUTPUT, "token_ids": [1, 99999]}]}))
    code, out, err = run_cli(capsys, "gate", "--local", "--model", model_path, "--against", str(ref))
    last = err.splitlines()[-1]
    assert (code, out) == (2, "") and last.startswith(
        f"strata_ray bench: --against: {ref}: chat holds token id 99999, outside this model's vocabulary of ")
    assert last.endswith(" (a reference made with another model?)")


def test_longgate_refuses_a_gate_reference(model_path, tmp_path, capsys):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"format": 1, "kind": "gate", "gen_tokens": 4, "outputs": []}))
    code, _, err = run_cli(capsys, "longgate", "--local", "--model", model_path, "--against", str(ref))
    assert code == 2 and "gate reference" in err


# ---- --url: the project's OpenAI-compatible server (`run serve`), started for these tests --------------


API_KEY = "bench-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = work / "serve.json"
    config.write_text(json.dumps({"model": model_path, "host": "127.0.0.1", "port": port, "api_key": API_KEY,
                                  "args": ["--device", "cpu"]}))
    log = work / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "strata_ray.run", "serve", "--config", str(config),
                                 "--address", "local"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the server exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"the server did not start: {log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("loaded"):
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # starts the server: Ray Serve takes ~30 s to come up
def test_url_bench_times_a_streaming_server(model_path, server_url, tmp_path, capsys):
    out_json = tmp_path / "u.json"
    code, out, err = run_cli(capsys, "--url", server_url, "--api-key", API_KEY, "--model", model_path,
                             "--contexts", "160", "--repeats", "1", "--json-out", str(out_json), *FAST)
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    assert doc["mode"] == "url" and doc["server"]["model"] and doc["engine_flags"] is None
    (c,) = doc["results"]["contexts"]
    run = c["runs"][0]
    assert c["prompt_tokens"] == 160 == run["prompt_tokens"]  # the server's usage agrees with our prompt
    assert run["generated_tokens"] == 4 and c["prefill_tps"] > 0 and run["engine_prompt_s"] is None


@pytest.mark.slow
def test_url_bench_without_the_model_file_cuts_prompts_to_the_servers_context(server_url, tmp_path, capsys):
    # no --model: the context comes from the server's /v1/models (max_model_len); before, the 1024-token
    # prompt went out whole and the server refused it (HTTP 400, context exceeded). The lengths are counted
    # by the server's /tokenize (an estimate was ~2.4x short on this model's byte-level tokenizer)
    out_json = tmp_path / "u.json"
    code, out, err = run_cli(capsys, "--url", server_url, "--api-key", API_KEY, "--contexts", "64,1024",
                             "--repeats", "1", "--json-out", str(out_json), *FAST)
    assert code == 0, err
    room = CONTEXT - 4 - 8  # counted by the server's /tokenize: exact, no slack
    short, cut = json.loads(out_json.read_text())["results"]["contexts"]
    assert short["prompt_tokens"] == short["runs"][0]["prompt_tokens"]  # its fixed text alone is > 64 here
    assert 0.99 * room <= cut["prompt_tokens"] == cut["runs"][0]["prompt_tokens"] <= room
    assert f"prompt cut from 1024 to {room} tokens to fit the model's context of {CONTEXT}" in err
    assert "prompt lengths counted by the server's /tokenize" in err


@pytest.mark.slow
def test_url_gate_matches_the_local_engine(model_path, server_url, tmp_path, capsys):
    ref = str(tmp_path / "ref.json")
    local = ["--local", "--model", model_path]
    code, _, err = run_cli(capsys, "gate", *local, "--max-tokens", "5", "--save", ref)
    assert code == 0, err
    code, out, err = run_cli(capsys, "gate", "--url", server_url, "--api-key", API_KEY, "--model", model_path,
                             "--against", ref)
    assert code == 0, out + err
    assert "same text" in out and out.strip().splitlines()[-1] == "GATE: PASS"  # the server sends no ids


@pytest.mark.slow
def test_url_without_the_api_key_is_one_line(model_path, server_url, capsys):
    code, _, err = run_cli(capsys, "--url", server_url, "--api-key", "wrong", "--contexts", "160", *FAST)
    assert code == 2 and "HTTP 401" in err and err.count("\n") == 1


@pytest.mark.parametrize("url, problem", [("notaurl", "expected http://HOST[:PORT] or https://HOST[:PORT]"),
                                          ("ftp://host", "expected http://HOST[:PORT] or https://HOST[:PORT]"),
                                          ("http://[::1", "not a URL (Invalid IPv6 URL)")])
def test_a_bad_url_is_one_line_before_anything_is_sent(capsys, url, problem):
    code, out, err = run_cli(capsys, "--url", url, "--contexts", "160")
    assert (code, out, err) == (2, "", f"strata_ray bench: --url {url}: {problem}\n")


def test_url_that_does_not_answer_is_one_line(capsys):
    code, _, err = run_cli(capsys, "--url", "http://127.0.0.1:9", "--contexts", "160")
    assert code == 2 and "cannot connect" in err and err.count("\n") == 1


# ---- --url against a stand-in server: how its stream arrives, and how it names its model ---------------


@contextmanager
def stand_in_server(model_id: str, pace: str, seen: list | None = None):
    """An OpenAI-compatible server in a thread, streaming max_tokens one-word chunks (usage last), without
    /tokenize. pace: "burst" (the whole stream in one write: what a buffering proxy delivers), "paced" (a
    chunk every 3 ms, a real decode's arrivals) or "one chunk" (all the text in a single chunk); seen: a list
    that gets every request's path (GET) or JSON body (POST)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if seen is not None:
                seen.append(self.path)
            if self.path != "/v1/models":
                return self.send_error(404)
            listing = {"data": [{"id": model_id, "object": "model"}]}
            self.reply(json.dumps(listing).encode(), "application/json")

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if seen is not None:
                seen.append(request)
            if not self.path.endswith("/completions"):
                return self.send_error(404)
            n = request["max_tokens"]
            words = [f"w{i} " for i in range(n)]
            pieces = ["".join(words)] if pace == "one chunk" else words
            events = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in pieces]
            events.append({"choices": [], "usage": {"prompt_tokens": 150, "completion_tokens": n}})
            lines = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
            if pace != "paced":
                return self.reply(b"".join(lines), "text/event-stream")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")  # the body ends where the connection does
            self.end_headers()
            for line in lines:
                self.wfile.write(line)
                self.wfile.flush()
                time.sleep(0.003)
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def url_bench(capsys, url, tmp_path, *extra, gen: int = 16):
    out_json = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "--url", url, "--contexts", "200", "--repeats", "1", "--gen", str(gen),
                             "--story-tokens", str(gen), "--no-warmup", "--json-out", str(out_json), *extra)
    return code, out, err, (json.loads(out_json.read_text()) if out_json.exists() else None)


def test_url_seeds_go_as_openais_int64_and_the_one_it_cannot_send_is_refused(tmp_path, capsys):
    """A seed past 2**63 - 1 goes as its int64 two's complement, which our server maps back to the same 64
    bits (a seeded bench over --url draws what the seed draws in-process; servers refuse seeds past int64);
    2**64 - 1 would be -1, "unseeded": one line before any request."""
    seen: list = []
    with stand_in_server("served-model", "burst", seen) as url:
        code, _, err, _ = url_bench(capsys, url, tmp_path, "--temperature", "1", "--seed", str(2**63 + 5))
        assert code == 0, err
        bodies = [r for r in seen if isinstance(r, dict) and "max_tokens" in r]  # not /tokenize's
        assert bodies and {b["seed"] for b in bodies} == {2**63 + 5 - 2**64}
        seen.clear()
        (tmp_path / "no").mkdir()
        code, out, err, doc = url_bench(capsys, url, tmp_path / "no", "--temperature", "1", "--seed",
                                        str(2**64 - 1))
    assert (code, out, doc, seen) == (2, "", None, [])
    assert err == (f"strata_ray bench: --seed {2**64 - 1} cannot be sent to a server: its int64 form is -1, "
                   "which servers take as unseeded; pick another seed\n")


def test_a_decode_is_timed_only_where_the_arrivals_can_time_it():
    """RunTiming.decode_problem: the reason a run's decode rate is not measurable, else None and the rate."""
    from strata_ray.bench.measure import RunTiming

    def timing(generated, decode_tokens, decode_s, chunks):
        return RunTiming(100, generated, 0.5, decode_tokens, decode_s, 1.0, decode_chunks=chunks)

    assert timing(16, 15, 0.3, 15).decode_problem is None and timing(16, 15, 0.3, 15).decode_tps == 50.0
    assert timing(0, 0, 0.0, 0).decode_problem == "no token generated"
    assert timing(1, 0, 0.0, 0).decode_problem == "1 token generated: none after it"
    assert timing(16, 15, 0.0, 0).decode_problem == "all 16 tokens arrived in one chunk: no interval to time"
    burst = timing(200, 199, 0.0012, 199)  # 6 us a token: a buffered stream read at the parser's pace
    assert burst.decode_tps is None and burst.decode_problem == (
        "the 199 tokens after the first arrived within 1.20 ms of it, in one burst (the stream was buffered "
        "on its way: no decode is that fast)")
    short = timing(2, 1, 0.0004, 1)  # one token in 0.4 ms: a fast device, too short a span for the clock
    assert short.decode_tps is None and short.decode_problem == (
        "the 1 token(s) after the first took 0.40 ms, under the 1 ms a clock can time (generate more tokens)")
    assert short.record()["decode_tps"] is None and short.record()["decode_note"] == short.decode_problem


def test_a_stream_that_arrives_in_one_burst_has_no_decode_rate(tmp_path, capsys):
    """A stream delivered in one burst (a buffering proxy's) timed ~0.2 ms for 15 tokens and reported a
    decode of 70,000+ tok/s; now the decode reads n/a, with the reason a note in the table and in the JSON.
    200 tokens: a burst's reading (~6 us a token) stays far under 50 us a token on a busy machine too."""
    with stand_in_server("served-model", "burst") as url:
        code, out, err, doc = url_bench(capsys, url, tmp_path, gen=200)
    assert code == 0, err
    (c,) = doc["results"]["contexts"]
    run = c["runs"][0]
    assert c["decode_tps"] is None and run["decode_tps"] is None and run["decode_tokens"] == 199
    assert run["decode_note"].startswith("the 199 tokens after the first arrived within ")
    assert run["decode_note"].endswith(" ms of it, in one burst (the stream was buffered on its way: no "
                                       "decode is that fast)")
    assert c["decode_note"] == f"decode tok/s not measurable: {run['decode_note']}"
    story = doc["results"]["story"]
    assert story["decode_tps"] is None and story["decode_note"].startswith(
        "decode tok/s not measurable: the 199 tokens after the first arrived within ")
    row = out.splitlines()[2].split()
    assert row[0] == "200" and row[3] == "n/a" and c["prefill_tps"] > 0  # the prefill still measured
    assert "story: 200 of 200 tokens, decode n/a" in out
    assert f"note: context 200: {c['decode_note']}" in out and f"note: story: {story['decode_note']}" in out


def test_a_stream_of_one_chunk_has_no_decode_rate_and_a_paced_one_has(tmp_path, capsys):
    with stand_in_server("served-model", "one chunk") as url:
        code, out, err, doc = url_bench(capsys, url, tmp_path)
    assert code == 0, err
    (c,) = doc["results"]["contexts"]
    assert c["decode_tps"] is None
    assert c["decode_note"] == ("decode tok/s not measurable: all 16 tokens arrived in one chunk: no "
                                "interval to time")
    with stand_in_server("served-model", "paced") as url:
        code, out, err, doc = url_bench(capsys, url, tmp_path)
    assert code == 0, err
    (c,) = doc["results"]["contexts"]
    run = c["runs"][0]
    # 15 tokens after the first, sent 3 ms apart: ~333 tok/s, slower where the machine is busy (faster only
    # by as much as the first chunk was read late)
    assert run["decode_tokens"] == 15 and run["decode_s"] >= 0.03 and 0 < c["decode_tps"] <= 15 / 0.03
    assert c["decode_note"] is None and run["decode_note"] is None and "not measurable" not in out


def test_url_results_carry_the_name_the_server_gives_its_model(model_path, tmp_path, capsys):
    """The table's header and the JSON name the model as the server's /v1/models does (the header said
    "server", and a --model labelled the server's results with the file's name); a --model of another name
    (an alias, or the wrong file) gets one note, and the server's file under its own name none, whatever its
    directory or case."""
    with stand_in_server("served-model", "burst") as url:
        code, out, err, doc = url_bench(capsys, url, tmp_path)
        assert code == 0, err
        assert out.startswith("flashbench: served-model | url | server\n")
        assert doc["server"]["model"] == "served-model" and "(model 'served-model', chat API)" in err
        (tmp_path / "other").mkdir()
        code, out, err, doc = url_bench(capsys, url, tmp_path / "other", "--model", model_path)
        assert code == 0, err
        assert out.startswith("flashbench: served-model | url | server\n")
        assert doc["server"]["model"] == "served-model"
        stem = targets.model_stem(str(model_path))
        assert (f"strata_ray bench: note: the server names its model 'served-model', not --model's {stem!r}: "
                "the results are labelled with the server's name") in err
    with stand_in_server("/models/Tiny-CTX256.gguf", "burst") as url:  # llama-server names the path it loaded
        code, out, err, doc = url_bench(capsys, url, tmp_path, "--model", model_path)
    assert code == 0, err
    assert "note: the server names" not in err
    assert out.startswith("flashbench: /models/Tiny-CTX256.gguf | url | server\n")
    assert doc["server"]["model"] == "/models/Tiny-CTX256.gguf" and doc["model"]["n_vocab"] > 0


# ---- the default path: the Ray actors `run` uses ---------------------------------------------------------


@pytest.mark.slow
def test_bench_through_the_ray_actors(model_path, tmp_path):
    out_json = tmp_path / "ray.json"
    # A fresh local instance: with its own temp dir, a Ray instance that another process started on this
    # machine (whose address Ray records under /tmp/ray) is not mistaken for ours.
    ray_tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp}
    done = subprocess.run(
        [sys.executable, "-m", "strata_ray.run", "bench", "--address", "local", "--model", model_path,
         "--contexts", "160", "--repeats", "1", "--json-out", str(out_json), *FAST],
        capture_output=True, text=True, timeout=240, env=env,
    )
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out_json.read_text())
    assert doc["mode"] == "ray" and doc["device"]["engine_device"] == "cpu"
    run = doc["results"]["contexts"][0]["runs"][0]
    assert run["generated_tokens"] == 4 and run["engine_prompt_s"] > 0
    assert run["ttft_s"] >= run["engine_prompt_s"]  # what the caller waits for includes the engine's time
    # the first token crosses at once and the later ones after it: a 4-token decode has an interval (through
    # Ray's 20 ms batches it read 0.00 tok/s: every token came in the first batch)
    assert run["decode_tokens"] == 3 and run["decode_tps"] > 0


KILL_PRIMARY = """
import sys, ray
ray.init(address=sys.argv[1], namespace="strata", logging_level="ERROR")
ray.kill(ray.get_actor("strata:primary"))
"""


@pytest.mark.slow
def test_a_primary_killed_under_the_bench_is_named(model_path, tmp_path):
    """The bench's actor killed mid-run: the one line names it (it said "the driver died", the bench's own
    process, which was alive and printing it)."""
    from tests.actors.ray_head import auth_env, client_env, ray_head

    with ray_head(tmp_path) as address:
        env = {**client_env(address), **auth_env()}
        bench = subprocess.Popen(
            [sys.executable, "-m", "strata_ray.run", "bench", "--model", model_path, "--contexts", "160",
             "--repeats", "200", "--gen", "32", "--story-tokens", "0", "--no-warmup"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parents[2])
        try:
            lines = []
            while not lines or " (ready in " not in lines[-1]:  # the primary loaded: the runs begin
                line = bench.stderr.readline()
                assert line, "".join(lines)
                lines.append(line)
            kill = subprocess.run([sys.executable, "-c", KILL_PRIMARY, address], capture_output=True,
                                  text=True, env=env, timeout=120)
            assert kill.returncode == 0, kill.stderr
            out, err = bench.communicate(timeout=120)
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait()
    assert bench.returncode == 1 and out == "", err
    assert err.splitlines()[-1] == "strata_ray bench: strata:primary died: killed by ray.kill", err
