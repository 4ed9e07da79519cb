"""The comparison helpers of scripts/compare_llamacpp.sh: --n-cpu-moe for a budget, the side-by-side table."""

from __future__ import annotations

import json

import pytest

from strata_ray.bench.llamacpp import (
    MIB,
    CompareError,
    expert_bytes_by_layer,
    main,
    n_cpu_moe_for_budget,
    read_llama_bench,
    read_ours,
    side_by_side,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.synth import write_synth

    path = tmp_path_factory.mktemp("llamacpp") / "tiny.gguf"
    write_synth(path, "qwen3next", "tiny", progress=False)
    return GGUFFile(path)


def test_n_cpu_moe_keeps_the_last_layers_that_fit(tiny):
    by_layer = expert_bytes_by_layer(tiny)
    assert sorted(by_layer) == list(range(tiny.hparams.n_layer + tiny.hparams.n_nextn))  # nextn block too
    per_layer = by_layer[0]
    dense = sum(i.n_bytes for i in tiny.tensors.values()) - sum(by_layer.values())
    two_layers_mib = -(-(dense + 2 * per_layer) // MIB)  # rounded up: room for exactly 2 layers of experts
    assert two_layers_mib * MIB < dense + 3 * per_layer
    assert n_cpu_moe_for_budget(tiny, two_layers_mib, 0) == len(by_layer) - 2
    assert n_cpu_moe_for_budget(tiny, 1, 0) == len(by_layer)  # nothing fits: every layer on the CPU
    assert n_cpu_moe_for_budget(tiny, 1000, 700) == 0  # everything fits
    assert n_cpu_moe_for_budget(tiny, 1000, 999) == len(by_layer)  # the reserve comes first


def test_side_by_side_reads_llama_bench_json_and_ours(tmp_path, capsys):
    prefill = tmp_path / "prefill.json"
    decode = tmp_path / "decode.json"
    prefill.write_text(json.dumps([
        {"n_prompt": 8192, "n_gen": 0, "n_depth": 0, "avg_ts": 999.0, "samples_ts": [900.0, 1000.0, 1100.0]},
    ]))
    decode.write_text(json.dumps([
        {"n_prompt": 0, "n_gen": 128, "n_depth": 8192, "avg_ts": 50.0, "samples_ts": [50.0, 40.0, 60.0]},
    ]))
    llama = read_llama_bench([str(prefill), str(decode)])
    assert llama == {"prefill": {8192: 1000.0}, "decode": {8192: 50.0}}
    ours_path = tmp_path / "ours.json"
    ours_path.write_text(json.dumps(
        {"results": {"contexts": [{"context": 8192, "prefill_tps": 1500.0, "decode_tps": 25.0}]}}
    ))
    assert main(["compare", "--setup", "cpu-experts", "--ours", str(ours_path),
                 "--llama", str(prefill), str(decode)]) == 0
    table = capsys.readouterr().out
    assert "| 8192 | 1500.0 | 1000.0 | 1.50x | 25.0 | 50.0 | 0.50x |" in table


def test_a_decode_that_was_not_measurable_reads_n_a(tmp_path):
    """A flashbench decode that could not be timed (null, its reason in decode_note) is n/a, not a crash."""
    ours_path = tmp_path / "ours.json"
    context = {"context": 8192, "prefill_tps": 1500.0, "decode_tps": None, "decode_note": "not measurable"}
    ours_path.write_text(json.dumps({"results": {"contexts": [context]}}))
    ours = read_ours(str(ours_path))
    assert ours == {"prefill": {8192: 1500.0}, "decode": {}}
    table = side_by_side("cpu", ours, {"prefill": {8192: 1000.0}, "decode": {8192: 50.0}})
    assert "| 8192 | 1500.0 | 1000.0 | 1.50x | n/a | 50.0 | n/a |" in table


def test_a_missing_result_is_named_not_fatal(tmp_path, capsys):
    log = tmp_path / "ours.log"
    log.write_text("progress\nstrata_ray bench: --expert-cache is not available yet\n")
    missing = str(tmp_path / "none.json")
    assert main(["compare", "--setup", "budget", "--ours", missing, "--ours-log", str(log),
                 "--llama", missing]) == 0
    table = capsys.readouterr().out
    assert "ours: no result (strata_ray bench: --expert-cache is not available yet)" in table
    assert "llama.cpp: no result" in table
    with pytest.raises(CompareError, match="not found"):
        read_llama_bench([missing])
    only = side_by_side("budget", None, {"prefill": {1024: 10.0}, "decode": {}})
    assert "| 1024 | n/a | 10.0 | n/a | n/a | n/a | n/a |" in only


def test_script_stages_fail_in_one_line(tmp_path):
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "compare_llamacpp.sh"
    env = {"PATH": "/usr/bin:/bin", "BUILD": str(tmp_path / "no-build"), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 2
    assert done.stderr == (
        "compare_llamacpp: unknown stage 'nope' (fetch, build, llama, ours, table, run or all)\n")
    done = subprocess.run(["bash", str(script), "run"], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 2 and "no llama-bench at" in done.stderr and done.stderr.count("\n") == 1


def test_the_recorded_h200_run_gives_the_documented_table(capsys):
    """docs/compare/h200-2026-11-29 holds real llama-bench and flashbench JSON from the GPU machine; the
    table stage must read them as docs/BENCHMARKS.md quotes them."""
    import pathlib

    run = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compare" / "h200-2026-11-29"
    rows = {}
    for setup in ("budget", "cpu-experts"):
        llama = [str(run / f"llama-{setup}-prefill.json"), str(run / f"llama-{setup}-decode.json")]
        assert main(["compare", "--setup", setup, "--ours", str(run / f"ours-{setup}.json"),
                     "--llama", *llama]) == 0
        rows[setup] = capsys.readouterr().out
    assert "| 8192 | 161.0 | 2668.1 | 0.06x | 20.3 | 56.9 | 0.36x |" in rows["budget"]
    assert "| 1024 | 110.9 | 998.9 | 0.11x | 20.1 | 33.7 | 0.60x |" in rows["cpu-experts"]
    docs = (run.parents[1] / "BENCHMARKS.md").read_text()
    assert "| budget (24 GiB card) | 8192 | 161.0 | 2668.1 | 0.06x | 20.3 | 56.9 | 0.36x |" in docs


def test_the_session_4_h200_run_gives_the_documented_table(capsys):
    """docs/compare/h200-2026-11-29-s4: session 4's flashbench JSON against the same llama-bench JSON."""
    import pathlib

    run = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compare" / "h200-2026-11-29-s4"
    llama = [str(run / "llama-budget-prefill.json"), str(run / "llama-budget-decode.json")]
    ours = str(run / "ours-budget.json")
    assert main(["compare", "--setup", "budget", "--ours", ours, "--llama", *llama]) == 0
    row = "| 8192 | 1547.9 | 2668.1 | 0.58x | 17.6 | 56.9 | 0.31x |"
    assert row in capsys.readouterr().out
    docs = (run.parents[1] / "BENCHMARKS.md").read_text()
    assert f"| budget (24 GiB card) {row}" in docs


def test_the_session_5_h200_run_gives_the_documented_table(capsys):
    """docs/compare/h200-2026-11-29-s5: session 5's flashbench JSON (three repeats) against the same
    llama-bench JSON."""
    import pathlib

    run = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compare" / "h200-2026-11-29-s5"
    docs = (run.parents[1] / "BENCHMARKS.md").read_text()
    for setup, label, row in (
        ("budget", "budget (24 GiB card)", "| 8192 | 1945.4 | 2668.1 | 0.73x | 28.1 | 56.9 | 0.49x |"),
        ("cpu-experts", "cpu-experts", "| 1024 | 800.2 | 998.9 | 0.80x | 24.1 | 33.7 | 0.71x |"),
    ):
        llama = [str(run / f"llama-{setup}-prefill.json"), str(run / f"llama-{setup}-decode.json")]
        ours = str(run / f"ours-{setup}.json")
        assert main(["compare", "--setup", setup, "--ours", ours, "--llama", *llama]) == 0
        assert row in capsys.readouterr().out
        assert f"| {label} {row}" in docs


def test_the_session_6_and_7_h200_runs_give_the_documented_table(capsys):
    """docs/compare/h200-2026-11-29-s6 (the defaults) and -s6-f32 (STRATA_DENSE_Q8=0): session 6's flashbench
    JSON (two repeats) against the same llama-bench JSON; h200-2026-11-30-s7: session 7's (fused decode),
    -s7-gather: the same with the prompt path's gather copies; -s8: session 8's prompt path."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "docs"
    docs = (root / "BENCHMARKS.md").read_text()
    for run, setup, label, row in (
        ("s6", "budget", "budget (24 GiB card)", "| 8192 | 1617.8 | 2668.1 | 0.61x | 36.1 | 56.9 | 0.63x |"),
        ("s6", "cpu-experts", "cpu-experts", "| 1024 | 531.8 | 998.9 | 0.53x | 30.1 | 33.7 | 0.89x |"),
        ("s6-f32", "budget", "budget, dense f32", "| 1024 | 801.2 | 1542.4 | 0.52x | 34.8 | 54.1 | 0.64x |"),
        ("s7", "budget", "budget (24 GiB card)", "| 1024 | 708.0 | 1542.4 | 0.46x | 51.4 | 54.1 | 0.95x |"),
        ("s7", "cpu-experts", "cpu-experts", "| 8192 | 880.9 | 1726.5 | 0.51x | 35.3 | 35.4 | 1.00x |"),
        ("s7-gather", "budget", "budget, gather copies",
         "| 1024 | 1095.8 | 1542.4 | 0.71x | 53.4 | 54.1 | 0.99x |"),
        ("s8", "budget", "budget, session 8", "| 8192 | 2306.5 | 2668.1 | 0.86x | 59.5 | 56.9 | 1.05x |"),
        ("s8", "cpu-experts", "cpu-experts, session 8",
         "| 8192 | 1917.6 | 1726.5 | 1.11x | 43.0 | 35.4 | 1.21x |"),
    ):
        day = "30" if run.startswith(("s7", "s8")) else "29"
        d = root / "compare" / f"h200-2026-11-{day}-{run}"
        llama = [str(d / f"llama-{setup}-prefill.json"), str(d / f"llama-{setup}-decode.json")]
        ours = str(d / f"ours-{setup}.json")
        assert main(["compare", "--setup", setup, "--ours", ours, "--llama", *llama]) == 0
        assert row in capsys.readouterr().out
        assert f"| {label} {row}" in docs
