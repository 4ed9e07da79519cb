"""Decoding helpers shared by the expert-tier tests (CPU and CUDA)."""

import torch


def greedy_logits(model, prompt: list[int], n: int) -> torch.Tensor:
    """The prompt, then n greedy one-token forwards -> their logits stacked [n, V] (on the CPU)."""
    with torch.inference_mode():
        state = model.new_state()
        logits = model.forward(prompt, state)[-1:]
        out = []
        for _ in range(n):
            logits = model.forward([int(logits[-1].argmax())], state)
            out.append(logits)
    return torch.cat(out).cpu()


def generate_and_check_prompt_counts(model, tiers, prompt: list[int], n: int, ahead: int = 0) -> None:
    """generate() on a prompt (of any size: a short one runs the decode's kernels), then the counts checked:
    the prompt's entries are prompt entries (and prompt heat); the windows, tokens, hits and the pipelined
    decode's copies ahead and warm reads are the decode's alone. ahead: the experts the pipelined decode
    copies ahead a layer: at most that many a decode token and layer (a prompt token's would go past it)."""
    from strata_ray.engine.generate import generate
    from strata_ray.engine.sampling import SamplingParams

    hp = model.hp
    result = generate(model, prompt, n, SamplingParams(), stop_ids=())
    tiers.finish()
    c = tiers.metrics.counts
    decoded = len(result.token_ids) - 1  # the last token is sampled, never run through the model
    assert c.prompt_entries == len(prompt) * hp.n_expert_used * hp.n_layer
    assert c.tokens == c.windows == decoded
    assert c.slot_hits + c.cpu_entries + c.pcie_entries == decoded * hp.n_expert_used * hp.n_layer
    assert int(tiers.prompt_heat.sum()) == c.prompt_entries and not tiers.in_prompt
    # of the decode's own entries: those copied ahead are PCIe entries, the warm hits CPU entries
    assert c.ahead_entries <= c.pcie_entries and c.warm_hits <= c.cpu_entries
    assert c.ahead_copies <= decoded * hp.n_layer * ahead
