"""launch's plain helpers (the Ray paths are tested against real clusters in test_attach)."""

from __future__ import annotations

from dataclasses import replace

from strata_ray.actors.launch import gpu_only_flags
from strata_ray.config import EngineConfig


def test_the_gpu_only_flags_a_cpu_run_notes_are_those_set_away_from_their_defaults():
    # cluster_device notes them when the run lands on the CPU: accepted, and silently nothing, before
    assert gpu_only_flags(EngineConfig()) == []
    assert gpu_only_flags(replace(EngineConfig(), vram_budget_mib=100)) == ["--vram-budget-mib"]
    both = replace(EngineConfig(), vram_budget_mib=100, vram_reserve_mib=0)
    assert gpu_only_flags(both) == ["--vram-budget-mib", "--vram-reserve-mib"]
