import numpy as np
import torch

from strata_ray.experts.recording import RoutingRecorder
from strata_ray.model.moe import FloatExperts


def float_experts(n_layers, n_expert, n_embd=4, n_ff=3, seed=0):
    """The model's own FloatExperts over small random expert weights (GGUF names and shapes)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(n_layers):
        p = f"blk.{layer}"
        weights[f"{p}.ffn_gate_exps.weight"] = torch.randn(n_expert, n_ff, n_embd, generator=g)  # [X, I, E]
        weights[f"{p}.ffn_up_exps.weight"] = torch.randn(n_expert, n_ff, n_embd, generator=g)  # [X, I, E]
        weights[f"{p}.ffn_down_exps.weight"] = torch.randn(n_expert, n_embd, n_ff, generator=g)  # [X, E, I]
    return FloatExperts(weights)


def route(n, n_expert, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n)])  # [N, K]
    w = torch.rand(n, k, generator=g)
    return ids, w / w.sum(1, keepdim=True)


def test_counts_every_entry_and_forwards_unchanged():
    inner = float_experts(n_layers=3, n_expert=6)
    rec = RoutingRecorder(inner, n_layers=2, n_expert=6)  # layer 2 plays the MTP layer
    expected = np.zeros((2, 6), dtype=np.int64)
    for step, (layer, n) in enumerate([(0, 5), (1, 5), (0, 1), (1, 1), (2, 3)]):
        x = torch.randn(n, 4)
        ids, w = route(n, 6, k=3, seed=step)
        out = rec(layer, x, ids, w)
        assert torch.equal(out, inner(layer, x, ids, w))  # bit-identical: recording changes nothing
        if layer < 2:
            np.add.at(expected[layer], ids.reshape(-1).numpy(), 1)
    np.testing.assert_array_equal(rec.counts(), expected)
    assert rec.counts().sum() == (5 + 5 + 1 + 1) * 3
    assert rec.tokens == 6


def test_take_counts_resets():
    rec = RoutingRecorder(float_experts(1, 4, n_embd=2), n_layers=1, n_expert=4)
    assert rec.take_counts().tolist() == [[0, 0, 0, 0]]
    ids = torch.tensor([[3, 1], [3, 0]])
    rec(0, torch.ones(2, 2), ids, torch.full((2, 2), 0.5))
    assert rec.take_counts().tolist() == [[1, 1, 0, 2]]
    assert rec.counts().tolist() == [[0, 0, 0, 0]]
