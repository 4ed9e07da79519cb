"""Where a benchmark sends its prompts: the Ray actors (default), the Engine in this process, or a server.

- `ray` (default): the same `strata:primary` and `strata:coordinator` actors as `run`, placed and loaded
  the same way, token batches streamed through Ray: the numbers include what a user of `run` waits for.
  Actors kept by an earlier `run --keep-actors` with the same flags are reused.
- `local` (`--local`): the Engine in this process, no Ray: the engine alone.
- `url` (`--url`): any OpenAI-compatible server; `--model` then only supplies the tokenizer, so prompts
  have exact lengths. The results are the server's model's, named as its /v1/models names it; a --model
  of another name is told in a note (an alias, or the wrong file).
Each opens as a context manager and tears down exactly what it created.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from strata_ray.bench.measure import LocalRunner, RayRunner, Runner


@dataclass
class Target:
    mode: str  # local | ray | url
    runner: Runner
    tokenizer: object | None  # None: a server's model whose tokenizer we do not have
    file: object | None  # the GGUFFile, when we can see the model
    path: object | None
    context_length: int | None
    engine_device: str | None
    config: object | None  # EngineConfig (None for a server)
    server: dict | None = None
    count_tokens: object | None = None  # without a tokenizer: content -> the server's count (its /tokenize)


def say(line: str) -> None:
    sys.stderr.write(f"strata_ray bench: {line}\n")
    sys.stderr.flush()


def open_model_file(model: str | None):
    """(GGUFFile, path, Tokenizer) of --model (or the embedded default) without loading weights."""
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.loader import resolve_model_path
    from strata_ray.model.tokenizer import Tokenizer

    path = resolve_model_path(model)
    file = GGUFFile(path)
    return file, path, Tokenizer.from_gguf(file)


@contextlib.contextmanager
def local_target(cfg) -> Iterator[Target]:
    from strata_ray.engine.engine import Engine

    engine = Engine(cfg)
    loaded = engine.loaded
    say(f"loaded {os.path.basename(str(loaded.path))} in this process on {engine.device}")
    yield Target("local", LocalRunner(engine), engine.tokenizer, loaded.file, loaded.path,
                 loaded.hp.context_length, engine.device, cfg)


@contextlib.contextmanager
def ray_target(cfg, address: str | None, verbose: bool, replace_actors: bool) -> Iterator[Target]:
    import ray

    from strata_ray.actors import launch
    from strata_ray.engine.engine import check_supported

    file, path, tokenizer = open_model_file(cfg.model)  # bad files and flags fail in a second, before Ray
    if cfg.model is not None:
        cfg = replace(cfg, model=os.path.abspath(cfg.model))  # the actor's working directory differs
    check_supported(cfg)
    session = dep = None
    try:
        session = launch.connect(address, False, verbose)
        say("started a local Ray instance" if session.started else f"attached to Ray at {session.address}")
        cfg = replace(cfg, device=launch.cluster_device(cfg))
        dep = None if session.started else launch.find_existing(cfg, replace=replace_actors)
        if dep is None:
            dep = launch.launch(cfg, keep=False)
        else:
            say(f"reusing {launch.PRIMARY_NAME} kept by an earlier run")
        started = time.monotonic()
        info = ray.get(dep.primary.load.remote())
        say(f"{launch.PRIMARY_NAME} has {os.path.basename(info['path'])} on {info['device']} "
            f"(ready in {time.monotonic() - started:.1f} s)")
        yield Target("ray", RayRunner(dep.primary), tokenizer, file, path, file.hparams.context_length,
                     info.get("device"), cfg)
    except Exception as e:
        launch.exit_if_cluster_gone(session, e, say)
        raise
    finally:
        launch.teardown(dep, keep=False, session=session)
        launch.disconnect(session)


@contextlib.contextmanager
def url_target(url: str, served_model: str | None, api: str, model: str | None,
               api_key: str | None) -> Iterator[Target]:
    from strata_ray.bench.http_client import HttpRunner

    file = path = tokenizer = None
    if model is not None:
        file, path, tokenizer = open_model_file(model)
    runner = HttpRunner(url, served_model, api, api_key=api_key)
    entry = runner.served_entry()
    name = runner.served_name()
    if file is not None and entry is not None and not same_model(name, path, file):
        # not refused: a server may serve the file under an alias (llama-server --alias, vLLM
        # --served-model-name), and the file is then the right tokenizer; the results keep the server's name
        stem = model_stem(str(path))
        say(f"note: the server names its model {name!r}, not --model's {stem!r}: the results are labelled "
            "with the server's name; prompt lengths come from --model's tokenizer, exact only if it is that "
            "model's")
    counter = None if tokenizer else runner.count_tokens if runner.count_tokens("probe") else None
    lengths = "" if tokenizer else "; prompt lengths counted by the server's /tokenize" if counter else \
        "; prompt lengths estimated (pass --model for exact ones)"
    say(f"driving {runner.base} (model {name!r}, {api} API){lengths}")
    # the server's context where it says one (a server may give less than the file's): prompts are cut to it
    known = [n for n in (None if file is None else file.hparams.context_length, runner.served_context()) if n]
    context = min(known) if known else None
    yield Target("url", runner, tokenizer, file, path, context, None, None,
                 server={"url": runner.base, "model": name, "api": api}, count_tokens=counter)


def model_stem(name: str) -> str:
    """A model's name as servers and files spell it, reduced for comparison: 'dir/Qwen3-8B-Q4_K_M.gguf',
    'Qwen3-8B-Q4_K_M-00001-of-00002.gguf' and 'qwen3-8b-q4_k_m' -> 'qwen3-8b-q4_k_m'."""
    base = re.split(r"[\\/]", name.strip())[-1]
    base = re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    return re.sub(r"-\d{5}-of-\d{5}$", "", base).casefold()


def same_model(served: str, path, file) -> bool:
    """Whether the server's name for its model is the --model file's: its file name (ours lists the file's
    stem, llama-server and vLLM the path they loaded) or its general.name."""
    names = {model_stem(str(path)), model_stem(str(file.fields.get("general.name") or ""))} - {""}
    return model_stem(served) in names


def open_target(ns, cfg):
    """The context manager for the target the flags ask for."""
    if ns.url:
        api_key = ns.api_key if ns.api_key is not None else os.environ.get("OPENAI_API_KEY")
        return url_target(ns.url, ns.served_model, ns.api, cfg.model, api_key)
    if ns.local:
        return local_target(cfg)
    return ray_target(cfg, ns.address, ns.verbose, ns.replace_actors)
