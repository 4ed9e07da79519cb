"""scripts/ncu_stalls.py on a hand-made ncu source page: launches, reasons, opcodes, the barrier share."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_wait","stall_barrier","stall_long_sb (Not Issued)"')


def _page(tmp_path, *launches) -> Path:
    lines = []
    for name, rows in launches:
        lines += [f'"Kernel Name","{name}",', HEADER]
        lines += [",".join(f'"{v}"' for v in row) for row in rows]
    path = tmp_path / "page.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/ncu_stalls.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


def test_a_launchs_stalls_by_reason_opcode_and_barrier(tmp_path):
    rows = [  # address, SASS, samples, executed, long_sb, wait, barrier, long_sb not issued (ignored)
        ("0x0", "LDG.E.CONSTANT R2, desc[UR4][R2.64]", "0", "1,000", "", "", "", "9"),
        ("0x10", "@P0   IMAD.WIDE R8, R2, 0x4, R8", "60", "1,000", "58", "2", "", "9"),
        ("0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", "10", "1,000", "", "", "10", ""),
        ("0x30", "FADD R4, R4, R5", "30", "2,000", "", "30", "", ""),
    ]
    path = _page(tmp_path, ("expert_rows", rows), ("expert_rows", rows[:1]))
    out = _run(path, "--top", "2").stdout
    first, second = out.split("launch 1")
    assert "launch 0 (expert_rows): 4 instructions, 100 samples, 5000 executed" in first
    assert "stall reasons: long_sb 58.0%, wait 32.0%, barrier 10.0%" in first
    assert "samples by opcode: IMAD 60.0%, FADD 30.0%, BAR 10.0%" in first
    assert "executed by opcode: FADD 40.0%, LDG 20.0%, IMAD 20.0%, BAR 20.0%" in first
    assert "up to the first barrier (instruction 2): 70.0% of samples" in first
    listed = [line for line in first.splitlines() if line.startswith("      ")]
    assert len(listed) == 2 and "IMAD.WIDE" in listed[0] and "long_sb 58, wait 2" in listed[0]
    assert listed[0].endswith("| LDG.E.CONSTANT R2, desc[UR4][R2.64]")  # the load it waits on
    assert "1 instructions, 0 samples" in second and "no CTA barrier" in second
    only = _run(path, "--kernel", "1").stdout
    assert only.startswith("launch 1 ") and "launch 0" not in only


def test_a_file_without_a_launch_or_a_kernel_past_the_end_is_refused(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text('"==PROF== nothing"\n')
    r = _run(empty)
    assert r.returncode == 2 and "no launch table" in r.stderr.strip().splitlines()[-1]
    r = _run(_page(tmp_path, ("k", [("0x0", "EXIT", "1", "1", "", "", "", "")])), "--kernel", "3")
    assert r.returncode == 2 and "--kernel 3: the file holds 1 launches" in r.stderr
