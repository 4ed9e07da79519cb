"""DecodeRows (the tiers' fixed-shape one-token step) under the decode graphs, on a CPU primary: the same
logits bit for bit as TieredExperts.__call__, for every placement, with the same tier metrics and the
same adaptive swaps. `pytest -m gpu` runs it captured on CUDA (tests/experts/test_tiered_gpu.py)."""

from dataclasses import replace

import pytest
import torch

from strata_ray.config import EngineConfig
from strata_ray.experts.build import load_tiered_model
from strata_ray.experts.decode_rows import DecodeRows
from tests.experts.decoding import greedy_logits

PROMPT = [5, 17, 101, 42, 250, 7, 64, 3, 99, 180]
DECODE = 10


def _run(tiny_next, graphs: bool, **kw):
    """Greedy decode -> (stacked logits, tier counters) with or without the decode graph segments."""
    cfg = replace(EngineConfig(model=tiny_next, device="cpu"), **kw)
    loaded, tiers = load_tiered_model(cfg, "cpu", progress=False)
    model = loaded.model
    if graphs:
        model.use_decode_graphs(capture=False)
        assert isinstance(model.decode_graphs.rows, DecodeRows)
    logits = greedy_logits(model, PROMPT, DECODE)
    tiers.finish()
    c = tiers.metrics.counts
    return logits, (c.slot_hits, c.cpu_entries, c.swaps, c.windows, c.tokens)


@pytest.mark.parametrize("placement", [
    dict(expert_cache=0),
    dict(expert_cache=10, adapt_every=0),
    dict(expert_cache=10, adapt_every=1, adapt_swaps=8),
    dict(expert_cache=32),
])
def test_decode_rows_equal_the_tiered_call_bit_for_bit(tiny_next, placement):
    plain_logits, plain_counts = _run(tiny_next, graphs=False, **placement)
    got_logits, got_counts = _run(tiny_next, graphs=True, **placement)
    assert torch.equal(got_logits, plain_logits)
    assert got_counts == plain_counts  # hits, CPU entries, swaps, windows, tokens
    hits, cpu_entries, swaps, _, tokens = got_counts
    assert tokens == DECODE
    if placement.get("adapt_every"):
        assert swaps > 0  # the rounds ran from the counts this step recorded
    if placement["expert_cache"] == 10:
        assert hits > 0 and cpu_entries > 0  # both tiers served the step


def test_capture_without_a_cuda_cache_is_refused(tiny_next):
    loaded, tiers = load_tiered_model(replace(EngineConfig(model=tiny_next, device="cpu")), "cpu",
                                      progress=False)
    with pytest.raises(ValueError, match="need the slot cache on a CUDA device"):
        tiers.decode_rows(loaded.hp.n_embd, loaded.hp.n_expert_used, capture=True)
