"""Run a script of scripts/ as a user would: its own process from the repository root, output captured."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """python scripts/<name> args..., from the repository root (a script's sibling imports resolve there)."""
    return subprocess.run([sys.executable, f"scripts/{name}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def last_line(out: subprocess.CompletedProcess) -> str:
    """The last line of a run's stderr: where a script's one-line error is."""
    lines = out.stderr.strip().splitlines()
    return lines[-1] if lines else ""
