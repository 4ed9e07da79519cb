"""How well a decode layer's routing is known ahead of time, on a real (trained) model: the evidence for
copying experts ahead of the routing, and for doing so a layer earlier.

    PYTHONPATH=. python scripts/routing_ahead.py [--model M.gguf] [--tokens 128] [--prompt-tokens 256]
        [--ahead 2]

Greedy decode on the CPU (the reference forward, float experts); at each token and layer l it compares the
layer's routed experts with three predictions, each the router of the layer predicted (its own norm) applied
to a residual known earlier:
  - same layer, from its input: layer l's router over layer l's input, before its mixer. The decode's
    copies ahead (STRATA_DECODE_PREFETCH) use this one: it is there a mixer before the routing.
  - next layer, from the input: layer l + 1's router over layer l's input: two mixers and an MoE before
    layer l + 1's routing.
  - next layer, from the MoE input: layer l + 1's router over layer l's residual after its mixer (what
    layer l's own router sees): layer l's experts and layer l + 1's mixer before the routing.
For each: recall (the share of the routed top-k the predicted top-k holds) and the hit rate of the first
`--ahead` predicted experts (how many of the copies ahead would be routed). Chance is k / n_expert.
"""

from __future__ import annotations

import argparse

import torch

from strata_ray.bench.prompts import corpus_documents
from strata_ray.model import ops
from strata_ray.model.attention import attention_block
from strata_ray.model.gdn import gdn_block
from strata_ray.model.loader import load_model
from strata_ray.model.moe import moe_block


class Tally:
    def __init__(self, ahead: int):
        self.ahead = ahead
        self.routed = self.found = self.copies = self.copies_used = 0

    def add(self, predicted: torch.Tensor, routed: torch.Tensor) -> None:
        """predicted [K'] expert ids, best first; routed [K]."""
        got = set(routed.tolist())
        self.routed += len(got)
        self.found += len(got & set(predicted[: len(got)].tolist()))
        first = predicted[: self.ahead].tolist()
        self.copies += len(first)
        self.copies_used += sum(e in got for e in first)

    def line(self) -> str:
        return (f"recall {self.found / max(1, self.routed):.3f}, the first {self.ahead} copied ahead used "
                f"{self.copies_used / max(1, self.copies):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy decode tokens")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length before the decode")
    ap.add_argument("--ahead", type=int, default=2, help="experts copied ahead a layer")
    args = ap.parse_args()
    loaded = load_model(args.model)
    model, hp, w = loaded.model, loaded.model.hp, loaded.model.weights
    ids = loaded.tokenizer.encode(" ".join(corpus_documents()))[: args.prompt_tokens]
    norm_name = model.ffn_norm
    k = hp.n_expert_used
    tallies = {name: Tally(args.ahead) for name in ("same layer, input", "next layer, input",
                                                     "next layer, MoE input")}

    def ranked(layer: int, h: torch.Tensor) -> torch.Tensor:
        x = ops.rms_norm(h, w[f"blk.{layer}.{norm_name}.weight"], hp.rms_eps)
        return torch.argsort(ops.linear(x, w[f"blk.{layer}.ffn_gate_inp.weight"])[0], descending=True)[:k]

    with torch.inference_mode():
        state = model.new_state()
        logits = model(ids, state, last_only=True)
        token = int(logits[-1].argmax())
        for _ in range(args.tokens):
            h = ops.embedding(torch.tensor([token]), w["token_embd.weight"])  # [1, E]
            pos0 = state.pos
            before = {}  # layer -> predictions of its routing made earlier
            for layer in range(hp.n_layer):
                p = f"blk.{layer}"
                before.setdefault(layer, {})["same layer, input"] = ranked(layer, h)
                if layer + 1 < hp.n_layer:
                    before.setdefault(layer + 1, {})["next layer, input"] = ranked(layer + 1, h)
                x = ops.rms_norm(h, w[f"{p}.attn_norm.weight"], hp.rms_eps)
                if hp.is_recurrent(layer):
                    out, state.gdn[layer] = gdn_block(hp, w, layer, x, state.gdn[layer], pos0)
                else:
                    out = attention_block(hp, w, layer, x, state.kv[layer], pos0)
                h = h + out
                if layer + 1 < hp.n_layer:
                    before.setdefault(layer + 1, {})["next layer, MoE input"] = ranked(layer + 1, h)
                x = ops.rms_norm(h, w[f"{p}.{norm_name}.weight"], hp.rms_eps)
                routed, _ = model.route(layer, x)
                for name, predicted in before[layer].items():
                    tallies[name].add(predicted, routed[0])
                h = h + moe_block(w, layer, x, k, model.experts)
            state.pos = pos0 + 1
            hidden = ops.rms_norm(h, w["output_norm.weight"], hp.rms_eps)
            token = int(ops.linear(hidden, w.get("output.weight", w["token_embd.weight"]))[0].argmax())
    print(f"{loaded.path.name}: {hp.n_layer} layers, top-{k} of {hp.n_expert}, {args.tokens} greedy tokens "
          f"after {len(ids)}; chance recall {k / hp.n_expert:.3f}")
    for name, t in tallies.items():
        print(f"  {name:22s} {t.line()}")


if __name__ == "__main__":
    main()
