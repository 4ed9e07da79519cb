"""Sparse MoE: router (softmax -> top-k -> renormalise), routed experts (ExpertBackend), shared expert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from strata_ray.kernels.fused_small import fused_enabled, needs_grad, plain_f32, shared_act_fused
from strata_ray.kernels.fused_small_cpu import (
    combine_cpu_serves,
    combine_rows_cpu,
    shared_act_cpu,
    shared_act_cpu_serves,
)
from strata_ray.kernels.router import route_reference, route_topk, router_logits
from strata_ray.kernels.router_cpu import route_cpu, route_cpu_serves
from strata_ray.model import ops


class ExpertBackend(Protocol):
    """The swap point for the contract kernels and the expert tiers."""

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """x [N, E] normed input, ids [N, K] int64 expert ids, weights [N, K] f32 (renormalised)
        -> routed sum [N, E]."""
        ...


def route(router_w: Tensor, x: Tensor, k: int,
          out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Router: softmax over all experts (fp32), top-k, renormalise. x [N, E] -> (ids [N, K], w [N, K]),
    written into `out` (ids int64, weights float32) when given.

    Calls of at most 16 tokens run two fused launches on CUDA (kernels/router), one numba call on the CPU
    (kernels/router_cpu)."""
    # the fused launches take float32 logits and have no backward
    if fused_enabled(x, x.shape[0]) and x.dtype == torch.float32 and not needs_grad(router_w):
        f32 = isinstance(router_w, Tensor) and router_w.dtype == torch.float32
        logits = router_logits(x, router_w) if f32 else ops.linear(x, router_w)  # [N, X]
        return route_topk(logits, k, out=out)
    if route_cpu_serves(x, router_w, x.shape[0]):
        return route_cpu(x, router_w, k, out=out)
    ids, weights = route_reference(ops.linear(x, router_w), k)
    if out is None:
        return ids, weights
    return out[0].copy_(ids), out[1].copy_(weights)


def combine_rows(rows: Tensor, weights: Tensor) -> Tensor:
    """Weighted sum of each token's k expert rows, in k order (the fixed order of the arithmetic contract).

    rows [N, K, E], weights [N, K] -> [N, E].

    float32 CPU tensors go through numpy: the same one multiply and one add per k, each rounded to float32
    as torch's ops round them (the same bits), without torch's dispatch (~25 us a decode layer on 2 cores);
    in a decode or verify window, through one numba call (kernels/fused_small_cpu, the same bits again).
    """
    if combine_cpu_serves(rows, weights):
        return combine_rows_cpu(rows, weights)
    if (rows.device.type == "cpu" and rows.dtype == weights.dtype == torch.float32
            and not needs_grad(rows, weights)):
        return combine_rows_numpy(rows, weights)
    slot_rows, slot_weights = rows.unbind(1), weights.split(1, dim=1)  # K views each: [N, E], [N, 1]
    out = slot_rows[0] * slot_weights[0]
    for row, weight in zip(slot_rows[1:], slot_weights[1:], strict=True):
        out = out + row * weight
    return out


def combine_rows_numpy(rows: Tensor, weights: Tensor) -> Tensor:
    """combine_rows' bits on float32 CPU tensors through numpy: rows [N, K, E], weights [N, K] -> [N, E]."""
    r, w = rows.detach().numpy(), weights.detach().numpy()  # views: [N, K, E], [N, K]
    acc = r[:, 0] * w[:, 0:1]
    for k in range(1, r.shape[1]):
        acc = acc + r[:, k] * w[:, k : k + 1]
    return torch.from_numpy(acc)


class FloatExperts:
    """Dense float expert math from weights["blk.N.ffn_{gate,up,down}_exps.weight"] ([X, I, E] / [X, E, I]).

    Tokens are grouped per expert (one host sync per layer for the group sizes); the result is differentiable
    with respect to the expert weights and x.
    """

    def __init__(self, weights: Mapping[str, Tensor]):
        self.weights = weights

    def rows(self, layer: int, x: Tensor, ids: Tensor) -> Tensor:
        """Each (token, slot) entry's expert output: x [N, E], ids [N, K] -> rows [N, K, E]."""
        p = f"blk.{layer}"
        gate, up, down = (self.weights[f"{p}.ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
        N, K = ids.shape
        if N == 0:
            return x.new_zeros(0, K, x.shape[-1])
        flat = ids.reshape(-1)  # entry m = token m // K, slot m % K
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                entries = order[start : start + n]
                outs.append(ops.swiglu(x[entries // K], gate[e], up[e], down[e]))
                start += n
        sorted_rows = torch.cat(outs)  # rows in `order`
        return sorted_rows[torch.argsort(order)].view(N, K, -1)

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return combine_rows(self.rows(layer, x, ids), weights)


def shared_expert(w: Mapping[str, Tensor], layer: int, x: Tensor, out: Tensor | None = None) -> Tensor:
    """qwen3next shared expert scaled by its per-token sigmoid gate: x [N, E] -> [N, E] (into `out` when
    given)."""
    p = f"blk.{layer}"
    w_gate_inp = w[f"{p}.ffn_gate_inp_shexp.weight"].reshape(1, -1)  # [1, E]: the output's sigmoid gate
    w_gate, w_up, w_down = (w[f"{p}.ffn_{part}_shexp.weight"] for part in ("gate", "up", "down"))
    if (fused_enabled(x, x.shape[0]) and plain_f32(x, w_gate_inp)
            and not needs_grad(w_gate, w_up, w_down)):
        # three launches (a decode step on CUDA): the gate+up GEMV, silu(g) * u * sigmoid(x . w_gate_inp) in
        # one kernel, the down GEMV into `out`. The gate scales h before the down projection: the same
        # product up to rounding, without the seven launches of the form below
        g, u = ops.linear_rows(x, (w_gate, w_up))  # [N, F] each
        return ops.linear(shared_act_fused(g, u, x, w_gate_inp), w_down, out=out)
    if shared_act_cpu_serves(x, w_gate_inp, x.shape[0]) and not needs_grad(w_gate, w_up, w_down):
        # the same form on the CPU: the activation one numba call instead of five torch ops
        g, u = ops.linear_rows(x, (w_gate, w_up))  # [N, F] each
        return ops.linear(shared_act_cpu(g, u, x, w_gate_inp), w_down, out=out)
    gate = torch.sigmoid(ops.linear(x, w_gate_inp))  # [N, 1]
    y = ops.swiglu(x, w_gate, w_up, w_down)
    return torch.mul(y, gate, out=out) if out is not None else y * gate


def moe_block(w: Mapping[str, Tensor], layer: int, x: Tensor, k: int, experts: ExpertBackend) -> Tensor:
    """Routed experts (+ shared expert when the layer has one) of normed input x [N, E] -> [N, E]."""
    ids, weights = route(w[f"blk.{layer}.ffn_gate_inp.weight"], x, k)
    out = experts(layer, x, ids, weights)
    if f"blk.{layer}.ffn_gate_shexp.weight" in w:
        out = out + shared_expert(w, layer, x)
    return out
