"""The embedded default model (strata_ray/data/strata-tiny-next.gguf + .strp), loaded through the engine's
loader: it is trained (held-out loss far below uniform, readable greedy text), routes like a real MoE
(skewed), its MTP head drafts the model's own next-next token, and its tokenizer and profile match what
training made."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata_ray.experts.profile import check_shape, read_profile
from strata_ray.experts.recording import RoutingRecorder
from strata_ray.model.corpus import SPECIAL_TOKENS, bpe_vocab_lists, build_corpus, train_bpe, words
from strata_ray.model.forward import Model
from strata_ray.model.loader import default_model_path, load_model
from strata_ray.model.moe import FloatExperts

SEQ = 256  # evaluation window (the training length)
HELD_TOKENS = 16 * SEQ  # a fixed held-out sample: the first 16 windows of the held-out stream
MAX_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


@pytest.fixture(scope="module")
def corpus():
    return build_corpus()


@pytest.fixture(scope="module")
def held_stream(loaded, corpus):
    tok = loaded.tokenizer
    eot = tok.encode("<|endoftext|>")
    ids: list[int] = []
    for doc in corpus.heldout:
        ids += tok.encode(doc) + eot
        if len(ids) > HELD_TOKENS + 1:
            break
    return torch.tensor(ids[: HELD_TOKENS + 1])


@pytest.fixture(scope="module")
def heldout_pass(loaded, held_stream):
    """(mean next-token CE, routing counts [L, X]) over the held-out sample, routing recorded per pair."""
    hp = loaded.hp
    recorder = RoutingRecorder(FloatExperts(loaded.model.weights), hp.n_layer, hp.n_expert)
    model = Model(hp, loaded.model.weights, experts=recorder)
    total, n = 0.0, 0
    with torch.inference_mode():
        for s in range(0, HELD_TOKENS, SEQ):
            window = held_stream[s : s + SEQ + 1]
            logits = model.forward(window[:-1], model.new_state())
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
            n += SEQ
    return total / n, recorder.counts()


@torch.inference_mode()
def greedy(model, prompt: list[int], n_new: int) -> list[int]:
    state = model.new_state()
    logits = model.forward(torch.tensor(prompt), state)
    out = list(prompt)
    for _ in range(n_new):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), state)
    return out


def top_quarter_share(counts: np.ndarray) -> np.ndarray:
    """Per layer: share of routed entries taken by the busiest 25% of experts (uniform router: 0.25)."""
    n_top = counts.shape[1] // 4
    return np.sort(counts, axis=1)[:, ::-1][:, :n_top].sum(1) / counts.sum(1)


def test_shipped_files_shape_and_size(loaded):
    hp, f = loaded.hp, loaded.file
    assert loaded.path == default_model_path()
    strp = default_model_path().with_suffix(".strp")
    assert default_model_path().stat().st_size + strp.stat().st_size <= MAX_BYTES
    assert hp.arch == "qwen3next" and hp.has_mtp
    assert hp.n_expert >= 16 and hp.n_expert_used >= 2 and hp.n_ff_shexp > 0
    assert any(hp.recurrent) and not all(hp.recurrent)  # both Gated DeltaNet and full attention layers
    assert f.has(f"blk.{hp.n_layer}.nextn.eh_proj.weight")
    assert "<|im_start|>" in f.fields["tokenizer.chat_template"]


def test_heldout_loss_far_below_uniform(loaded, heldout_pass):
    loss, _ = heldout_pass
    uniform = math.log(loaded.hp.n_vocab)
    print(f"held-out loss {loss:.3f} nats (ppl {math.exp(loss):.1f}), uniform {uniform:.3f}")
    assert loss <= uniform - 2.0


def test_greedy_text_is_made_of_training_words(loaded, corpus):
    tok = loaded.tokenizer
    prompt = tok.encode("The for statement")
    text = tok.decode(greedy(loaded.model, prompt, 40)[len(prompt) :])
    generated = re.findall(r"[a-z]+", text.lower())
    vocabulary = words("\n".join(corpus.train))
    known = sum(w in vocabulary for w in generated)
    print(f"greedy: {text!r}")
    assert len(generated) >= 10
    assert known / len(generated) >= 0.7


def test_routing_is_skewed(heldout_pass):
    _, counts = heldout_pass
    share = top_quarter_share(counts)
    print(f"top-25% expert share per layer: {np.round(share, 3).tolist()}")
    assert share.mean() > 0.35
    assert (counts > 0).sum() > counts.size // 2  # skewed, not collapsed onto a few experts


def test_mtp_drafts_own_next_next_token(loaded, held_stream):
    """On greedy continuations token t+2 is the model's own greedy choice; the MTP head sees h_t and t+1."""
    model, V = loaded.model, loaded.hp.n_vocab
    hits = total = 0
    with torch.inference_mode():
        for s in range(0, 4 * SEQ, SEQ):
            prompt = held_stream[s : s + 16].tolist()
            seq = torch.tensor(greedy(model, prompt, 32))
            state = model.new_state()
            _, hidden = model.forward(seq, state, return_hidden=True)
            draft = model.mtp_logits(hidden[:-2], seq[1:-1], state).argmax(-1)  # draft[t] -> seq[t+2]
            first = len(prompt) - 2
            hits += int((draft[first:] == seq[first + 2 :]).sum())
            total += len(seq) - 2 - first
    rate = hits / total
    print(f"MTP top-1 agreement {rate:.3f} (chance {1 / V:.5f})")
    assert rate > 100 / V


def test_profile_matches_model_and_routing(loaded, heldout_pass):
    hp = loaded.hp
    profile = read_profile(default_model_path().with_suffix(".strp"))
    check_shape(profile, hp)
    assert profile.n_ranked == hp.n_layer * hp.n_expert
    _, counts = heldout_pass
    hottest = profile.ranked[: profile.n_ranked // 4]  # the profile's top quarter of pairs
    share = counts[hottest[:, 0], hottest[:, 1]].sum() / counts.sum()
    assert share > 0.35  # the ranking was made from this model's routing on held-out text


def test_tokenizer_from_gguf_encodes_like_the_trained_one(loaded, corpus):
    tokens = loaded.file.fields["tokenizer.ggml.tokens"]
    trained = train_bpe(corpus.train, len(tokens))
    if bpe_vocab_lists(trained)[0] != list(tokens):
        pytest.skip("this Python's standard-library docstrings differ from the training interpreter's")
    tok = loaded.tokenizer
    odd = ["héllo wörld — ünïcode\n\n\tx = 1  # 42", "a<|im_start|>user\nhi<|im_end|>"]
    samples = corpus.heldout[:20] + odd
    for text in samples:
        assert tok.encode(text) == trained.encode(text).ids
    assert {tokens[i] for i in tok.stop_ids} >= {"<|endoftext|>", "<|im_end|>"}
    assert all(t in tokens for t in SPECIAL_TOKENS)
