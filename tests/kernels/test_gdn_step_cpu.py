"""The numba GDN step (strata_ray/kernels/gdn_step_cpu.py) against its torch reference twin, at awkward
token counts, with the states written in place and token by token; which calls take it."""

from __future__ import annotations

import pytest
import torch

from strata_ray.kernels.gdn_step import GDNDims, gdn_step_reference
from strata_ray.kernels.gdn_step_cpu import CPU_STEP_MAX_STATE, cpu_step_serves, gdn_step_cpu
from tests.kernels.test_gdn_step import SMALL, _check_close, _inputs

ODD = GDNDims(nk=3, nv=6, dk=24, dv=40)  # dk != dv, neither a power of two (the Triton step refuses them)


@pytest.mark.parametrize("dims", [SMALL, ODD])
@pytest.mark.parametrize("T", [1, 5, 16, 33, 222])
def test_cpu_step_equals_the_reference_to_rounding(dims, T):
    args = _inputs(dims, T, seed=T)
    got = gdn_step_cpu(*args, dims, 1e-6)
    _check_close(got, gdn_step_reference(*args, dims, 1e-6))
    assert all(torch.isfinite(t).all() for t in got)
    mixed, z, ba, S, conv, *w = args
    assert torch.equal(got[2], torch.cat((conv, mixed))[-conv.shape[0]:])  # the conv state: the last inputs


@pytest.mark.parametrize("T", [1, 7])
def test_states_in_place_and_token_by_token_give_the_same_bits(T):
    args = _inputs(SMALL, T, seed=10 + T)
    got = gdn_step_cpu(*args, SMALL, 1e-6)
    mixed, z, ba, S, conv, *w = args
    S_in, conv_in = S.clone(), conv.clone()
    o_in, S_out, conv_out = gdn_step_cpu(mixed, z, ba, S_in, conv_in, *w, SMALL, 1e-6,
                                         state_out=(S_in, conv_in))
    assert S_out is S_in and conv_out is conv_in
    assert torch.equal(o_in, got[0]) and torch.equal(S_in, got[1]) and torch.equal(conv_in, got[2])
    assert torch.equal(S, args[3]) and torch.equal(conv, args[4])  # the inputs untouched without state_out
    outs = []
    for t in range(T):
        o, S, conv = gdn_step_cpu(mixed[t : t + 1], z[t : t + 1], ba[t : t + 1], S, conv, *w, SMALL, 1e-6)
        outs.append(o)
    assert torch.equal(torch.cat(outs), got[0])
    assert torch.equal(S, got[1]) and torch.equal(conv, got[2])


def test_no_tokens_keep_the_states():
    mixed, z, ba, S, conv, *w = _inputs(SMALL, 3)
    o, S2, conv2 = gdn_step_cpu(mixed[:0], z[:0], ba[:0], S, conv, *w, SMALL, 1e-6)
    assert o.shape == (0, z.shape[1]) and torch.equal(S2, S) and torch.equal(conv2, conv)


def test_which_calls_take_it(monkeypatch):
    x = torch.zeros(1, 8)
    assert cpu_step_serves(x, 1, SMALL) and cpu_step_serves(x, 16, SMALL)
    assert not cpu_step_serves(x, 17, SMALL)  # a prompt chunk: the reference (chunked form)
    assert not cpu_step_serves(x, 0, SMALL)
    big = GDNDims(nk=16, nv=32, dk=128, dv=128)  # the 80b-a3b's 2 MB state: torch's batched products
    assert big.nv * big.dk * big.dv > CPU_STEP_MAX_STATE and not cpu_step_serves(x, 1, big)
    assert not cpu_step_serves(torch.zeros(1, 8, requires_grad=True), 1, SMALL)
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert not cpu_step_serves(x, 1, SMALL)


def test_the_model_takes_it_for_decode_and_the_reference_for_prompts(monkeypatch):
    """The model's GDN layers on CPU: one-token calls run the numba step, a 40-token call the reference."""
    import strata_ray.model.gdn as gdn
    from strata_ray.model.forward import Model
    from tests.model import hf_reference as ref

    hf_model = ref.tiny_qwen3next(seed=0)
    model = Model(ref.hparams_of(hf_model), ref.gguf_weights(hf_model))
    calls = []
    real = gdn.gdn_step_cpu
    monkeypatch.setattr(gdn, "gdn_step_cpu", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    with torch.inference_mode():
        state = model.new_state()
        model.forward(ref.random_prompt(40), state)
        assert calls == []
        model.forward([7], state)
    assert calls == [1, 1, 1]  # the tiny model's three GDN layers (layer 3 is full attention)
