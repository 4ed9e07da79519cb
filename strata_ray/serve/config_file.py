"""The server's configuration: serve.json merged with the `serve` command line, checked before anything runs.

serve.json keys: model, gpu, args, env, host, port, api_key, layer_split, replicas, shutdown_grace. `gpu`
(an int, a list or "0,2") becomes CUDA_VISIBLE_DEVICES in PCI bus order, so engine device N is the Nth card
of the list. `args` are engine flags (DESIGN section 4). With more than one GPU the server adds
`--layer-split auto` (or the `layer_split` value) unless `--peer-device` is in the args: then the peer tier
uses the second card instead.
Command-line flags override the file: later engine flags win over the file's `args`. `shutdown_grace`: the
seconds that requests already taken get to finish once the server is told to stop (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strata_ray.capped_read import MIB, TooLong, read_capped
from strata_ray.config import (
    ConfigError,
    EngineConfig,
    add_engine_args,
    config_from_args,
    decimal,
    known_env_names,
)
from strata_ray.config import OneLineArgumentParser as _OneLineParser

PROG = "python -m strata_ray.run serve"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
CONFIG_LIMIT = MIB  # characters
KEYS = ("model", "gpu", "args", "env", "host", "port", "api_key", "layer_split", "replicas", "shutdown_grace")
DEFAULT_SHUTDOWN_GRACE_S = 10.0  # a few answers' time; within the 30 s before Kubernetes or systemd kill
MAX_SHUTDOWN_GRACE_S = 3600.0
LAYER_SPLIT_OFF = "off"  # layer_split: "off" keeps a multi-GPU config from getting the automatic split


class ServeConfigError(ConfigError):
    """A bad serve.json or serve flag; one line, printed after 'strata_ray: '."""


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    gpu: tuple[int, ...] = ()  # nvidia-smi numbering; engine device N is gpu[N]
    args: tuple[str, ...] = ()  # engine flags as written in the file
    env: Mapping[str, str] = field(default_factory=dict)  # STRATA_* switches, values as strings
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    layer_split: str | None = None  # None = "auto" when more than one GPU; "off" = never
    replicas: int = 1
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S  # seconds the requests taken get once told to stop


@dataclass(frozen=True)
class ServePlan:
    """Everything serve_main needs, resolved and validated."""

    serve: ServeConfig
    engine: EngineConfig
    engine_argv: tuple[str, ...]  # the engine flags the config resolved to (file args + added + CLI)
    env: Mapping[str, str]  # variables to set in the server's environment before Ray starts
    address: str | None = None  # Ray cluster to attach to (None: running cluster, else a local one)
    verbose: bool = False
    auto_split: bool = False  # engine_argv's --layer-split is the one added for several GPUs, not the user's


# --- serve.json values ------------------------------------------------------------------------------------


def parse_gpu(value: Any, where: str = "gpu") -> tuple[int, ...]:
    """2 -> (2,); [0, 2] -> (0, 2); "0,2" -> (0, 2); None, "" or [] -> ()."""
    allowed = f'{where}: expected a GPU number, a list of them or a string like "0,2"'
    if value is None or value == "" or value == []:
        return ()
    if isinstance(value, bool):
        raise ServeConfigError(f"{allowed}, got {json.dumps(value)}")
    if isinstance(value, int):
        items: list[Any] = [value]
    elif isinstance(value, str):
        items = [s.strip() for s in value.split(",")]
    elif isinstance(value, list):
        items = value
    else:
        raise ServeConfigError(f"{allowed}, got {json.dumps(value)}")
    gpus = []
    for item in items:
        if isinstance(item, str) and item.isascii() and item.isdigit():  # not '²': int() refuses it
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ServeConfigError(f"{allowed}, got {json.dumps(value)}")
        gpus.append(item)
    if len(set(gpus)) != len(gpus):
        raise ServeConfigError(f"{where}: GPU listed twice in {json.dumps(value)}")
    return tuple(gpus)


def _env_value(name: str, v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, float, str)):
        return str(v)
    raise ServeConfigError(f"env: {name} must be a string, number or boolean, got {json.dumps(v)}")


def _parse_env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ServeConfigError('env: expected an object of STRATA_* switches, e.g. {"STRATA_PEER_HOT": 0.45}')
    bad = [k for k in value if not k.startswith("STRATA_")]
    if bad:
        raise ServeConfigError(f"env: only STRATA_* switches are allowed here, got {bad[0]}")
    unknown = sorted(set(value) - known_env_names())
    if unknown:  # a typo would otherwise leave the switch silently off
        raise ServeConfigError(f"env: {unknown[0]} is not a switch strata_ray reads (README: the switches)")
    return {k: _env_value(k, v) for k, v in value.items()}


def _parse_args(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # a convenience: "--prefill 512 --spec 2"
        return tuple(value.split())
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) for a in value):
        raise ServeConfigError('args: expected a list of engine flags, e.g. ["--prefill", "512"]')
    return tuple(str(a) for a in value)


def _typed(raw: Mapping[str, Any], key: str, kind: type, allowed: str) -> Any:
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ServeConfigError(f"{key}: expected {allowed}, got {json.dumps(v)}")
    return v


def _port(v: int | None, name: str = "port") -> int | None:
    # not 0: the server must listen where its "serving on" line says (and 0 in the file read as "unset")
    if v is not None and not 1 <= v <= 65535:
        raise ServeConfigError(f"{name}: expected an integer from 1 to 65535, got {v}")
    return v


def _replicas(v: int | None, name: str = "replicas") -> int | None:
    if v is not None and v < 1:
        raise ServeConfigError(f"{name}: expected an integer >= 1, got {v}")
    return v


def _grace(v: float | None, name: str = "shutdown_grace") -> float:
    """Seconds from 0 to MAX_SHUTDOWN_GRACE_S (None: the default)."""
    if v is None:
        return DEFAULT_SHUTDOWN_GRACE_S
    if not 0 <= v <= MAX_SHUTDOWN_GRACE_S:  # NaN fails both
        raise ServeConfigError(f"{name}: expected seconds from 0 to {MAX_SHUTDOWN_GRACE_S:.0f}, got {v}")
    return float(v)


def config_from_dict(raw: Mapping[str, Any]) -> ServeConfig:
    """Validate the parsed serve.json. Unknown keys are refused: a typo must not be silently ignored."""
    if not isinstance(raw, dict):
        raise ServeConfigError("the config must be a JSON object")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise ServeConfigError(f"unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    layer_split = raw.get("layer_split")
    if isinstance(layer_split, bool) or (layer_split is not None and not isinstance(layer_split, (str, int))):
        raise ServeConfigError(f'layer_split: expected "auto", "off" or layer numbers like "24", got '
                               f"{json.dumps(layer_split)}")
    return ServeConfig(
        model=_typed(raw, "model", str, "a path to a GGUF file"),
        gpu=parse_gpu(raw.get("gpu")),
        args=_parse_args(raw.get("args")),
        env=_parse_env(raw.get("env")),
        host=_typed(raw, "host", str, "a host name or address") or DEFAULT_HOST,
        port=_port(_typed(raw, "port", int, "an integer from 1 to 65535")) or DEFAULT_PORT,
        api_key=_api_key(_typed(raw, "api_key", str, "a string"), "api_key"),
        layer_split=None if layer_split is None else str(layer_split),
        replicas=_replicas(_typed(raw, "replicas", int, "an integer >= 1")) or 1,
        shutdown_grace=_grace(_typed(raw, "shutdown_grace", (int, float), "seconds (a number)")),
    )


def _api_key(key: str | None, where: str) -> str | None:
    """A key with spaces or tabs around it could never match: a header's value is read stripped. An empty key
    is refused: `--api-key "$KEY"` with KEY unset served with no key at all, and said nothing."""
    if key == "":
        raise ServeConfigError(f"{where}: an empty key (leave it out to serve without a key)")
    if key is not None and key != key.strip():
        raise ServeConfigError(f"{where}: the key has spaces around it (a request's key never would)")
    return key


def load_config_file(path: str) -> ServeConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = read_capped(f, CONFIG_LIMIT)
    except OSError as e:
        raise ServeConfigError(f"--config: cannot read {path} ({e.strerror})") from None
    except TooLong as e:
        raise ServeConfigError(f"--config: {path} is {e}; a serve.json is a few lines") from None
    except UnicodeDecodeError:  # raised by read(), not by json.loads of a str
        raise ServeConfigError(f"--config: {path} is not UTF-8 text") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeConfigError(f"--config: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return config_from_dict(raw)
    except ServeConfigError as e:
        raise ServeConfigError(f"{path}: {e}") from None


# --- what the config becomes ------------------------------------------------------------------------------


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def engine_args(cfg: ServeConfig) -> list[str]:
    """The engine flags of a config: its args, its model, and the automatic layer split for several GPUs."""
    args = list(cfg.args)
    if cfg.model is not None and not has_flag(args, "--model"):
        args += ["--model", cfg.model]
    split = cfg.layer_split or "auto"
    wants_split = len(cfg.gpu) > 1 and split != LAYER_SPLIT_OFF
    if wants_split and not has_flag(args, "--layer-split") and not has_flag(args, "--peer-device"):
        args += ["--layer-split", split]
    return args


def child_env(cfg: ServeConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The environment the server (and the Ray instance it starts) runs with."""
    env = dict(base)
    if cfg.gpu:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # nvidia-smi's numbering, which is what users write
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpu)
    env.update(cfg.env)
    return env


# --- the serve command line -------------------------------------------------------------------------------


def build_serve_parser():
    parser = _OneLineParser(
        prog=PROG,
        description="OpenAI-compatible HTTP server on Ray Serve: /v1/chat/completions, /v1/completions, "
        "/v1/models(/{id}), /tokenize, /detokenize, /health, /v1/status, /metrics and a chat + monitor page "
        "at /. Settings come from "
        "--config serve.json (keys: " + ", ".join(KEYS) + "); flags given here override the file. One "
        "model a server: a request's \"model\" is not checked (as llama-server; /v1/models names it).",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--config", "-c", metavar="FILE", help="serve.json")
    server.add_argument("--host", metavar="HOST", help=f"address to listen on (default {DEFAULT_HOST})")
    server.add_argument("--port", metavar="PORT", help=f"port to listen on (default {DEFAULT_PORT})")
    server.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (a flag shows "
                        "in ps to other users of the machine; serve.json's \"api_key\" does not)")
    server.add_argument("--gpu", metavar="0,2", help="GPUs to use, nvidia-smi numbering (overrides \"gpu\")")
    server.add_argument("--replicas", metavar="N", help="engine replicas behind the server (default 1)")
    server.add_argument("--address", metavar="auto|local|HOST:PORT", default=None,
                        help="Ray cluster to attach to (default: RAY_ADDRESS, else a running cluster, else a "
                        "new local instance; 'local' always starts a local instance)")
    server.add_argument("--shutdown-grace", metavar="S",
                        help="seconds the requests already taken get to finish when the server is told "
                        f"to stop (Ctrl-C, SIGTERM; default {DEFAULT_SHUTDOWN_GRACE_S:.0f}); a stream still "
                        "open then ends with an error event and [DONE], an answer with a 503")
    server.add_argument("--verbose", "-v", action="store_true", help="show Ray's and Serve's logs")
    add_engine_args(parser)
    return parser


def _cli_overrides(ns) -> dict[str, Any]:
    over: dict[str, Any] = {}
    if ns.host is not None:
        if not ns.host.strip():
            raise ServeConfigError("--host: an empty address (give a host name or address, e.g. 0.0.0.0)")
        over["host"] = ns.host
    if ns.port is not None:
        over["port"] = _port(_int_flag("--port", ns.port), "--port")
    if ns.api_key is not None:
        over["api_key"] = _api_key(ns.api_key, "--api-key")
    if ns.gpu is not None:
        over["gpu"] = parse_gpu(ns.gpu, "--gpu")
    if ns.replicas is not None:
        over["replicas"] = _replicas(_int_flag("--replicas", ns.replicas), "--replicas")
    if ns.shutdown_grace is not None:
        try:
            seconds = float(ns.shutdown_grace)
        except ValueError:
            raise ServeConfigError(f"--shutdown-grace: invalid value {ns.shutdown_grace!r} (allowed: "
                                   "seconds, a number)") from None
        over["shutdown_grace"] = _grace(seconds, "--shutdown-grace")
    return over


def _int_flag(flag: str, raw: str) -> int:
    try:
        return decimal(raw)
    except ValueError:
        raise ServeConfigError(f"{flag}: invalid value {raw!r} (allowed: an integer)") from None


def _engine_cli_args(ns) -> list[str]:
    """The engine flags given on the serve command line, re-spelled to follow (override) the file's."""
    from strata_ray.config import ENGINE_FLAGS

    out: list[str] = []
    for name, (flag, *_rest) in ENGINE_FLAGS.items():
        value = getattr(ns, name, None)
        if value is not None:
            out += [flag, value]
    return out


def resolve(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServePlan:
    """serve argv (+ the file it names) -> ServePlan. Raises ConfigError (one line) on anything invalid."""
    from dataclasses import replace

    environ = os.environ if environ is None else environ
    parser = build_serve_parser()
    ns = parser.parse_args(list(argv))
    cfg = load_config_file(ns.config) if ns.config else ServeConfig()
    cfg = replace(cfg, **_cli_overrides(ns))
    from_file, cli = engine_args(cfg), _engine_cli_args(ns)
    added, argv_engine = from_file[len(cfg.args):], from_file + cli
    env = child_env(cfg, environ)
    engine_ns = _parse_engine_args(argv_engine, "args" if ns.config else "flags")
    engine = config_from_args(engine_ns, env)
    if engine.device == "cpu" and cfg.gpu:  # (device auto on a cluster without GPUs: serve_main's check)
        gpus = ",".join(map(str, cfg.gpu))  # the GPUs were ignored, the server ran on the CPU unnoticed
        raise ServeConfigError(f'GPUs {gpus} asked for (--gpu / "gpu"), but --device cpu serves on the CPU: '
                               "drop one of them")
    changed = {k: v for k, v in env.items() if environ.get(k) != v}
    return ServePlan(serve=cfg, engine=engine, engine_argv=tuple(argv_engine), env=changed,
                     address=ns.address, verbose=ns.verbose,
                     auto_split="--layer-split" in added and "--layer-split" not in cli)


class _EngineArgsParser(_OneLineParser):
    def error(self, message: str):
        raise ServeConfigError(f"engine {self.prog}: {message}")


def _parse_engine_args(args: Sequence[str], where: str):
    parser = _EngineArgsParser(prog=where, add_help=False)
    add_engine_args(parser)
    return parser.parse_args(list(args))
