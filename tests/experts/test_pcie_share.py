"""The default PCIe share (strata_ray/experts/pcie_share.py): the rule on the two hosts it was fitted to, the
measured host rate, and the tiers taking it where the share is left unset."""

from __future__ import annotations

import pytest

from strata_ray.experts.pcie_share import auto_pcie_share, host_copy_gbs, share_for
from strata_ray.kernels.cpu_pool import CpuPool


@pytest.mark.parametrize("host_gbs,share", [(61.0, 300), (140.4, 150), (87.1, 200), (1e4, 0), (1.0, 950)])
def test_share_for_the_measured_hosts_and_the_ends(host_gbs, share):
    """The H200 machine (61 GB/s: 300 measured best), the H100 machine of session 41 (140: 150), the H100
    host of sessions 38-40 (87), a memory far faster than PCIe (no share) and one far slower."""
    assert share_for(host_gbs) == share


def test_share_for_refuses_a_rate_that_is_not_one():
    for bad in (0.0, -3.0, float("nan")):
        with pytest.raises(ValueError, match="host rate"):
            share_for(bad)


def test_auto_share_measures_this_host():
    pool = CpuPool(2)
    share, gbs = auto_pcie_share(pool)
    assert gbs > 0.5 and share == share_for(gbs) and 0 <= share <= 1000 and share % 50 == 0
    assert host_copy_gbs(pool, 1 << 20, repeats=1) > 0


def test_tiers_without_cuda_leave_the_share_unset_at_zero(tiny_next_q4):
    """On the CPU backend there is no PCIe tier: an unset share is 0 and nothing is measured."""
    from strata_ray.config import EngineConfig
    from strata_ray.experts.build import load_tiered_model

    cfg = EngineConfig(model=tiny_next_q4, device="cpu", expert_cache=4)
    assert cfg.pcie_share is None
    _, tiers = load_tiered_model(cfg, "cpu", progress=False)
    assert tiers.pcie_share == 0 and tiers.host_gbs is None
