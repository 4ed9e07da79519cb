"""Greedy decoding helper shared by the expert-tier tests."""

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
