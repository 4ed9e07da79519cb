"""scripts/trace_summary.py on a hand-made Chrome trace: busy union over streams, gaps, kernels by name."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _event(name: str, ts: float, dur: float, stream: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream}


def test_busy_gaps_and_ranking(tmp_path):
    events = [
        _event("gemv", 0, 10, 7),
        _event("copy", 5, 10, 9, cat="gpu_memcpy"),  # overlaps gemv on another stream: busy 0-15
        _event("gemv", 18, 10, 7),  # 3 us gap
        _event("attn", 128, 50, 7),  # 100 us gap
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host: ignored
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, "scripts/trace_summary.py", str(path), "--tokens", "2"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[0]
    assert "4 device events over 0.18 ms: busy 0.07 ms (42%), idle 0.10 ms" in first
    assert "busy 0.04 ms, 2 events" in first  # per token of 2 (0.075 / 2 rounds to 0.04)
    assert "2-5      us:       0     0.00 ms" in out  # one 3 us gap over two tokens
    assert "100-1000   us:       0     0.05 ms" in out
    ranked = [line.split()[-1] for line in out.split("top 30 device ops")[1].splitlines()[1:]]
    assert ranked == ["attn", "gemv", "copy"]


def test_no_device_events(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": []}))
    out = subprocess.run([sys.executable, "scripts/trace_summary.py", str(path)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "no device events in the trace"


def test_timeline_lists_the_middle_layers_event_by_event(tmp_path):
    events, t = [], 0.0
    for _ in range(4):  # each layer: combine, a gemv, then a 20 us wait, a copy on another stream
        events += [_event("_combine_body", t, 4, 7), _event("gemv", t + 5, 10, 7),
                   _event("copy", t + 35, 3, 9, cat="gpu_memcpy")]
        t += 40
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, "scripts/trace_summary.py", str(path), "--timeline", "1"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    lines = out.split("timeline of 1 layers")[1].splitlines()[1:]
    assert [line.split()[-1] for line in lines[:3]] == ["_combine_body", "gemv", "copy"]
    start, length, idle = (float(v) for v in lines[2].split()[:3])
    assert (start, length, idle) == (35.0, 3.0, 20.0) and "*" in lines[2]  # a gap of 5 us or more is starred
    assert lines[3].split()[0] == "40.0"  # where the next layer opens
    few = subprocess.run([sys.executable, "scripts/trace_summary.py", str(path), "--timeline", "9"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "fewer than 10 '_combine_body' events" in few


def test_by_layer_gives_each_layers_mean_over_tokens(tmp_path):
    """--by-layer: the op's events split by their place within a token (2 tokens of 3 layers)."""
    events, t = [], 0.0
    for waits in ((10, 40, 4), (20, 60, 6)):
        for w in waits:
            events.append(_event("_wait_body", t, w, 7))
            t += 100
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    run = [sys.executable, "scripts/trace_summary.py", str(path), "--by-layer", "_wait_body"]
    def summary(tokens: str) -> str:
        return subprocess.run([*run, "--tokens", tokens], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    tail = summary("2").split("'_wait_body' by layer")[1].splitlines()
    assert "(3 a token; us, the mean over 2 tokens): min 5.0, median 15.0, max 50.0, sum 0.07 ms" in tail[0]
    assert tail[1].split(": ")[1] == "#1 50.0, #0 15.0, #2 5.0" and tail[2].split(": ")[1] == "15 50 5"
    assert "6 '_wait_body' events do not split evenly over 4 tokens" in summary("4")
