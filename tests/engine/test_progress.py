"""Load progress without Ray: the Engine reports its stages and the cache fill to a LoadProgress, and
draws bars itself only when stderr is a terminal (a real pseudo-terminal here), never into a pipe."""

import fcntl
import io
import os
import pty
import struct
import sys
import termios

import pytest

from strata_ray.config import EngineConfig
from strata_ray.engine.engine import Engine
from strata_ray.engine.progress import FILL_STAGE, LoadProgress, TerminalBars, terminal_bars
from strata_ray.model.synth import write_synth

SLOTS = 12


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "tiny.gguf"
    write_synth(path, arch="qwen3next", preset="tiny", progress=False)
    return EngineConfig(model=str(path), device="cpu", expert_cache=SLOTS)


def test_engine_reports_stages_and_the_fill(config):
    seen = []
    progress = LoadProgress(on_change=seen.append)
    engine = Engine(config, progress=progress)
    stages = [s["stage"] for s in seen]
    assert stages[0] == "dense weights" and "host store" in stages and stages[-1] == "tokenizer"
    assert stages.index("compiling kernels") < stages.index("tokenizer")
    fills = [(s["fill_done"], s["fill_total"]) for s in seen if s["stage"] == FILL_STAGE]
    assert fills[0] == (0, SLOTS) and fills[-1] == (SLOTS, SLOTS)
    final = {"stage": "tokenizer", "fill_done": SLOTS, "fill_total": SLOTS, "done": True}
    assert progress.snapshot() == final
    assert engine.info()["expert_cache"].startswith(f"pre-filled {SLOTS} of {SLOTS} slots from the default")
    assert engine.info()["pin_error"] is None  # no CUDA here: nothing was page-locked, nothing refused


def test_no_bars_when_stderr_is_not_a_terminal(config, monkeypatch):
    pipe = io.StringIO()  # isatty() is False, like a pipe or a log file
    monkeypatch.setattr(sys, "stderr", pipe)
    assert terminal_bars() is None
    Engine(config)  # progress=None: bars only on a terminal
    assert pipe.getvalue() == ""


def read_all(fd: int) -> str:
    out = bytearray()
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        out.extend(chunk)
    return out.decode("utf-8", "replace")


def test_bars_on_a_terminal(config, monkeypatch):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm sizes bars to it
    terminal = os.fdopen(slave, "w")
    try:
        monkeypatch.setattr(sys, "stderr", terminal)
        Engine(config)
        terminal.flush()
        drawn = read_all(master)
    finally:
        terminal.close()
        os.close(master)
    assert "strata_ray: loading the model" in drawn
    assert f"strata_ray: {FILL_STAGE}: 100%" in drawn and f"{SLOTS}/{SLOTS} slots" in drawn


def test_bars_follow_snapshots():
    stream = io.StringIO()
    bars = TerminalBars(stream)
    bars.update({"stage": "dense weights", "fill_done": 0, "fill_total": 0, "done": False})
    assert FILL_STAGE not in stream.getvalue()  # no fill bar before the fill starts
    bars.update({"stage": FILL_STAGE, "fill_done": 5, "fill_total": 8, "done": False})
    bars.update({"stage": FILL_STAGE, "fill_done": 8, "fill_total": 8, "done": False})
    bars.close()
    assert "5/8 slots" in stream.getvalue() and "8/8 slots" in stream.getvalue()
