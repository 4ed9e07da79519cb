"""DecodeGraphs: one-token forwards through the captured segments give Model.forward's bits.

On the CPU the segments run uncaptured (capture=False): the same split into segments, static buffers and
state hand-offs. `pytest -m gpu` runs the captured graphs on CUDA against the eager forward there.
"""

import os

import pytest
import torch

from strata_ray.model.forward import Model
from tests.model import hf_reference as ref

PROMPT = 37  # not a multiple of the 64-token GDN chunk: decode starts mid-window
STEPS = 12


def _models(device="cpu"):
    """(eager model, model with decode graphs) over the same weights."""
    out = {}
    for arch, make in (("qwen3next", ref.tiny_qwen3next), ("qwen3moe", ref.tiny_qwen3moe)):
        hf = make(seed=0)
        weights = {k: v.to(device) for k, v in ref.gguf_weights(hf).items()}
        hp = ref.hparams_of(hf)
        graphed = Model(hp, weights)
        graphed.use_decode_graphs(capture=device == "cuda")
        out[arch] = (Model(hp, weights), graphed)
    return out


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=GPU),
                                        pytest.param("cuda-device-attention", marks=GPU)])
def models(request):
    """On the CPU the segments uncaptured; on CUDA (-m gpu) the captured graphs, with the attention core
    eager between them, or (STRATA_DECODE_DEVICE_ATTENTION=1) in them: the KV cache written and read at the
    position held on the device (DeviceAttention)."""
    device, _, variant = request.param.partition("-")
    old = os.environ.get("STRATA_DECODE_DEVICE_ATTENTION")
    os.environ["STRATA_DECODE_DEVICE_ATTENTION"] = "1" if variant else "0"  # read when the graphs are built
    try:
        models = _models(device)
    finally:
        if old is None:
            del os.environ["STRATA_DECODE_DEVICE_ATTENTION"]
        else:
            os.environ["STRATA_DECODE_DEVICE_ATTENTION"] = old
    if variant:
        assert all(graphed.decode_graphs.attn is not None for _, graphed in models.values())
    return models


def _decode(model, prompt, steps, state=None):
    """Prompt, then `steps` greedy one-token forwards -> (token ids, stacked logits)."""
    with torch.inference_mode():
        state = model.new_state() if state is None else state
        logits = model.forward(prompt, state)[-1:]
        toks, all_logits = [], []
        for _ in range(steps):
            toks.append(int(logits[-1].argmax()))
            logits = model.forward([toks[-1]], state)
            all_logits.append(logits)
    return toks, torch.cat(all_logits)


def _assert_same_decode(eager, graphed, prompt):
    toks_e, logits_e = _decode(eager, prompt, STEPS)
    toks_g, logits_g = _decode(graphed, prompt, STEPS)
    assert toks_g == toks_e
    assert torch.equal(logits_g, logits_e)  # bit for bit
    assert len(set(toks_e)) > 2  # a model stuck on one token would prove little


@pytest.mark.parametrize("arch", ["qwen3next", "qwen3moe"])
def test_decode_steps_equal_the_plain_forward_bit_for_bit(models, arch):
    eager, graphed = models[arch]
    _assert_same_decode(eager, graphed, ref.random_prompt(PROMPT, seed=4))


def test_interleaved_sequences_keep_their_own_state(models):
    eager, graphed = models["qwen3next"]
    prompts = [ref.random_prompt(PROMPT, seed=5), ref.random_prompt(20, seed=6)]
    alone = [_decode(eager, p, STEPS)[1] for p in prompts]
    with torch.inference_mode():
        states = [graphed.new_state() for _ in prompts]
        last = [graphed.forward(p, s)[-1:] for p, s in zip(prompts, states, strict=True)]
        got = [[], []]
        for _ in range(STEPS):  # A, B, A, B, ...: every step hands the GDN buffers to the other sequence
            for i, s in enumerate(states):
                last[i] = graphed.forward([int(last[i][-1].argmax())], s)
                got[i].append(last[i])
    for i in range(2):
        assert torch.equal(torch.cat(got[i]), alone[i])


def test_prompt_chunk_after_graph_steps_continues_the_same_state(models):
    """Decode steps, then a multi-token forward (eager, reads the graph-owned state), then decode again."""
    eager, graphed = models["qwen3next"]
    prompt, extra = ref.random_prompt(PROMPT, seed=7), ref.random_prompt(9, seed=8)
    results = []
    for model in (eager, graphed):
        with torch.inference_mode():
            state = model.new_state()
            model.forward(prompt, state)
            a = [model.forward([t], state) for t in (5, 9, 11)]
            b = model.forward(extra, state)
            c = [model.forward([t], state) for t in (3, 4)]
        results.append(torch.cat(a + [b] + c))
    assert torch.equal(results[1], results[0])


def test_snapshot_of_a_graph_owned_state_is_independent(models):
    """state.clone() while the graphs hold its GDN state, decode on: the snapshot replays the same tokens."""
    _, graphed = models["qwen3next"]
    with torch.inference_mode():
        state = graphed.new_state()
        graphed.forward(ref.random_prompt(PROMPT, seed=9), state)
        graphed.forward([7], state)
        snap = state.clone()
        first = [graphed.forward([t], state) for t in (1, 2, 3)]
        again = [graphed.forward([t], snap) for t in (1, 2, 3)]
    assert torch.equal(torch.cat(again), torch.cat(first))


def test_return_hidden_gives_the_final_normed_state(models):
    eager, graphed = models["qwen3next"]
    out = []
    for model in (eager, graphed):
        with torch.inference_mode():
            state = model.new_state()
            model.forward(ref.random_prompt(PROMPT, seed=10), state)
            out.append(model.forward([3], state, return_hidden=True))
    assert torch.equal(out[1][0], out[0][0]) and torch.equal(out[1][1], out[0][1])


def test_decode_across_kv_cache_growth(models):
    """40 steps from a 37-token prompt: the caches grow past 64 rows mid-decode (they move; the graphs' table
    of cache addresses follows)."""
    eager, graphed = models["qwen3moe"]
    toks_e, logits_e = _decode(eager, ref.random_prompt(PROMPT, seed=11), 40)
    toks_g, logits_g = _decode(graphed, ref.random_prompt(PROMPT, seed=11), 40)
    assert toks_g == toks_e and torch.equal(logits_g, logits_e)


def test_capture_on_a_cpu_model_is_refused():
    _, graphed = _models()["qwen3moe"]
    with pytest.raises(ValueError, match="need a CUDA device"):
        graphed.use_decode_graphs(capture=True)


class _AheadRows:
    """A rows backend that copies experts ahead (`ahead` > 0), played on the CPU: its rows are FloatExperts'
    (the eager forward's), and ahead_begin records, for each layer, the input the decode graphs hold at
    that moment and the routing they predict from it."""

    ahead = 2

    def __init__(self, experts, k: int):
        self.experts, self.k = experts, k
        self.graphs = None  # the DecodeGraphs, set after construction
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._rows = None

    def ahead_begin(self, layer: int) -> None:
        buf = self.graphs.layers[layer]
        self.calls.append((layer, buf.h_in.clone(), self.graphs._predict(layer, buf.h_in).clone()))

    def step(self, layer, x, ids, beside=None):
        self._rows = self.experts.rows(layer, x, ids)[0]  # [K, E]
        if beside is not None:
            beside()

    def rows(self):
        return self._rows

    def finish(self):
        pass


def _backed_models(backend_cls):
    """(eager model, model with uncaptured decode graphs over a backend_cls rows backend, that backend):
    the tiny qwen3next's weights, the backend's rows FloatExperts' (the eager forward's), backend.graphs
    set to the decode graphs."""
    from strata_ray.model.moe import FloatExperts

    hf = ref.tiny_qwen3next(seed=0)
    weights = ref.gguf_weights(hf)
    hp = ref.hparams_of(hf)
    eager, graphed = Model(hp, weights), Model(hp, weights)
    backend = backend_cls(FloatExperts(weights), hp.n_expert_used)
    graphed.experts.decode_rows = lambda e, k, capture: backend  # the tiers' hook (TieredExperts.decode_rows)
    graphed.use_decode_graphs(capture=False)
    backend.graphs = graphed.decode_graphs
    return eager, graphed, backend


def test_segments_split_for_copies_ahead_keep_the_bits_and_call_ahead_begin_at_each_layer_input():
    """With a backend that copies ahead, each layer's first segment ends once its input is in h_in
    (DecodeGraphs._split): ahead_begin(layer) comes then, every layer in order each step, the prediction
    reads that input, and the decode keeps the plain forward's bits."""
    eager, graphed, backend = _backed_models(_AheadRows)
    hp = graphed.hp
    assert graphed.decode_graphs.rows is backend and graphed.decode_graphs._ahead
    _assert_same_decode(eager, graphed, ref.random_prompt(PROMPT, seed=4))
    layers = [layer for layer, _, _ in backend.calls]
    assert layers == list(range(hp.n_layer)) * STEPS
    for _, h_in, pred in backend.calls:
        assert h_in.abs().sum() > 0 and pred.shape == (1, hp.n_expert_used)
    # the first step's layer 0 input is the token's embedding: the prediction read this step's input
    toks, _ = _decode(eager, ref.random_prompt(PROMPT, seed=4), 1)
    emb = graphed.weights["token_embd.weight"][toks[0]]
    assert torch.equal(backend.calls[0][1][0], emb)


class _TokenRows(_AheadRows):
    """_AheadRows with the token forms (PipelinedDecodeRows' token_begin / token_ahead / token_layer /
    token_end), played on the CPU: it records the order of the calls and the input each prediction read."""

    token_graph = True  # PipelinedDecodeRows': STRATA_TOKEN_GRAPH, by default where experts can miss

    def __init__(self, experts, k: int):
        super().__init__(experts, k)
        self.order: list[tuple[str, int]] = []

    def token_begin(self):
        self.order.append(("begin", -1))

    def token_ahead(self, layer):
        self.order.append(("ahead", layer))
        self.ahead_begin(layer)

    def token_layer(self, layer, x, ids, beside):
        self.order.append(("layer", layer))
        self.step(layer, x, ids, beside)

    def token_end(self):
        self.order.append(("end", -1))


def test_token_pieces_keep_the_bits_and_split_only_at_the_eager_attention_cores():
    """A backend that takes the token graphs: the token as runs of layers (one graph each on CUDA), an
    eager attention core between two runs. Every layer's copies ahead come after its input is there (after
    the core for an attention layer) and before its rows; the decode keeps the plain forward's bits."""
    eager, graphed, backend = _backed_models(_TokenRows)
    hp = graphed.hp
    graphs = graphed.decode_graphs
    assert graphs.token_graph and graphs._ahead and graphs.attn is None  # no capture: the eager cores
    assert graphs.describe() == "token graphs (a graph a run of layers), 2 experts copied ahead a layer"
    pieces = graphs._runners()
    attention = [layer for layer in range(hp.n_layer) if not hp.is_recurrent(layer)]
    assert attention and [p for p in pieces if isinstance(p, int)] == attention
    assert len(pieces) == 2 * len(attention) + 1  # runs of graphs and cores alternate
    _assert_same_decode(eager, graphed, ref.random_prompt(PROMPT, seed=4))
    layers = [(kind, layer) for layer in range(hp.n_layer) for kind in ("ahead", "layer")]
    one_token = [("begin", -1)] + layers
    assert backend.order == (one_token + [("end", -1)]) * STEPS
    for _, h_in, pred in backend.calls:
        assert h_in.abs().sum() > 0 and pred.shape == (1, hp.n_expert_used)


def test_token_pieces_split_every_n_layers_keep_the_bits(monkeypatch):
    """STRATA_TOKEN_GRAPH_LAYERS=1: a run ends after every layer as well (an attention layer: its first
    segment, the core, the rest), the calls keep their order and the decode its bits."""
    monkeypatch.setenv("STRATA_TOKEN_GRAPH_LAYERS", "1")
    eager, graphed, backend = _backed_models(_TokenRows)
    hp = graphed.hp
    pieces = graphed.decode_graphs._runners()
    attention = [layer for layer in range(hp.n_layer) if not hp.is_recurrent(layer)]
    assert [p for p in pieces if isinstance(p, int)] == attention
    assert len(pieces) == hp.n_layer + 2 * len(attention)  # a run a layer, two and a core an attention layer
    _assert_same_decode(eager, graphed, ref.random_prompt(PROMPT, seed=4))
    layers = [(kind, layer) for layer in range(hp.n_layer) for kind in ("ahead", "layer")]
    assert backend.order == ([("begin", -1)] + layers + [("end", -1)]) * STEPS


class _ResidentTokenRows(_TokenRows):
    """_TokenRows whose cache holds every expert (PipelinedDecodeRows.resident_graphs): every other token is
    a resident one, whose pieces run with resident_form on; it records the form each layer saw."""

    resident_graphs = True
    resident_form = False

    def __init__(self, experts, k: int):
        super().__init__(experts, k)
        self.tokens = 0
        self.forms: list[bool] = []

    def token_begin(self):
        super().token_begin()
        self.tokens += 1

    @property
    def resident_token(self):
        return self.tokens % 2 == 0

    def token_layer(self, layer, x, ids, beside):
        self.forms.append(self.resident_form)
        super().token_layer(layer, x, ids, beside)


def test_resident_tokens_run_the_resident_form_and_keep_the_bits():
    """A backend with a resident form (resident_graphs): a token it calls resident runs its pieces with
    resident_form on (captured on CUDA as a second set of token graphs), the others with it off; the
    form is off again after each token, and the decode keeps the plain forward's bits."""
    eager, graphed, backend = _backed_models(_ResidentTokenRows)
    hp = graphed.hp
    _assert_same_decode(eager, graphed, ref.random_prompt(PROMPT, seed=4))
    assert backend.tokens == STEPS and not backend.resident_form
    want = [token % 2 == 0 for token in range(1, STEPS + 1) for _ in range(hp.n_layer)]
    assert backend.forms == want


class _Chains:
    """A rows backend's tokens may overlap (PipelinedDecodeRows.can_chain); it counts its joins."""

    can_chain = True
    finished = 0

    def finish(self):
        self.finished += 1


class _ChainRows(_Chains, _TokenRows):
    """_TokenRows whose tokens may overlap, counting its joins."""


class _LayerChainRows(_Chains, _AheadRows):
    """A per-layer rows backend whose tokens may overlap, as PipelinedDecodeRows where every expert is
    resident (no worker: a layer's graph alone), counting its joins; it copies nothing ahead."""

    ahead = 0


def _chain_model(monkeypatch, chain: str, backend_cls=_ChainRows):
    monkeypatch.setenv("STRATA_DECODE_CHAIN", chain)
    return _backed_models(backend_cls)


@pytest.mark.parametrize("backend_cls", [_ChainRows, _LayerChainRows], ids=["token-graphs", "per-layer"])
def test_the_chained_greedy_decode_gives_the_step_by_step_tokens(monkeypatch, backend_cls):
    """The chained decode (STRATA_DECODE_CHAIN, on by default): each token launched before the one before
    it completes, its input the id the previous head chose on the device: the greedy ids of the plain
    forward, one join a token; stopped early, the token launched ahead is joined too and the state holds
    one position more. The same over the token graphs and over the per-layer segments (the all-resident
    decode's form), the attention cores eager between them."""
    from strata_ray.model.decode_graph import decode_chain

    eager, graphed, backend = _chain_model(monkeypatch, "1", backend_cls)
    graphs = graphed.decode_graphs
    assert graphs.chain and graphs.describe().endswith(", tokens chosen and chained on the device")
    assert graphs.token_graph == (backend_cls is _ChainRows) and graphs.attn is None
    prompt = ref.random_prompt(PROMPT, seed=4)
    want, _ = _decode(eager, prompt, STEPS)
    with torch.inference_mode():
        state = graphed.new_state()
        first = int(graphed.forward(prompt, state)[-1].argmax())
        got = [first, *decode_chain(graphs, first, state, STEPS - 1)]
        assert got == want and len(set(want)) > 2
        assert backend.finished == STEPS - 1 and state.pos == PROMPT + STEPS - 1 and not graphs._inflight
        state = graphed.new_state()
        first = int(graphed.forward(prompt, state)[-1].argmax())
        chain = decode_chain(graphs, first, state, STEPS - 1)
        early = [next(chain) for _ in range(3)]
        chain.close()
        assert [first, *early] == want[:4]
        assert state.pos == PROMPT + 4 and not graphs._inflight  # the 4th launch ran, its id dropped
        assert graphed.forward([want[4]], graphed.new_state()).shape[-1] == graphed.hp.n_vocab  # step works
        graphs.launch([want[4]], graphed.new_state(), advance=False)  # step()'s launch: no choice copied
        with pytest.raises(RuntimeError, match="after a launch that chose nothing"):
            graphs.complete_choice()
        assert not graphs._inflight


def test_generate_over_chained_graphs_keeps_its_tokens_stops_and_limits(monkeypatch):
    """engine.generate takes the chained loop for a greedy request: the same ids and
    finish reason as the plain forward, stopping at a stop id, at max_tokens (0 too) and at a full context."""
    from dataclasses import replace

    from strata_ray.engine.generate import generate

    eager, graphed, backend = _chain_model(monkeypatch, "1")
    prompt = ref.random_prompt(PROMPT, seed=4)
    want = generate(eager, prompt, STEPS)
    assert generate(graphed, prompt, STEPS).token_ids == want.token_ids and backend.finished == STEPS - 1
    stop = want.token_ids[5]
    first = want.token_ids.index(stop)
    got = generate(graphed, prompt, STEPS, stop_ids={stop})
    assert (got.token_ids, got.finish_reason) == (want.token_ids[:first], "stop")
    assert generate(graphed, prompt, 0).token_ids == [] and generate(eager, prompt, 0).token_ids == []
    for model in (eager, graphed):  # a context 3 tokens past the prompt: 4 tokens, the last never forwarded
        model.hp = replace(model.hp, context_length=PROMPT + 3)
    short = generate(eager, prompt, STEPS)
    assert generate(graphed, prompt, STEPS).token_ids == short.token_ids == want.token_ids[:4]


@pytest.mark.parametrize("params", [dict(temperature=1.0, seed=5), dict(temperature=0.8, top_k=20, seed=6),
                                    dict(temperature=1.3, top_p=0.9, min_p=0.01, seed=2**64 - 1)],
                         ids=["plain", "top-k", "top-p-min-p"])
def test_sampled_requests_chain_with_the_step_by_step_draws(monkeypatch, params):
    """A sampled request (temperature > 0) takes the chained loop too, each draw made on the device after
    its token's head: the ids of the plain forward's step-by-step draws with the same seed (a draw is a
    function of the logits, the seed and its number), one join a token; a stop id ends it the same way."""
    from strata_ray.engine.generate import generate
    from strata_ray.engine.sampling import SamplingParams

    eager, graphed, backend = _chain_model(monkeypatch, "1")
    prompt = ref.random_prompt(PROMPT, seed=4)
    sampling = SamplingParams(**params)
    want = generate(eager, prompt, STEPS, sampling=sampling)
    greedy = generate(eager, prompt, STEPS)
    assert want.token_ids != greedy.token_ids  # it really samples
    got = generate(graphed, prompt, STEPS, sampling=sampling)
    assert got.token_ids == want.token_ids and backend.finished == STEPS - 1
    stop = want.token_ids[4]
    got = generate(graphed, prompt, STEPS, sampling=sampling, stop_ids={stop})
    assert (got.token_ids, got.finish_reason) == (want.token_ids[: want.token_ids.index(stop)], "stop")


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.9, seed=3)], ids=["greedy", "sampled"])
def test_requests_for_logprobs_chain_with_the_step_by_step_values(monkeypatch, params):
    """A request for logprobs takes the chained loop too (each token's logits copied out beside its choice):
    the ids, top-k pairs and chosen logprobs of the plain forward's step-by-step loop, to the bit, one join a
    token; a stop ends it the same way (the stop's own logprobs not recorded)."""
    from strata_ray.engine.generate import generate
    from strata_ray.engine.sampling import SamplingParams

    eager, graphed, backend = _chain_model(monkeypatch, "1")
    prompt = ref.random_prompt(PROMPT, seed=4)
    sampling = SamplingParams(**params)
    want = generate(eager, prompt, STEPS, sampling=sampling, logprobs=3)
    got = generate(graphed, prompt, STEPS, sampling=sampling, logprobs=3)
    assert backend.finished == STEPS - 1 and len(got.top_logprobs) == len(got.token_logprobs) == STEPS
    assert (got.token_ids, got.top_logprobs, got.token_logprobs) == \
        (want.token_ids, want.top_logprobs, want.token_logprobs)
    if not params:  # greedy: each chosen id is its top one
        assert all(pairs[0][0] == tok for pairs, tok in zip(got.top_logprobs, got.token_ids, strict=True))
    stop = want.token_ids[4]
    cut = want.token_ids.index(stop)
    got = generate(graphed, prompt, STEPS, sampling=sampling, logprobs=2, stop_ids={stop})
    assert (got.token_ids, got.finish_reason) == (want.token_ids[:cut], "stop")
    assert got.token_logprobs == want.token_logprobs[:cut] and len(got.top_logprobs) == cut
    assert [pairs[:2] for pairs in want.top_logprobs[:cut]] == got.top_logprobs


def test_a_chained_choice_without_copied_logits_says_so(monkeypatch):
    _, graphed, _ = _chain_model(monkeypatch, "1")
    graphs = graphed.decode_graphs
    with torch.inference_mode():
        graphs.launch([3], graphed.new_state())
        with pytest.raises(RuntimeError, match="after a launch that copied no logits"):
            graphs.complete_choice(with_logits=True)
    assert not graphs._inflight


def test_without_the_chain_switch_there_is_no_chain(monkeypatch):
    """STRATA_DECODE_CHAIN=0: no chain (step() as before), and decode_chain refuses with one line."""
    from strata_ray.model.decode_graph import decode_chain

    _, graphed, _ = _chain_model(monkeypatch, "0")
    assert not graphed.decode_graphs.chain
    with pytest.raises(RuntimeError, match="needs chained decode graphs"):
        next(decode_chain(graphed.decode_graphs, 1, graphed.new_state(), 3))


def test_a_backend_without_token_graphs_keeps_the_segments():
    """A backend that does not take the token graphs (the host-planned DecodeRows, the CPU's) keeps the
    per-layer segments."""
    _, graphed, _ = _backed_models(_AheadRows)
    assert not graphed.decode_graphs.token_graph
    assert graphed.decode_graphs.describe() == "a graph or two a layer, 2 experts copied ahead a layer"
    segments, head = graphed.decode_graphs._runners()
    assert len(segments) == graphed.hp.n_layer and callable(head)
