"""Train the embedded default model (strata_ray/data/strata-tiny-next.gguf) on the CPU.

A small qwen3next (3 Gated DeltaNet layers + 1 gated full-attention layer, 16 routed experts top-2 plus the
shared expert, one MTP/nextn layer) trained on English that ships with Python (strata_ray/model/corpus.py),
with a byte-level BPE tokenizer learned from the same text. Training runs THROUGH the engine's own torch
reference forward (strata_ray.model.forward.Model) with autograd, so the shipped weights mean exactly what
the engine computes. Deterministic: fixed seeds, fixed data order, deterministic torch algorithms.

    python scripts/train_tiny.py              # train (resumes from --work-dir checkpoints), write, evaluate
    python scripts/train_tiny.py --eval-only  # re-evaluate the written GGUF

Loss = next-token CE + MTP_WEIGHT * MTP CE (the MTP head sees the post-final-norm hidden state at t and the
embedding of token t+1 and predicts token t+2) + BALANCE_WEIGHT * a Switch-style load-balancing term, kept
small so that routing ends up skewed like a real model's but not collapsed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strata_ray.model.corpus import CHATML_TEMPLATE, bpe_vocab_lists, build_corpus, train_bpe  # noqa: E402
from strata_ray.model.hparams import HParams  # noqa: E402

DATA_DIR = ROOT / "strata_ray" / "data"
GGUF_PATH = DATA_DIR / "strata-tiny-next.gguf"
STRP_PATH = DATA_DIR / "strata-tiny-next.strp"

VOCAB = 2048
MTP_WEIGHT = 0.3
BALANCE_WEIGHT = 0.002  # Switch aux loss coefficient: small, routing stays skewed
INIT_STD = 0.02  # HF initializer_range


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    seq_len: int = 256  # a multiple of the GDN chunk (64): the chunked form only
    batch: int = 4  # sequences per step (run one after another, gradients accumulate)
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 1234
    checkpoint_every: int = 100


def tiny_hparams(n_vocab: int) -> HParams:
    n_layer = 4
    return HParams(
        arch="qwen3next", n_vocab=n_vocab, n_embd=128, n_layer=n_layer, n_nextn=1,
        n_head=4, n_head_kv=2, head_dim=32, n_expert=16, n_expert_used=2, n_ff_exp=128, n_ff_shexp=128,
        rms_eps=1e-6, rope_freq_base=10000.0, n_rot=16, context_length=2048,
        ssm_conv_kernel=4, ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=4 * 32,
        recurrent=tuple((i + 1) % 4 != 0 for i in range(n_layer)),
    )


# --- parameters ---------------------------------------------------------------------------------------

A_LOG = "A_log"  # trained in log space; the GGUF stores ssm_a = -exp(A_log)


def init_params(hp: HParams, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.nn.Parameter]:
    """HF-style init for every GGUF tensor: matrices N(0, 0.02), norms 1 (the GGUF's folded +1), GDN decay
    A ~ U(0, 16) as in HF, dt bias 1, conv like nn.Conv1d (U(+-1/sqrt(K)))."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in shapes.items():
        if name.endswith(".ssm_a"):
            a = torch.empty(shape).uniform_(1e-4, 16.0, generator=gen)
            params[name.replace(".ssm_a", f".{A_LOG}")] = torch.nn.Parameter(a.log())
            continue
        if name.endswith(("norm.weight", "ssm_dt.bias")):
            t = torch.ones(shape)
        elif name.endswith("ssm_conv1d.weight"):
            bound = 1.0 / math.sqrt(shape[-1])
            t = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        else:
            t = torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
        params[name] = torch.nn.Parameter(t)
    return params


def gguf_weights(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GGUF-named float tensors the forward reads (differentiable functions of the parameters)."""
    out = {}
    for name, p in params.items():
        if name.endswith(f".{A_LOG}"):
            out[name.replace(f".{A_LOG}", ".ssm_a")] = -torch.exp(p)
        else:
            out[name] = p
    return out


def is_decayed(name: str) -> bool:
    """Weight decay on the matrices only (not norms, biases, decay rates, conv taps)."""
    matrix = name.endswith(".weight") and "norm" not in name and "conv1d" not in name
    return matrix and "gate_inp_shexp" not in name


# --- data -----------------------------------------------------------------------------------------------

def encode_stream(tok, docs: list[str], eot: int) -> torch.Tensor:
    """All documents as one int64 token stream, each followed by <|endoftext|>."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


def window_starts(n_tokens: int, seq_len: int, count: int, seed: int) -> torch.Tensor:
    """`count` random window offsets (each window holds seq_len + 1 tokens), fixed by the seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - seq_len - 1, (count,), generator=gen)


# --- the training objective ------------------------------------------------------------------------------

class BalancedExperts:
    """ExpertBackend for training: computes the routed rows with the engine's float experts and adds the
    Switch load-balancing term (n_expert * sum_e f_e * P_e) of every trunk layer to `aux`."""

    def __init__(self, inner, weights: dict[str, torch.Tensor], hp: HParams):
        self.inner, self.weights, self.hp = inner, weights, hp
        self.aux = torch.zeros(())

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if layer < self.hp.n_layer:
            probs = torch.softmax(x @ self.weights[f"blk.{layer}.ffn_gate_inp.weight"].T, dim=-1)  # [N, X]
            frac = torch.bincount(ids.reshape(-1), minlength=self.hp.n_expert).float() / ids.numel()
            self.aux = self.aux + self.hp.n_expert * (frac * probs.mean(0)).sum()
        return self.inner(layer, x, ids, w)


def sequence_losses(model, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token CE, MTP CE) of one window [T+1] from a fresh state.

    The trunk reads ids[:T] and predicts ids[1:T+1]; the MTP head at position t reads the post-norm hidden
    state h_t and token t+1 and predicts token t+2."""
    ids, targets = window[:-1], window[1:]
    state = model.new_state()
    logits, hidden = model.forward(ids, state, return_hidden=True)  # [T, V], [T, E]
    ce = F.cross_entropy(logits, targets)
    mtp = model.mtp_logits(hidden[:-1], ids[1:], state)  # [T-1, V]
    mtp_ce = F.cross_entropy(mtp, targets[1:])
    return ce, mtp_ce


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


# --- training loop -----------------------------------------------------------------------------------------

def save_checkpoint(path: Path, step: int, params, opt, log: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "params": {k: v.detach() for k, v in params.items()}, "opt": opt.state_dict(),
                "log": log}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save keeps the previous checkpoint


def train(hp: HParams, stream: torch.Tensor, cfg: TrainConfig, work_dir: Path) -> dict[str, torch.Tensor]:
    """Train from scratch or resume from work_dir/checkpoint.pt; returns the GGUF-named float weights."""
    from strata_ray.model.forward import Model
    from strata_ray.model.moe import FloatExperts
    from strata_ray.model.tensor_layout import tensor_layout

    torch.manual_seed(cfg.seed)
    params = init_params(hp, dict(tensor_layout(hp)), cfg.seed)
    decay = [p for n, p in params.items() if is_decayed(n)]
    other = [p for n, p in params.items() if not is_decayed(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt_path = work_dir / "checkpoint.pt"
    start, log = 0, []
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        with torch.no_grad():
            for k, v in ckpt["params"].items():
                params[k].copy_(v)
        opt.load_state_dict(ckpt["opt"])
        start, log = ckpt["step"], ckpt["log"]
        print(f"resumed from {ckpt_path} at step {start}", flush=True)

    starts = window_starts(len(stream), cfg.seq_len, cfg.steps * cfg.batch, cfg.seed)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", mininterval=10,
               dynamic_ncols=False, ncols=110)
    t0 = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        tot = {"ce": 0.0, "mtp": 0.0, "aux": 0.0}
        for b in range(cfg.batch):
            s = int(starts[step * cfg.batch + b])
            window = stream[s : s + cfg.seq_len + 1]
            weights = gguf_weights(params)
            experts = BalancedExperts(FloatExperts(weights), weights, hp)
            model = Model(hp, weights, experts=experts)
            ce, mtp_ce = sequence_losses(model, window)
            aux = experts.aux / hp.n_layer
            loss = (ce + MTP_WEIGHT * mtp_ce + BALANCE_WEIGHT * aux) / cfg.batch
            loss.backward()
            tot["ce"] += ce.item() / cfg.batch
            tot["mtp"] += mtp_ce.item() / cfg.batch
            tot["aux"] += aux.item() / cfg.batch
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        log.append({"step": step, **tot})
        bar.set_postfix(loss=f"{tot['ce']:.3f}", mtp=f"{tot['mtp']:.3f}", aux=f"{tot['aux']:.2f}",
                        refresh=False)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(ckpt_path, step + 1, params, opt, log)
            print(f"step {step + 1}: ce {tot['ce']:.3f} mtp {tot['mtp']:.3f} aux {tot['aux']:.3f} "
                  f"({time.time() - t0:.0f}s this run)", flush=True)
    bar.close()
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in gguf_weights(params).items()}


# --- writing the GGUF and the expert profile ---------------------------------------------------------------

def tokenizer_spec(tok):
    """The trained tokenizer as GGUF tokenizer keys (specials CONTROL; bos = eos = pad = <|endoftext|>, the
    document separator this base model was trained with)."""
    from strata_ray.model.gguf_writer import CONTROL, NORMAL, TokenizerSpec

    tokens, special, merges = bpe_vocab_lists(tok)
    eot = tokens.index("<|endoftext|>")
    types = [CONTROL if s else NORMAL for s in special]
    return TokenizerSpec(tokens=tokens, token_types=types, merges=merges, bos_id=eot, eos_id=eot,
                         chat_template=CHATML_TEMPLATE, pre="qwen2", pad_id=eot)


def tensor_type(name: str, shape: tuple[int, ...]) -> int:
    """Q8_0 routed experts, F16 dense matrices, F32 for what llama-quantize keeps float (norms, router, conv,
    ssm_a / dt)."""
    from strata_ray.model.gguf_writer import T
    from strata_ray.model.tensor_layout import is_expert_tensor, keeps_float

    if keeps_float(name, shape):
        return T.F32
    return T.Q8_0 if is_expert_tensor(name) else T.F16


def write_model(path: Path, hp: HParams, tok, weights: dict[str, torch.Tensor]) -> None:
    from strata_ray.model.gguf_writer import ModelWriter
    from strata_ray.model.tensor_layout import tensor_layout

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = ModelWriter(path, hp, tokenizer_spec(tok))
    writer.extra_fields["general.name"] = "strata-tiny-next"
    for name, shape in tensor_layout(hp):
        arr = weights[name].detach().float().numpy()
        writer.add(name, shape, tensor_type(name, shape), lambda a=arr: a)
    writer.write()
    print(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MiB)", flush=True)


# --- evaluation of the WRITTEN file (quantized weights are what is measured) --------------------------------

def load_written(path: Path):
    """(hp, GGUF-named float weights dequantized from the file, engine tokenizer), via the engine's loader."""
    from strata_ray.model.loader import load_model

    loaded = load_model(path)
    return loaded.hp, loaded.model.weights, loaded.tokenizer


@torch.inference_mode()
def heldout_losses(model, stream: torch.Tensor, seq_len: int) -> tuple[float, float]:
    """Mean next-token CE and mean MTP (t+2) CE over consecutive windows of the held-out stream."""
    ce_sum = mtp_sum = 0.0
    n = n_mtp = 0
    for s in range(0, len(stream) - seq_len - 1, seq_len):
        window = stream[s : s + seq_len + 1]
        ids, targets = window[:-1], window[1:]
        state = model.new_state()
        logits, hidden = model.forward(ids, state, return_hidden=True)
        ce_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        mtp = model.mtp_logits(hidden[:-1], ids[1:], state)
        mtp_sum += F.cross_entropy(mtp, targets[1:], reduction="sum").item()
        n, n_mtp = n + len(targets), n_mtp + len(targets) - 1
    return ce_sum / n, mtp_sum / n_mtp


@torch.inference_mode()
def greedy(model, prompt: list[int], n_new: int) -> list[int]:
    state = model.new_state()
    logits = model.forward(torch.tensor(prompt), state)
    out = list(prompt)
    for _ in range(n_new):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits = model.forward(torch.tensor([nxt]), state)
    return out


@torch.inference_mode()
def mtp_agreement(model, prompts: list[list[int]], n_new: int) -> float:
    """How often the MTP head's top-1 equals the model's own greedy token after next, on greedy continuations
    (what self-speculative decoding accepts): on a greedy sequence x, token t+2 is the trunk's argmax after
    t+1, so compare argmax MTP(h_t, x_{t+1}) with x_{t+2} over the generated part."""
    hits = total = 0
    for prompt in prompts:
        seq = torch.tensor(greedy(model, prompt, n_new))
        state = model.new_state()
        _, hidden = model.forward(seq, state, return_hidden=True)
        draft = model.mtp_logits(hidden[:-2], seq[1:-1], state).argmax(-1)  # [L-2]: draft[t] -> seq[t+2]
        first = len(prompt) - 2  # from here on the target seq[t+2] is a greedy (generated) token
        hits += int((draft[first:] == seq[first + 2 :]).sum())
        total += len(seq) - 2 - first
    return hits / total


def top_quarter_share(counts: np.ndarray) -> float:
    """Share of routed entries taken by the busiest 25% of experts, averaged over layers (uniform: 0.25)."""
    n_top = max(1, counts.shape[1] // 4)
    top = np.sort(counts, axis=1)[:, ::-1][:, :n_top].sum(1)
    return float(np.mean(top / counts.sum(1)))


def evaluate(path: Path, held_stream: torch.Tensor, strp_path: Path | None) -> dict[str, object]:
    from strata_ray.experts.profile import rank_from_counts, write_profile
    from strata_ray.experts.recording import RoutingRecorder
    from strata_ray.model.forward import Model
    from strata_ray.model.gguf_file import GGUFFile
    from strata_ray.model.moe import FloatExperts
    from strata_ray.model.routing_digest import routing_digest

    hp, weights, tokenizer = load_written(path)
    recorder = RoutingRecorder(FloatExperts(weights), hp.n_layer, hp.n_expert)
    model = Model(hp, weights, experts=recorder)
    loss, mtp_loss = heldout_losses(model, held_stream, TrainConfig.seq_len)
    counts = recorder.counts()
    if strp_path is not None:
        write_profile(strp_path, rank_from_counts(counts, model=routing_digest(GGUFFile(path))))
    plain = Model(hp, weights)
    prompts = [held_stream[s : s + 16].tolist() for s in range(0, 16 * 257, 257)]
    agree = mtp_agreement(plain, prompts, 48)
    sample = tokenizer.decode(greedy(plain, tokenizer.encode("The for statement"), 40))
    return {
        "file": f"{path} ({path.stat().st_size / 2**20:.2f} MiB)",
        "held-out tokens": len(held_stream),
        "held-out loss": f"{loss:.3f} nats (perplexity {math.exp(loss):.1f})",
        "uniform loss ln V": f"{math.log(hp.n_vocab):.3f} nats (perplexity {hp.n_vocab})",
        "held-out MTP (t+2) loss": f"{mtp_loss:.3f} nats",
        "MTP top-1 agreement with own greedy t+2": f"{agree:.3f} (chance 1/V = {1 / hp.n_vocab:.5f})",
        "routing share of top 25% experts": f"{top_quarter_share(counts):.3f} (uniform 0.25)",
        "profile": str(strp_path) if strp_path is not None else "-",
        "greedy sample": repr(sample),
    }


# --- main ---------------------------------------------------------------------------------------------------

def prepare_data():
    """(corpus, trained tokenizer, train stream, held-out stream)."""
    corpus = build_corpus()
    tok = train_bpe(corpus.train, VOCAB)
    eot = tok.token_to_id("<|endoftext|>")
    return corpus, tok, encode_stream(tok, corpus.train, eot), encode_stream(tok, corpus.heldout, eot)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=ROOT / "build" / "train_tiny",
                    help="where the checkpoints go (build/train_tiny)")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps,
                    help=f"optimizer steps ({TrainConfig.steps})")
    ap.add_argument("--out", type=Path, default=GGUF_PATH, help="GGUF to write (the .strp goes next to it)")
    ap.add_argument("--eval-only", action="store_true", help="only evaluate the GGUF at --out")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (2)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    cfg = TrainConfig(steps=args.steps)
    t_start = time.time()
    corpus, tok, train_stream, held_stream = prepare_data()
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out documents, "
          f"{len(train_stream)} / {len(held_stream)} tokens, vocab {tok.get_vocab_size()}", flush=True)
    hp = tiny_hparams(tok.get_vocab_size())
    if not args.eval_only:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        weights = train(hp, train_stream, cfg, args.work_dir)
        print(f"training done in {time.time() - t_start:.0f}s", flush=True)
        write_model(args.out, hp, tok, weights)
    report = evaluate(args.out, held_stream, args.out.with_suffix(".strp"))
    for k, v in report.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
