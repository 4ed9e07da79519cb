import numpy as np
import torch

from strata_ray.experts.recording import RoutingRecorder


class TinyFloatExperts:
    """A real (if small) ExpertBackend: expert e of layer l is a matrix; rows = sum_k w * x @ W."""

    def __init__(self, n_layers, n_expert, n_embd, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(n_layers, n_expert, n_embd, n_embd, generator=g)  # [L, X, E, E]

    def __call__(self, layer, x, ids, weights):
        rows = torch.einsum("ne,nkef->nkf", x, self.w[layer][ids])  # [N, K, E]
        return (weights.unsqueeze(-1) * rows).sum(1)  # [N, E]


def route(n, n_expert, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n)])  # [N, K]
    w = torch.rand(n, k, generator=g)
    return ids, w / w.sum(1, keepdim=True)


def test_counts_every_entry_and_forwards_unchanged():
    inner = TinyFloatExperts(n_layers=3, n_expert=6, n_embd=4)
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
    rec = RoutingRecorder(TinyFloatExperts(1, 4, 2), n_layers=1, n_expert=4)
    assert rec.take_counts().tolist() == [[0, 0, 0, 0]]
    ids = torch.tensor([[3, 1], [3, 0]])
    rec(0, torch.ones(2, 2), ids, torch.full((2, 2), 0.5))
    assert rec.take_counts().tolist() == [[1, 1, 0, 2]]
    assert rec.counts().tolist() == [[0, 0, 0, 0]]
