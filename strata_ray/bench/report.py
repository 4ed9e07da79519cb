"""What a benchmark result says about where it came from, and how it is shown: table, JSON, plot.

The JSON carries everything needed to reproduce or compare a number: the engine flags (the full
EngineConfig), the model, the device, the git commit of this checkout and the versions of torch, ray,
numpy and strata_ray. The table is what a person reads; the plot (matplotlib, optional) draws prefill
and decode against context.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys

from strata_ray.atomic_file import write_atomic

REPORT_FORMAT = 1


class PlotError(RuntimeError):
    """--plot cannot be honoured (matplotlib missing, file not writable); one line."""


# ---- provenance ------------------------------------------------------------------------------------------


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "ray", "numpy", "strata_ray"):
        try:
            module = __import__(name)
            out[name] = str(getattr(module, "__version__", None))
        except ImportError:
            out[name] = None
    return out


def git_commit() -> dict[str, object] | None:
    """The commit of the checkout strata_ray runs from, and whether tracked files differ from it."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None  # an installed package, not a checkout
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(dirty)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(engine_device: str | None) -> dict[str, object]:
    """The device the engine ran on ('cpu'/'cuda', from the engine), with the names this process sees
    (under Ray the primary may sit on another node: the names are then the driver's)."""
    info: dict[str, object] = {
        "engine_device": engine_device,
        "host": platform.node(),
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def engine_flags(cfg) -> dict | None:
    return None if cfg is None else dataclasses.asdict(cfg)


def model_info(file, path) -> dict[str, object]:
    """Facts about a GGUF opened with GGUFFile (None: a server's model we cannot see)."""
    if file is None:
        return {"path": None if path is None else str(path)}
    hp = file.hparams
    return {
        "path": str(path),
        "name": file.fields.get("general.name"),
        "arch": hp.arch,
        "n_layer": hp.n_layer,
        "n_expert": hp.n_expert,
        "n_expert_used": hp.n_expert_used,
        "n_vocab": hp.n_vocab,
        "context_length": hp.context_length,
        "file_bytes": sum(os.path.getsize(p) for p in _shards(file, path)),
    }


def _shards(file, path) -> list[str]:
    paths = getattr(file, "paths", None)
    return [str(p) for p in paths] if paths else [str(path)]


def build_report(kind: str, mode: str, results: dict, *, plan: dict, config, model: dict, device: dict,
                 server: dict | None = None, argv: list[str] | None = None) -> dict:
    return {
        "format": REPORT_FORMAT,
        "kind": kind,
        "mode": mode,  # local | ray | url
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "plan": plan,
        "engine_flags": engine_flags(config),
        "model": model,
        "server": server,
        "device": device,
        "git": git_commit(),
        "versions": versions(),
        "results": results,
    }


def write_json(path: str, doc: dict, flag: str = "--json-out") -> bool:
    return write_or_show(path, json.dumps(doc, indent=1) + "\n", flag)


def write_or_show(path: str, text: str, flag: str) -> bool:
    """text into path (whole or not at all); where it cannot be written after a long run (a full disk), one
    line says so and the text goes to stdout instead, so the run's results are not lost. True if written."""
    try:
        write_atomic(path, text)
        return True
    except OSError as e:
        sys.stderr.write(f"strata_ray bench: {flag} {path}: cannot write ({e.strerror or e}); "
                         "the results follow on stdout instead\n")
        sys.stderr.flush()
        sys.stdout.write(text)
        sys.stdout.flush()
        return False


# ---- table -----------------------------------------------------------------------------------------------


def model_label(doc: dict) -> str:
    """The model the results are of: with --url the server's, as its /v1/models names it (there --model only
    lends a tokenizer for the prompts' lengths); else the file's name."""
    served = (doc.get("server") or {}).get("model")
    if served:
        return str(served)
    return doc["model"].get("name") or os.path.basename(doc["model"].get("path") or "") or "server"


def _rate(v: float | None, width: int) -> str:
    """A tok/s cell; n/a where it was not measurable (the reason is a note below the table)."""
    return f"{'n/a':>{width}}" if v is None else f"{v:>{width}.2f}"


def table(doc: dict) -> str:
    """The results as a fixed-width table, notes (cuts, short answers, an unmeasurable decode) below it."""
    device = doc["device"].get("engine_device") or "server"
    head = f"flashbench: {model_label(doc)} | {doc['mode']} | {device}"
    rows = [head, f"{'context':>8} {'prompt':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'ttft s':>8} "
            f"{'gen':>6}"]
    notes = []
    for c in doc["results"]["contexts"]:
        rows.append(f"{c['context']:>8} {c['prompt_tokens']:>8} {c['prefill_tps']:>14.1f} "
                    f"{_rate(c['decode_tps'], 13)} {c['ttft_s']:>8.3f} {c['generated_tokens']:>6.0f}")
        if c["note"]:
            notes.append(f"context {c['context']}: {c['note']}")
        if c.get("decode_note"):
            notes.append(f"context {c['context']}: {c['decode_note']}")
        if c["short"]:
            notes.append(f"context {c['context']}: SHORT answer (the model stopped before half the tokens)")
    story = doc["results"].get("story")
    if story:
        decode = "n/a" if story["decode_tps"] is None else f"{story['decode_tps']:.2f} tok/s"
        rows.append(f"story: {story['generated_tokens']:.0f} of {story['tokens']} tokens, decode {decode}")
        if story["note"]:
            notes.append(story["note"])
        if story.get("decode_note"):
            notes.append(f"story: {story['decode_note']}")
        if story["short"]:
            notes.append("story: SHORT answer (the model stopped before half the tokens)")
    if doc["results"].get("interrupted"):  # the last context may hold fewer runs than the plan's repeats
        ran = [len(c["runs"]) for c in doc["results"]["contexts"]]
        rows.append(f"interrupted: medians of the {', '.join(map(str, ran))} run(s) measured")
    else:
        rows.append(f"medians of {doc['plan']['repeats']} run(s)")
    return "\n".join(rows + [f"note: {n}" for n in notes])


# ---- plot ------------------------------------------------------------------------------------------------


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None


def plot(doc: dict, path: str) -> None:
    """Prefill and decode tok/s against prompt depth, side by side."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    contexts = doc["results"]["contexts"]
    xs = [c["prompt_tokens"] for c in contexts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((left, "prefill_tps", "prefill"), (right, "decode_tps", "decode")):
        points = [(x, c[key]) for x, c in zip(xs, contexts, strict=True) if c[key] is not None]  # not n/a
        ax.plot([x for x, _ in points], [v for _, v in points], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tok/s")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    device = doc["device"].get("engine_device") or "server"
    fig.suptitle(f"flashbench: {model_label(doc)} ({doc['mode']}, {device})")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise PlotError(f"--plot: cannot write {path} ({e.strerror})") from None
    finally:
        plt.close(fig)
