"""serve.json + the serve command line -> ServePlan (no server, no Ray)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from strata_ray.config import REFUSE_PEER_WITH_LAYER_SPLIT, ConfigError
from strata_ray.serve.config_file import (
    ServeConfig,
    ServeConfigError,
    child_env,
    config_from_dict,
    engine_args,
    parse_gpu,
    resolve,
)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, doc) -> str:
    path = tmp_path / "serve.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("value, gpus", [
    (None, ()), ("", ()), ([], ()), (2, (2,)), ([0, 2], (0, 2)), ("0,2", (0, 2)), (" 1 , 3 ", (1, 3)),
    (["2", 0], (2, 0)),
])
def test_gpu_forms(value, gpus):
    assert parse_gpu(value) == gpus


@pytest.mark.parametrize("value", [True, -1, "a,b", [0, 0], [1.5], {"x": 1}, "0,,2"])
def test_bad_gpu(value):
    with pytest.raises(ServeConfigError, match="^gpu: "):
        parse_gpu(value)


def test_gpu_list_is_the_visible_devices_in_pci_bus_order():
    env = child_env(ServeConfig(gpu=(2, 0), env={"STRATA_PEER_HOT": "0.3"}), {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0",
                   "STRATA_PEER_HOT": "0.3"}
    assert "CUDA_VISIBLE_DEVICES" not in child_env(ServeConfig(), {})


def test_several_gpus_get_the_automatic_layer_split():
    assert engine_args(ServeConfig(gpu=(0, 1))) == ["--layer-split", "auto"]
    assert engine_args(ServeConfig(gpu=(0, 1), layer_split="24")) == ["--layer-split", "24"]
    assert engine_args(ServeConfig(gpu=(0, 1), layer_split="off")) == []
    assert engine_args(ServeConfig(gpu=(0,))) == []
    assert engine_args(ServeConfig(gpu=(0, 1), args=("--layer-split", "16"))) == ["--layer-split", "16"]


def test_two_gpus_with_peer_device_get_no_layer_split(tmp_path):
    args = ["--peer-device", "1", "--expert-profile", "p.strp"]
    assert engine_args(ServeConfig(gpu=(0, 1), args=tuple(args))) == args
    assert engine_args(ServeConfig(gpu=(0, 1), args=("--peer-device=1",))) == ["--peer-device=1"]
    # through the whole resolution too (the profile must exist for the engine config to validate)
    profile = tmp_path / "p.strp"
    profile.write_bytes(b"STRP")
    path = write(tmp_path, {"gpu": "0,1", "args": ["--peer-device", "1", "--expert-profile", str(profile),
                                                   "--device", "cuda"]})
    plan = resolve(["--config", path], {})
    assert "--layer-split" not in plan.engine_argv
    assert plan.engine.peer_active and plan.engine.layer_split is None
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1" and plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_resolve_model_args_env_and_cli_overrides(tmp_path):
    path = write(tmp_path, {"model": "m.gguf", "port": 9000, "host": "0.0.0.0", "api_key": "k",
                            "args": ["--prefill", "128"], "env": {"STRATA_SPEC": 2}, "replicas": 2})
    plan = resolve(["--config", path, "--port", "9100", "--prefill", "256", "--replicas", "1"], {})
    s = plan.serve
    assert (s.host, s.port, s.api_key, s.replicas) == ("0.0.0.0", 9100, "k", 1)
    assert plan.engine.model == "m.gguf" and plan.engine.prefill == 256  # the flag wins over the file
    assert plan.engine.spec == 2  # STRATA_* from the file's env reaches the engine config
    assert plan.env == {"STRATA_SPEC": "2"}


def test_defaults_without_a_file():
    plan = resolve([], {})
    assert (plan.serve.host, plan.serve.port, plan.serve.api_key) == ("127.0.0.1", 8000, None)
    assert plan.engine.model is None and plan.engine_argv == ()


@pytest.mark.parametrize("doc, message", [
    ("{nope", "is not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"modle": "x"}, "unknown key 'modle'"),
    ({"port": "80"}, "port: expected an integer"),
    ({"port": 70000}, "port: expected an integer from 1 to 65535"),
    ({"port": 0}, "port: expected an integer from 1 to 65535, got 0"),
    ({"replicas": 0}, "replicas: expected an integer >= 1"),
    ({"args": [["--spec"]]}, "args: expected a list of engine flags"),
    ({"env": {"PATH": "/x"}}, "env: only STRATA_\\* switches"),
    ({"env": {"STRATA_SPEC": [1]}}, "env: STRATA_SPEC must be a string, number or boolean"),
    ({"env": {"STRATA_SPEC": "nine"}}, "STRATA_SPEC: invalid value 'nine'"),
    ({"env": {"STRATA_TYPO_XYZ": "1"}}, "env: STRATA_TYPO_XYZ is not a switch strata_ray reads"),
    ({"env": {"STRATA_PRECOMPILE": "maybe"}}, r"STRATA_PRECOMPILE: invalid value 'maybe' \(allowed: 0 or 1"),
    ({"env": {"STRATA_RING_SLOTS": "3"}}, r"STRATA_RING_SLOTS: invalid value '3' \(allowed: an even count"),
    ({"args": ["--spec", "99"]}, "--spec: invalid value '99'"),
    ({"args": ["--no-such-flag"]}, "unrecognized arguments: --no-such-flag"),
    ({"gpu": [0, 1], "args": ["--peer-device", "1", "--layer-split", "16"]}, None),
    ({"api_key": 5}, "api_key: expected a string"),
    ({"api_key": ""}, "api_key: an empty key"),  # it served with no key at all
    ({"layer_split": True}, "layer_split: expected"),
    ({"shutdown_grace": "5"}, r'shutdown_grace: expected seconds \(a number\), got "5"'),
    ({"shutdown_grace": -1}, "shutdown_grace: expected seconds from 0 to 3600, got -1"),
])
def test_invalid_configs_are_one_line(tmp_path, doc, message):
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError) as info:
        resolve(["--config", path], {})
    text = str(info.value)
    assert "\n" not in text
    if message is None:  # the engine's own refusal
        assert text == REFUSE_PEER_WITH_LAYER_SPLIT
    else:
        assert re.search(message, text), text


def test_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "serve.json"
    path.write_bytes(b'\xff\xfe{"port": 9000}')
    with pytest.raises(ServeConfigError, match=f"^--config: {path} is not UTF-8 text$"):
        resolve(["--config", str(path)], {})


@pytest.mark.parametrize("argv, line", [
    (["--port", "70000"], "--port: expected an integer from 1 to 65535, got 70000"),
    (["--replicas", "0"], "--replicas: expected an integer >= 1, got 0"),
    (["--port", "\u0668\u0660"], "--port: invalid value '\u0668\u0660' (allowed: an integer)"),
    (["--host", ""], "--host: an empty address (give a host name or address, e.g. 0.0.0.0)"),
    (["--api-key", " k"], "--api-key: the key has spaces around it (a request's key never would)"),
    # `--api-key "$KEY"` with KEY unset: it served with no key at all, and said nothing
    (["--api-key", ""], "--api-key: an empty key (leave it out to serve without a key)"),
    (["--shutdown-grace", "soon"], "--shutdown-grace: invalid value 'soon' (allowed: seconds, a number)"),
    (["--shutdown-grace", "nan"], "--shutdown-grace: expected seconds from 0 to 3600, got nan"),
    (["--shutdown-grace", "1e9"], "--shutdown-grace: expected seconds from 0 to 3600, got 1000000000.0"),
])
def test_a_bad_port_or_replicas_on_the_command_line_names_the_flag(argv, line):
    with pytest.raises(ServeConfigError) as e:
        resolve(argv, {})
    assert str(e.value) == line


def test_the_shutdown_grace_from_the_file_the_flag_or_the_default(tmp_path):
    path = write(tmp_path, {"shutdown_grace": 2})
    assert resolve([], {}).serve.shutdown_grace == 10.0
    assert resolve(["--config", path], {}).serve.shutdown_grace == 2.0
    assert resolve(["--config", path, "--shutdown-grace", "0.5"], {}).serve.shutdown_grace == 0.5
    assert resolve(["--shutdown-grace", "0"], {}).serve.shutdown_grace == 0.0


def test_a_gpu_number_int_cannot_read_is_one_line():
    with pytest.raises(ServeConfigError, match="^--gpu: expected a GPU number"):
        resolve(["--gpu", "\u00b2"], {})  # a digit to str.isdigit(), not to int()


def test_gpus_with_device_cpu_are_one_line(tmp_path):
    """GPUs named and the CPU asked for: which one the user meant is not known (the GPUs were ignored)."""
    line = 'GPUs 0,2 asked for (--gpu / "gpu"), but --device cpu serves on the CPU: drop one of them'
    with pytest.raises(ServeConfigError) as e:
        resolve(["--gpu", "0,2", "--device", "cpu"], {})
    assert str(e.value) == line
    with pytest.raises(ServeConfigError) as e:
        resolve(["--config", write(tmp_path, {"gpu": [0, 2], "args": ["--device", "cpu"]})], {})
    assert str(e.value) == line
    assert resolve(["--device", "cpu"], {}).engine.device == "cpu"


def test_the_automatic_layer_split_is_marked_as_the_servers():
    """Several GPUs: the server adds --layer-split auto (auto_split: its message names the GPUs, not a flag
    the user never gave); the user's own --layer-split, or one GPU, is not marked."""
    assert resolve(["--gpu", "0,1"], {}).auto_split
    assert not resolve(["--gpu", "0,1", "--layer-split", "24"], {}).auto_split
    assert not resolve(["--gpu", "0"], {}).auto_split


def test_serving_on_several_gpus_says_why_not_in_one_line(capsys):
    """`serve --gpu 0,1` (the layer split the server adds is not available yet): one line naming the GPUs and
    what to do, exit 2, before Ray starts; the user's own --layer-split keeps the flag's line."""
    from strata_ray.serve.app import serve_main

    assert serve_main(["--gpu", "0,1"]) == 2
    assert capsys.readouterr().err == (
        'strata_ray: GPUs 0,1: the server splits the layers across several GPUs (--layer-split auto), which '
        'is not available yet; serve on one GPU, or set "layer_split": "off" in the config\n')
    assert serve_main(["--gpu", "0,1", "--layer-split", "24"]) == 2
    assert capsys.readouterr().err == "strata_ray: --layer-split is not available yet\n"


def test_port_0_on_the_command_line_is_refused_like_in_the_file():
    """The same rule as the file's "port", the line naming the flag."""
    with pytest.raises(ServeConfigError, match="^--port: expected an integer from 1 to 65535, got 0$"):
        resolve(["--port", "0"], {})


def test_missing_file():
    with pytest.raises(ServeConfigError, match="--config: cannot read /no/such/serve.json"):
        resolve(["--config", "/no/such/serve.json"], {})


def test_a_config_past_its_limit_is_one_line(tmp_path, monkeypatch):
    """--config /dev/zero was read until memory ran out: CONFIG_LIMIT characters at most."""
    import strata_ray.serve.config_file as config_file

    monkeypatch.setattr(config_file, "CONFIG_LIMIT", 4)
    (tmp_path / "serve.json").write_text("{}   ")
    with pytest.raises(ServeConfigError, match=r"serve.json is longer than .* MiB; a serve.json is a few "):
        resolve(["--config", str(tmp_path / "serve.json")], {})


def test_config_from_dict_keeps_types():
    cfg = config_from_dict({"gpu": 1, "args": "--prefill 64", "env": {"STRATA_PEER_DIRECT": False},
                            "layer_split": 24})
    assert cfg.gpu == (1,) and cfg.args == ("--prefill", "64")
    assert cfg.env == {"STRATA_PEER_DIRECT": "0"} and cfg.layer_split == "24"


def test_serve_command_exits_2_with_one_line_before_starting(tmp_path):
    path = write(tmp_path, {"port": "eighty"})
    done = subprocess.run([sys.executable, "-m", "strata_ray.run", "serve", "--config", path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f'strata_ray: {path}: port: expected an integer from 1 to '
                                                '65535, got "eighty"']


@pytest.mark.parametrize("case", ["wrong shape", "no folder"])
def test_serve_checks_the_profile_files_before_starting_like_run(tmp_path, case):
    import numpy as np

    from strata_ray.experts.profile import rank_from_counts, write_profile

    profile = tmp_path / "p.strp"
    write_profile(profile, rank_from_counts(np.ones((4, 8), dtype=np.int64)))  # the embedded model: 4 x 16
    if case == "wrong shape":
        args, line = ["--expert-profile", "p.strp"], (
            f"expert profile {profile} is for 4 layers x 8 experts, but the model has 4 layers x 16 experts")
    else:
        args, line = ["--expert-profile-save", "no/p.strp"], (
            f"--expert-profile-save: folder not found: {tmp_path / 'no'}")
    done = subprocess.run([sys.executable, "-m", "strata_ray.run", "serve", "--address", "local", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stderr) == (2, f"strata_ray: {line}\n")


@pytest.mark.parametrize("case", ["in use", "no such host"])
def test_serve_refuses_an_address_it_cannot_listen_on_before_starting(tmp_path, case):
    """A port another process holds, or a host name that does not resolve: one line with the reason, before
    Ray starts (Ray Serve failed minutes later, saying neither)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        host = "127.0.0.1" if case == "in use" else "no-such-host.invalid"  # .invalid never resolves
        done = subprocess.run([sys.executable, "-m", "strata_ray.run", "serve", "--address", "local",
                               "--host", host, "--port", str(port)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    if case == "in use":
        assert done.stderr == f"strata_ray: cannot listen on {host}:{port} (Address already in use)\n"
    else:
        assert done.stderr.startswith(f"strata_ray: cannot listen on {host}:{port} (")


def test_serve_attaches_to_ray_address_as_its_help_says(tmp_path):
    """serve's --address default is run's: RAY_ADDRESS first (its help left that out), then a running
    cluster, then a local instance. A RAY_ADDRESS that nothing answers is one line, before the model loads."""
    import socket

    from strata_ray.serve.config_file import build_serve_parser

    action = next(a for a in build_serve_parser()._actions if "--address" in a.option_strings)
    assert action.help.startswith("Ray cluster to attach to (default: RAY_ADDRESS, else a running cluster")
    with socket.socket() as free, socket.socket() as listen:  # ports nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        listen.bind(("127.0.0.1", 0))
        address, port = f"127.0.0.1:{free.getsockname()[1]}", str(listen.getsockname()[1])
    done = subprocess.run([sys.executable, "-m", "strata_ray.run", "serve", "--port", port],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address})
    assert done.returncode == 2
    assert done.stderr.startswith(f"strata_ray: cannot connect to the Ray cluster at {address} (")
    assert len(done.stderr.splitlines()) == 1
