"""EngineConfig: defaults < STRATA_* env < CLI, validation lines, the four refusals (also via the CLI)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_ray.config import (
    ENGINE_FLAGS,
    REFUSE_PEER_WITH_HELPER_CACHES,
    REFUSE_PEER_WITH_LAYER_SPLIT,
    REFUSE_PEER_WITHOUT_CACHE,
    ConfigError,
    EngineConfig,
    PeerEnv,
    build_arg_parser,
    check_peer_device_visible,
    config_from_args,
    decimal,
    env_name,
    plain_float,
)

REPO = Path(__file__).resolve().parents[1]


def config(argv, env=None):
    return config_from_args(build_arg_parser().parse_args(argv), env or {})


@pytest.fixture()
def profile(tmp_path):
    """A valid STRP for the tiny synth preset: run checks it against the model before starting Ray."""
    from strata_ray.experts.profile import rank_from_counts, write_profile
    from strata_ray.model.synth_presets import preset_hparams

    hp = preset_hparams("qwen3next", "tiny")
    p = tmp_path / "p.strp"
    write_profile(p, rank_from_counts(np.ones((hp.n_layer, hp.n_expert), dtype=np.int64)))
    return str(p)


def test_defaults_are_designs():
    cfg = config([])
    assert cfg == EngineConfig()
    assert (cfg.model, cfg.device, cfg.expert_cache, cfg.vram_reserve_mib) == (None, "auto", None, 700)
    assert (cfg.adapt_every, cfg.adapt_swaps, cfg.adapt_decay) == (4, 96, 0.7)
    assert (cfg.peer_device, cfg.peer_reserve_mib, cfg.peer_slots) == (-1, 600, 0)
    assert (cfg.peer_adapt_swaps, cfg.peer_prefill_rows, cfg.layer_split) == (-1, -1, None)
    assert (cfg.prefill, cfg.spec) == (None, 0)
    assert cfg.helper_caches == (None, None, None)
    assert cfg.peer_adapt_swaps_effective == 96


def test_env_overrides_defaults_and_cli_overrides_env():
    env = {"STRATA_PREFILL": "128", "STRATA_SPEC": "2", "STRATA_EXPERT_CACHE": "40"}
    cfg = config(["--spec", "3"], env)
    assert (cfg.prefill, cfg.spec, cfg.expert_cache) == (128, 3, 40)
    cfg = config(["--expert-cache", "auto"], env)
    assert cfg.expert_cache is None
    assert config([], {"STRATA_SPEC": ""}).spec == 0  # empty = unset


def test_every_flag_parses_from_cli_and_env(profile, tmp_path):
    good = {
        "model": "m.gguf", "device": "cpu", "expert_cache": "12", "vram_budget_mib": "8000",
        "vram_reserve_mib": "0", "expert_profile": profile, "expert_profile_save": str(tmp_path / "s.strp"),
        "adapt_every": "0", "adapt_swaps": "5", "adapt_decay": "1", "peer_device": "-1",
        "peer_reserve_mib": "50", "peer_slots": "7", "peer_adapt_swaps": "3", "peer_prefill_rows": "0",
        "layer_split": "2,3", "expert_cache_device1": "auto", "expert_cache_device2": "4",
        "expert_cache_device3": "0", "prefill": "8192", "spec": "7",
    }
    assert set(good) == set(ENGINE_FLAGS)
    for name, raw in good.items():
        flag = ENGINE_FLAGS[name][0]
        from_cli = getattr(config([flag, raw]), name)
        from_env = getattr(config([], {env_name(name): raw}), name)
        assert from_cli == from_env, name
    assert config(["--expert-cache", "-1"]).expert_cache is None  # the reference engine's auto
    assert config(["--expert-cache", "0"]).expert_cache == 0
    cfg = config(["--layer-split", "2,3", "--peer-reserve-mib", "50", "--adapt-decay", "1"])
    assert cfg.layer_split == (2, 3) and cfg.adapt_decay == 1.0
    assert cfg.peer_reserve_effective_mib == 128  # the floor


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--spec", "8"], "--spec: invalid value '8' (allowed: an integer from 0 to 7)"),
        (["--spec", "two"], "--spec: invalid value 'two' (allowed: an integer from 0 to 7)"),
        (["--prefill", "100"],
         "--prefill: invalid value '100' (allowed: 'auto' or a multiple of 64 from 64 to 8192)"),
        (["--prefill", "16384"],
         "--prefill: invalid value '16384' (allowed: 'auto' or a multiple of 64 from 64 to 8192)"),
        (["--expert-cache", "-2"],
         "--expert-cache: invalid value '-2' (allowed: 'auto', -1 (auto) or an integer >= 0)"),
        (["--adapt-decay", "0"], "--adapt-decay: invalid value '0' (allowed: a number > 0 and <= 1)"),
        (["--peer-device", "0"],
         "--peer-device: invalid value '0' "
         "(allowed: -1 (off) or a CUDA device number >= 1 (device 0 is the primary))"),
        (["--layer-split", "8,4"],
         "--layer-split: invalid value '8,4' "
         "(allowed: 'auto' or increasing layer numbers >= 1 separated by commas, e.g. 24 or 16,32)"),
        (["--device", "tpu"], "--device: invalid value 'tpu' (allowed: cpu or cuda or auto)"),
        (["--vram-budget-mib", "0"], "--vram-budget-mib: invalid value '0' (allowed: an integer >= 1)"),
        (["--expert-profile", "/no/such.strp"], "--expert-profile: file not found: /no/such.strp"),
        (["--expert-profile", "/dev/zero"],
         "--expert-profile: /dev/zero is not a regular file; give an STRP file"),
    ],
)
def test_bad_values_name_flag_value_and_allowed(argv, line):
    with pytest.raises(ConfigError) as e:
        config(argv)
    assert str(e.value) == line


def test_the_same_missing_profile_for_both_flags_is_a_first_start(tmp_path):
    """--expert-profile P --expert-profile-save P with nothing at P yet: accepted (the first start of a
    resumed learning, run.check_profile_files says so); P missing without the save flag, or a folder:
    refused."""
    p = str(tmp_path / "p.strp")
    assert config(["--expert-profile", p, "--expert-profile-save", p]).expert_profile == p
    with pytest.raises(ConfigError, match="file not found"):
        config(["--expert-profile", p, "--expert-profile-save", str(tmp_path / "other.strp")])
    with pytest.raises(ConfigError, match="is a folder, not an STRP file"):
        config(["--expert-profile", str(tmp_path)])


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError) as e:
        config([], {"STRATA_SPEC": "9"})
    assert str(e.value) == "STRATA_SPEC: invalid value '9' (allowed: an integer from 0 to 7)"


def test_refusals(profile):
    with pytest.raises(ConfigError) as e:
        config(["--peer-device", "1", "--layer-split", "auto", "--expert-profile", profile])
    assert str(e.value) == REFUSE_PEER_WITH_LAYER_SPLIT
    for i in (1, 2, 3):
        with pytest.raises(ConfigError) as e:
            config(["--peer-device", "1", f"--expert-cache-device{i}", "auto", "--expert-profile", profile])
        assert str(e.value) == REFUSE_PEER_WITH_HELPER_CACHES
    peer = ["--peer-device", "1", "--expert-profile", profile]
    for argv in (["--peer-device", "2"], [*peer, "--expert-cache", "0"], [*peer, "--device", "cpu"]):
        with pytest.raises(ConfigError) as e:
            config(argv)
        assert str(e.value) == REFUSE_PEER_WITHOUT_CACHE
    cfg = config(["--peer-device", "2", "--expert-profile", profile])
    check_peer_device_visible(cfg, 3)
    with pytest.raises(ConfigError) as e:
        check_peer_device_visible(cfg, 2)
    assert str(e.value) == "peer experts: CUDA device 2 is not visible (2 devices; set CUDA_VISIBLE_DEVICES)"


def test_peer_env_switches_are_read_only_with_a_peer(profile):
    env = {"STRATA_PEER_HOT": "0.2", "STRATA_PF_PEER_RING": "16", "STRATA_PEER_DIRECT": "0"}
    assert config([], env).peer_env == PeerEnv()
    assert config([], {"STRATA_PEER_HOT": "not a number"}).peer_env == PeerEnv()
    cfg = config(["--peer-device", "1", "--expert-profile", profile], env)
    assert (cfg.peer_env.peer_hot, cfg.peer_env.pf_peer_ring, cfg.peer_env.peer_direct) == (0.2, 16, False)
    assert cfg.peer_env.pf_peer_stream == 0.35
    with pytest.raises(ConfigError) as e:
        config(["--peer-device", "1", "--expert-profile", profile], {"STRATA_PEER_HOT": "2"})
    assert str(e.value) == "STRATA_PEER_HOT: invalid value '2' (allowed: a number >= 0 and <= 1)"


def test_help_documents_every_flag_and_the_default_model():
    text = build_arg_parser().format_help()
    for flag, *_ in ENGINE_FLAGS.values():
        assert flag in text
    assert "strata-tiny-next" in text and "Qwen3-Next" in text
    assert "STRATA_PEER_HOT" in text


def run_cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "strata_ray.run", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--peer-device", "1", "--layer-split", "4"],
         "strata_ray: --peer-device cannot be combined with --layer-split (use one or the other)"),
        (["--peer-device", "1", "--expert-cache-device2", "3"],
         "strata_ray: --peer-device cannot be combined with --expert-cache-device1..3 "
         "(the peer tier already caches experts there)"),
        (["--peer-device", "1"], "strata_ray: --peer-device needs --expert-profile and the expert cache"),
        (["--spec", "9"], "strata_ray: --spec: invalid value '9' (allowed: an integer from 0 to 7)"),
        # the default command named: its flags, not an unknown command
        (["generate", "--spec", "9"],
         "strata_ray: --spec: invalid value '9' (allowed: an integer from 0 to 7)"),
        (["--bogus"], "strata_ray: unrecognized arguments: --bogus (see --help)"),
        # int() and float() take these; a flag does not
        (["-n", "\u0663"], "strata_ray: --max-tokens: invalid value '\u0663' (allowed: an integer >= 1)"),
        (["-n", " 3 "], "strata_ray: --max-tokens: invalid value ' 3 ' (allowed: an integer >= 1)"),
        (["-n", "1_0"], "strata_ray: --max-tokens: invalid value '1_0' (allowed: an integer >= 1)"),
        (["--temperature", "0_5"],
         "strata_ray: --temperature: invalid value '0_5' (allowed: a number >= 0 and <= 100)"),
        (["--address", ""], "strata_ray: --address: an empty address (give auto, local or HOST:PORT)"),
        # no abbreviations: a typo is refused, not taken for the flag it starts
        (["--max-token", "3"], "strata_ray: unrecognized arguments: --max-token 3 (see --help)"),
        (["serv"], "strata_ray: unknown command 'serv' (commands: generate, serve, bench, profile, synth; a "
                   "prompt goes in --prompt, --prompt-file or stdin)"),
    ],
)
def test_cli_refusals_exit_2_with_one_line(args, line):
    r = run_cli(*args)
    assert (r.returncode, r.stderr, r.stdout) == (2, line + "\n", "")


def test_cli_refuses_an_invisible_peer_device(profile, tmp_path):
    from strata_ray.model.synth import write_synth

    model = tmp_path / "tiny.gguf"
    write_synth(model, "qwen3next", "tiny", progress=False)
    r = run_cli("--model", str(model), "--peer-device", "1", "--expert-profile", profile,
                "--address", "local")
    assert (r.returncode, r.stderr) == (
        2, "strata_ray: peer experts: CUDA device 1 is not visible (0 devices; set CUDA_VISIBLE_DEVICES)\n")


def test_cli_help_exits_0():
    r = run_cli("--help")
    assert r.returncode == 0 and "--peer-prefill-rows" in r.stdout and "strata-tiny-next" in r.stdout


def test_kernel_variant_is_an_env_switch_carried_by_the_config():
    """Actors never read the environment: STRATA_KERNEL_VARIANT reaches the kernels through EngineConfig."""
    assert config([]).kernel_variant == "words"  # one-token Q4_0/Q8_0 decode tiles; else the simple ones
    assert config([], {"STRATA_KERNEL_VARIANT": "wide"}).kernel_variant == "wide"
    with pytest.raises(ConfigError) as e:
        config([], {"STRATA_KERNEL_VARIANT": "fast"})
    want = "STRATA_KERNEL_VARIANT: invalid value 'fast' (allowed: words or simple or wide or split)"
    assert str(e.value) == want


@pytest.mark.parametrize("name,field,default,good,bad,allowed", [
    ("STRATA_PCIE_SHARE", "pcie_share", None, "600", "0.6", "an integer from 0 to 1000"),  # None: the host's
    ("STRATA_DECODE_PREFETCH", "decode_prefetch", None, "2", "9", "an integer from 0 to 8"),  # None: auto
])
def test_integer_env_switches(name, field, default, good, bad, allowed):
    assert getattr(config([]), field) == default
    assert getattr(config([], {name: good}), field) == int(good)
    with pytest.raises(ConfigError) as e:
        config([], {name: bad})
    assert str(e.value) == f"{name}: invalid value '{bad}' (allowed: {allowed})"


ATTN_TILES_ALLOWED = ("SPLITxBKxWARPSxSTAGESxDC: split, bk and dc powers of two with 16 <= bk <= split <= "
                      "1024 and 16 <= dc <= 1024, warps 2, 4 or 8, stages 1 to 4")


@pytest.mark.parametrize("name,value,allowed", [
    ("STRATA_FUSED_DECODE", "off", "0 or 1"),
    ("STRATA_DECODE_DEVICE_ATTENTION", "yes", "0 or 1"),
    ("STRATA_WORDS_CUDA", "true", "0 or 1"),
    ("STRATA_PROMPT_MMA", "yes", "0 or 1"),
    ("STRATA_DENSE_CUDA", "on", "0 or 1"),
    ("STRATA_ATTN_DOT", "tf32", "tf32x3 or ieee"),
    ("STRATA_GDN_COLUMNS", "24", "a power of two from 16 to 1024"),
    ("STRATA_GDN_COLUMNS", "\u00b2", "a power of two from 16 to 1024"),  # a digit int() refuses
    ("STRATA_ATTN_TILES", "64x32x8x1", ATTN_TILES_ALLOWED),
    ("STRATA_ATTN_TILES", "64x128x8x1x64", ATTN_TILES_ALLOWED),  # a tile past its split
    ("STRATA_ATTN_TILES", "48x16x4x1x64", ATTN_TILES_ALLOWED),
    ("STRATA_ATTN_TILES", "64x32x3x1x64", ATTN_TILES_ALLOWED),
    ("STRATA_ATTN_TILES", "64x32x8x1x8", ATTN_TILES_ALLOWED),
    ("STRATA_STAGE_CHUNK_KIB", "12", "a multiple of 8 from 8 to 1048576"),
    ("STRATA_STAGE_CHUNK_KIB", "0", "a multiple of 8 from 8 to 1048576"),
    ("STRATA_STAGE_CHUNK_KIB", "\u00b2", "a multiple of 8 from 8 to 1048576"),  # a digit int() refuses
    ("STRATA_GATHER_PROGRAMS", "0", "an integer from 1 to 65535"),
    ("STRATA_PREFETCH_LAYERS", "3", "1 or 2"),
    ("STRATA_TOKEN_GRAPH", "on", "0 or 1"),
    ("STRATA_TOKEN_GRAPH_LAYERS", "-1", "an integer from 0 to 65536"),
    ("STRATA_DECODE_CHAIN", "yes", "0 or 1"),
    ("STRATA_AHEAD_PROGRAMS", "0", "an integer from 1 to 65535"),
    ("STRATA_SHARE_PROGRAMS", "-4", "an integer from 1 to 65535"),
    ("STRATA_DECODE_WARM", "yes", "0 or 1"),
    ("STRATA_TEAM_FORM", "barrier", "gather or dynamic or counter"),
    ("STRATA_DOWN_PREFETCH", "on", "0 or 1"),
    ("STRATA_TEAM_UNITS", "8", "half or whole"),
    ("STRATA_MMA_KQUANT_CTAS", "5", "an integer from 1 to 4"),
    ("STRATA_GEMV_MIN_CTAS", "0", "an integer from 1 to 4"),
    ("STRATA_ROWS_ITERS", "0", "an integer from 1 to 64"),
    ("STRATA_ROWS_EARLY", "on", "0 or 1"),
    ("STRATA_AHEAD_LAYER", "early", "same or next"),
    ("STRATA_PDL", "on", "0 or 1"),
])
def test_switches_read_where_used_are_refused_with_one_line(name, value, allowed):
    good = {"STRATA_STAGE_CHUNK_KIB": "64", "STRATA_ATTN_DOT": "ieee", "STRATA_ATTN_TILES": "128x16x4x2x64",
            "STRATA_TEAM_FORM": "counter", "STRATA_TEAM_UNITS": "whole",
            "STRATA_AHEAD_LAYER": "next", "STRATA_GDN_COLUMNS": "64"}.get(name, "1")
    config([], {name: good})  # good values pass
    with pytest.raises(ConfigError) as e:
        config([], {name: value})
    assert str(e.value) == f"{name}: invalid value {value!r} (allowed: {allowed})"


def test_decode_graphs_are_on_by_default_and_an_env_switch():
    assert config([]).decode_graphs is True
    assert config([], {"STRATA_DECODE_GRAPHS": "0"}).decode_graphs is False
    assert config([]).ring_overlap is True
    assert config([], {"STRATA_RING_OVERLAP": "0"}).ring_overlap is False
    assert config([]).decode_cpu_thread is False
    assert config([], {"STRATA_DECODE_CPU_THREAD": "1"}).decode_cpu_thread is True
    assert config([]).decode_pipeline is True
    assert config([], {"STRATA_DECODE_PIPELINE": "0"}).decode_pipeline is False
    assert config([]).dense_q8 is True
    assert config([], {"STRATA_DENSE_Q8": "0"}).dense_q8 is False
    assert config([]).cpu_dense_blocks is False
    assert config([], {"STRATA_CPU_DENSE_BLOCKS": "1"}).cpu_dense_blocks is True
    assert config([]).ring_loan is True
    assert config([], {"STRATA_RING_LOAN": "0"}).ring_loan is False
    with pytest.raises(ConfigError) as e:
        config([], {"STRATA_RING_LOAN": "no"})
    assert str(e.value) == "STRATA_RING_LOAN: invalid value 'no' (allowed: 0 or 1)"
    assert config([]).loan_order == "prompt"
    assert config([], {"STRATA_LOAN_ORDER": "profile"}).loan_order == "profile"
    with pytest.raises(ConfigError) as e:
        config([], {"STRATA_LOAN_ORDER": "heat"})
    assert str(e.value) == "STRATA_LOAN_ORDER: invalid value 'heat' (allowed: profile or prompt)"
    with pytest.raises(ConfigError) as e:
        config([], {"STRATA_DECODE_GRAPHS": "off"})
    assert str(e.value) == "STRATA_DECODE_GRAPHS: invalid value 'off' (allowed: 0 or 1)"
    with pytest.raises(ConfigError) as e:
        config([], {"STRATA_CPU_DENSE_BLOCKS": "yes"})
    assert str(e.value) == "STRATA_CPU_DENSE_BLOCKS: invalid value 'yes' (allowed: 0 or 1)"


@pytest.mark.parametrize("raw, value", [("+1", 1), ("-1", -1), ("007", 7),
                                        ("12345678901234567890", 12345678901234567890)])
def test_decimal_takes_plain_ascii_integers(raw, value):
    assert decimal(raw) == value


@pytest.mark.parametrize("raw, value", [(".5", 0.5), ("5.", 5.0), ("1E-3", 1e-3), ("+2", 2.0),
                                        ("-0.25", -0.25)])
def test_plain_float_takes_plain_ascii_numbers(raw, value):
    assert plain_float(raw) == value


@pytest.mark.parametrize("raw", ["\u0663", " 3", "3 ", "1_0", "", "0x10", "1e3"])
def test_decimal_refuses_what_int_would_take_or_misread(raw):
    with pytest.raises(ValueError):
        decimal(raw)


@pytest.mark.parametrize("raw", ["inf", "nan", "1_0.5", "\u0663.5", " 1", "1e", "."])
def test_plain_float_refuses_what_float_would_take(raw):
    with pytest.raises(ValueError):
        plain_float(raw)


def test_list_flags_take_a_space_after_the_comma():
    # items are stripped, as --gpu's are: "16, 32" worked before the strict parsers and still does
    assert config(["--layer-split", "16, 32"]).layer_split == (16, 32)
    from strata_ray.bench.prompts import parse_token_count

    assert [parse_token_count(c) for c in "8k, 32k".split(",")] == [8192, 32768]


def test_list_types_take_comma_separated_values_and_refuse_in_one_line():
    import argparse

    from strata_ray.config import int_list, name_list

    assert int_list(1)("1024,8192") == (1024, 8192) and int_list(1, 10)("10") == (10,)
    assert name_list(("numba", "pool"))("pool,numba") == ("pool", "numba")
    for parse, bad, message in ((int_list(1), "1,x", "invalid value '1,x' (allowed: comma-separated, each an "
                                                      "integer >= 1)"),
                                (int_list(1, 8), "9", "each an integer from 1 to 8"),
                                (int_list(1), "", "invalid value ''"),
                                (int_list(1), "\u00b2", "invalid value"),  # a digit int() takes
                                (name_list(("a", "b")), "a,c",
                                 "unknown 'c' (allowed: a comma-separated list of a, b)")):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            parse(bad)
        assert message in str(e.value)


def test_help_says_which_flags_are_not_available_yet():
    """The flags whose engine part has not landed say so in --help (the README's table marks them with a
    star), and those are the ones a run is refused for: the flags that work say nothing of the kind."""
    from strata_ray.config import NOT_LANDED
    from strata_ray.engine.engine import unavailable_feature

    text = " ".join(build_arg_parser().format_help().split())
    for name, (flag, _metavar, _parse, help_text) in ENGINE_FLAGS.items():
        said = f"{' '.join(help_text.split())}; not available yet" in text
        assert said == (name in NOT_LANDED), flag
    # each one, set, is what a run is refused for (--expert-cache-device1..3 under one name)
    values = {"peer_device": 1, "layer_split": (4,), "expert_cache_device1": 100, "expert_cache_device2": 100,
              "expert_cache_device3": 100, "spec": 2}
    assert set(values) == set(NOT_LANDED)
    for name, value in values.items():
        flag = "--expert-cache-device1..3" if name.startswith("expert_cache") else ENGINE_FLAGS[name][0]
        assert unavailable_feature(EngineConfig(**{name: value})) == flag
