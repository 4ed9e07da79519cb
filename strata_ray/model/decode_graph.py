"""One-token decode through CUDA graphs: the dense path of each layer replays as one or two graphs.

A decode step issues ~60 small torch ops per layer; launched one by one from Python they cost ~2 ms a layer
on the H200 host, more than the GPU needs for them. Here the dense work between two expert calls is
captured once into a graph and replayed per token (DESIGN section 8):

    layer l (GDN):        [combine l-1 | norm | gated delta net | residual | norm | router]
    layer l (attention):  [combine l-1 | norm | q k v | rope]  attention over the KV cache  [gate | out |
                          residual | norm | router]
    beside the mixer:     with a backend that copies experts ahead (STRATA_DECODE_PREFETCH): a GDN
                          layer's segment is two, [combine l-1 -> h_in] and the rest; once h_in is there
                          (after the first graph, or after an attention layer's first segment, which writes
                          it too) rows.ahead_begin(l) enqueues the backend's graphs that route h_in
                          (_predict) and copy the predicted misses, on streams of their own
    then:                 routed rows of layer l (the expert backend: tiers, CPU pool, host plan), and
                          [shared expert], which the backend enqueues beside its CPU rows (only layer l+1
                          reads it: in the pipelined decode it leaves the path the device waits on)
    last:                 [combine | output norm | logits]
    token graphs:         with a backend that takes them (PipelinedDecodeRows.token_graph) the graphs above
                          and the backend's per-layer work are captured as runs of layers, one graph each,
                          split at the eager attention cores (none with the device attention: one graph a
                          token) and, with STRATA_TOKEN_GRAPH_LAYERS=N, after every N-th layer; the backend
                          waits for its CPU rows inside (_token_pieces)

"combine l-1" is the previous layer's h + (routed + shared), the same ops as Model.forward, so the bits
are those of the eager forward. With STRATA_DECODE_DEVICE_ATTENTION=1 (the default in the token graphs only:
see __init__), captured on CUDA with the fused kernels, an attention layer is one graph too
(kernels/attention_decode.DeviceAttention): the new k, v are written into the sequence's cache and the
attention runs over it at the position held in a device cell, the caches' places read from a table the
host rewrites only when a cache moves (it grows by doubling) or another sequence decodes; the same split
kernels as the eager attention, so the same bits. By default, the attention core runs eagerly between the
two segments drawn above.
Everything a graph reads or writes between segments lives in buffers allocated here, outside the graphs,
so all graphs can share one memory pool.

The recurrent (GDN) states of the decoding sequence live in this object's buffers while it decodes: the
SequenceState's gdn entries point at them. A step for another sequence first gives the previous owner
its own copies, so interleaved sequences stay independent.

`capture=False` runs the same segments without graphs (any device): the CPU tests check the segmentation
there, bit for bit against Model.forward; `pytest -m gpu` checks the captured graphs on CUDA.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from strata_ray.kernels.attention_decode import DeviceAttention, attention_decode_supports
from strata_ray.kernels.fused_small import combine_fused, fused_enabled
from strata_ray.model import ops
from strata_ray.model.attention import attention_inputs, attention_output
from strata_ray.model.gdn import gdn_block
from strata_ray.model.graph_capture import capture_graph
from strata_ray.model.moe import combine_rows, route, shared_expert
from strata_ray.model.state import GDNState, SequenceState


def decode_chain(graphs: DecodeGraphs, tok: int, state: SequenceState, n: int,
                 choose: Callable[[Tensor, Tensor], None] | None = None,
                 logits: bool = False) -> Iterator[int] | Iterator[tuple[int, Tensor]]:
    """The chained decode: the next n token ids after `tok` (the token at state.pos), each chosen on the
    device from its logits: greedy (the first of the largest, as step() + argmax give them), or by
    choose(logits [V], out [1] int64) enqueued after each token's head (a seeded Sampler's choose_into:
    the draws sample() gives from the same logits). Launches one token ahead of the one it yields (never
    more than n launches); closing the generator early completes and drops the token launched ahead (the
    state then holds one position more than the ids yielded). logits: yield (id, the logits [V] it was
    chosen from, f32 on the host) instead, copied out beside the choice (a request for logprobs)."""
    if n <= 0:
        return
    if not graphs.chain:
        raise RuntimeError("decode_chain needs chained decode graphs (a rows backend that chains, "
                           "STRATA_DECODE_CHAIN on)")
    graphs.launch([tok], state, choose=choose, copy_logits=logits)
    launched = 1
    try:
        for _ in range(n):
            if launched < n:
                graphs.launch(None, state, choose=choose, copy_logits=logits)
                launched += 1
            yield graphs.complete_choice(with_logits=logits)
    finally:
        graphs.cancel()


def chain_enabled() -> bool:
    """STRATA_DECODE_CHAIN (env only; config.py refuses a bad value): the chained greedy decode (see
    DecodeGraphs.chain), on unless 0. On the H200 the device idled 0.4-1.5 ms between two tokens without it
    (timing events, sessions 23-24); with it the 8K decode on a 24 GiB card ran 104.7 tok/s against 87.1
    (medians of 4 pairs, session 24), and with every expert resident 236 against 200-218, the same ids."""
    return os.environ.get("STRATA_DECODE_CHAIN", "") != "0"


def token_graph_layers() -> int:
    """STRATA_TOKEN_GRAPH_LAYERS (env only; config.py refuses a bad value with its one line): the most layers
    one token graph holds, 0 (unset) for a whole run between two eager attention cores (with the device
    attention, the whole token). A graph with forks launches in host time that grows with its nodes, and
    the device starts it only once it is launched: shorter graphs let the device start the token's first
    layers while the host still launches the rest."""
    raw = os.environ.get("STRATA_TOKEN_GRAPH_LAYERS", "")
    return int(raw) if raw.isdigit() else 0


@dataclass
class _LayerBuffers:
    """Static tensors of one layer's segments (T = 1)."""

    h_in: Tensor  # [1, E] the layer's input (residual stream)
    h_mid: Tensor  # [1, E] after the mixer's residual add
    x: Tensor  # [1, E] normed input of the MoE
    ids: Tensor  # [1, K] int64 routed experts
    weights: Tensor  # [1, K] f32 renormalised router weights
    routed: Tensor  # [1, E] the expert backend's result (copied in, eager)
    shared: Tensor | None  # [1, E] shared expert output (qwen3next) or None
    gdn: GDNState | None  # recurrent layers: the decoding sequence's state
    q: Tensor | None = None  # attention layers: [1, H, D]
    k: Tensor | None = None  # [1, Hkv, D]
    v: Tensor | None = None  # [1, Hkv, D]
    gate: Tensor | None = None  # [1, H*D] (qwen3next) or None
    o: Tensor | None = None  # [1, H, D] attention result (copied in, eager)


class DecodeGraphs:
    """Replays Model.forward for one token at a time; call `step(ids, state)` where Model.forward would."""

    def __init__(self, model, capture: bool | None = None):
        self.model, self.hp, self.w = model, model.hp, model.weights
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"decode graphs need a CUDA device (the model is on {self.device})")
        hp, dev = self.hp, self.device
        E, K = hp.n_embd, hp.n_expert_used

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.tok = zeros(1, dtype=torch.int64)
        self.pos = zeros(1, dtype=torch.int64)
        self.logits = zeros(1, hp.n_vocab)
        self.hidden = zeros(1, E)
        self.layers: list[_LayerBuffers] = []
        for layer in range(hp.n_layer):
            has_shared = f"blk.{layer}.ffn_gate_shexp.weight" in self.w
            gdn = None
            if hp.is_recurrent(layer):
                s0 = model.new_state().gdn[layer]  # zero state of the right shapes
                gdn = GDNState(s0.S.clone(), s0.conv.clone())
            buf = _LayerBuffers(zeros(1, E), zeros(1, E), zeros(1, E), zeros(1, K, dtype=torch.int64),
                                zeros(1, K), zeros(1, E), zeros(1, E) if has_shared else None, gdn)
            if gdn is None:
                H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
                gated = self._attention_gated(layer)
                buf.q, buf.o = zeros(1, H, D), zeros(1, H, D)
                buf.k, buf.v = zeros(1, Hkv, D), zeros(1, Hkv, D)
                buf.gate = zeros(1, H * D) if gated else None
            self.layers.append(buf)
        attn_layers = [buf for buf in self.layers if buf.q is not None]
        # the token's rope tables [1, 1, n_rot], computed once in the first layer's segment for every
        # attention layer (the same ops as each layer computing them)
        self.rope = (zeros(1, 1, hp.n_rot), zeros(1, 1, hp.n_rot)) if attn_layers else None
        # an expert backend with a fixed-shape one-token step (TieredExperts): its rows are combined inside
        # the next segment's graph, and its GPU part replays as a graph of its own
        make_rows = getattr(model.experts, "decode_rows", None)
        self.rows = make_rows(E, K, self.capture) if make_rows is not None else None
        # the token graphs: with a backend that has the token forms and takes them (PipelinedDecodeRows'
        # token_graph: STRATA_TOKEN_GRAPH, on by default) each run of layers
        # between two eager attention cores is one graph, the worker's rows waited for inside
        # (kernels/flag_wait), so a token is a few launches instead of ~2 a layer (5 a staged layer with
        # copies ahead): on the H200 host each launch cost 20-60 us of host time in the real decode, and with
        # copies ahead the host set the pace (session 20). With the device attention, a token is one graph.
        # (Without capture the pieces run as plain calls: the CPU tests check the order and the bits.)
        self.token_graph = bool(getattr(self.rows, "token_graph", False))
        # STRATA_DECODE_DEVICE_ATTENTION (env only; default: on in the token graphs), captured on CUDA with
        # the fused kernels: an attention layer is one graph like a GDN layer, the new k, v written into the
        # sequence's cache and the attention over it at the position in self.pos, the caches' places read
        # from kv_table (the host rewrites a layer's row when its cache moves). On the H200 (session 12) it
        # gave the eager attention's bits but an all-resident 8K decode 113 tok/s against 140: the device sat
        # idle between graphs ~0.9 ms a token more (not the kernels: their times matched); in the token
        # graphs, where it makes the token one graph, the budget decode ran 79.0-80.6 -> 87.0 (session 20).
        attn_env = os.environ.get("STRATA_DECODE_DEVICE_ATTENTION", "")
        self.attn: DeviceAttention | None = None
        if (self.capture and attn_layers and hp.context_length > 0 and fused_enabled(attn_layers[0].q, 1)
                and attention_decode_supports(attn_layers[0].q, attn_layers[0].k)
                and (attn_env == "1" or (attn_env == "" and self.token_graph))):
            self.attn = DeviceAttention(hp.n_head, hp.n_head_kv, hp.head_dim, hp.context_length, dev)
            self.kv_table = zeros(hp.n_layer, 2, dtype=torch.int64)  # [L, 2] DeviceAttention.table_row
            self._kv_at: list[tuple[int, int] | None] = [None] * hp.n_layer  # what kv_table holds, host side
            # the capture's warm-up runs the kernels: a one-token cache of its own
            self._kv_warmup = zeros(2, 1, hp.n_head_kv, hp.head_dim)  # [K | V, 1, Hkv, D]
        # a backend that copies experts ahead of the routing (PipelinedDecodeRows with STRATA_DECODE_PREFETCH)
        # gets each layer's routing predicted from the layer's input (_predict: the MoE's norm and router over
        # the residual before the mixer, into these buffers, in the backend's own graphs), and the call
        # ahead_begin(layer) once that input is in h_in: a layer's first segment ends there
        self._ahead = getattr(self.rows, "ahead", 0) > 0
        self._pred = (zeros(1, E), zeros(1, K, dtype=torch.int64), zeros(1, K))  # x, ids, weights
        self._segments = self._build_segments()  # per layer: (before attention, after attention); last
        # the backend's picks a layer early (STRATA_AHEAD_LAYER=next) need a token to be one graph: a pick's
        # fork joins inside its piece, and layer l + 1's is forked in layer l's
        if self._ahead and getattr(self.rows, "ahead_next", False):
            one_graph = (self.token_graph and not token_graph_layers()
                         and all(seg[1] is None for seg in self._segments[0]))
            self.rows.set_ahead_next(one_graph)
        self._ahead_next = self._ahead and getattr(self.rows, "ahead_next", False)
        self._owner: weakref.ref | None = None
        self._graphs: list | None = None
        self._resident_pieces: list | None = None  # the resident tokens' token graphs (_capture_resident)
        # the chained decode (STRATA_DECODE_CHAIN, on unless 0; greedy): launch() of token N+1 before
        # complete() of token N, its input the token N's head chose on the device (argmax of its logits into
        # self.tok), so the device never waits for the host between two tokens (session 23: it idled 0.8-1.3
        # ms a token).
        # Needs a rows backend whose tokens may overlap (PipelinedDecodeRows.can_chain: the token graphs, or
        # every expert resident, where a layer's graph alone serves it). An eager attention core between
        # graphs is enqueued like them (its KV rows appended on the device, the position known on the host).
        # The launched tokens wait in _inflight for complete(), each with its logits, its choice copied to
        # page-locked memory and an event after that copy
        self.chain = chain_enabled() and bool(getattr(self.rows, "can_chain", False))
        pin = self.device.type == "cuda"
        self._choices = [torch.zeros(1, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._logits_out: list[Tensor] = []  # [V] f32 page-locked, two, once a chained launch copies logits
        self._inflight: deque = deque()
        self._launched = 0

    def _attention_gated(self, layer: int) -> bool:
        """qwen3next attention projects q and the output gate together (twice the q rows)."""
        hp, w, p = self.hp, self.w, f"blk.{layer}"
        q = w[f"{p}.attn_q.weight"] if f"{p}.attn_q.weight" in w else None
        if q is None:
            kv_dim = hp.n_head_kv * hp.head_dim
            return w[f"{p}.attn_qkv.weight"].shape[0] - 2 * kv_dim == 2 * hp.n_head * hp.head_dim
        return q.shape[0] == 2 * hp.n_head * hp.head_dim

    # -- the segments (plain functions over the buffers; captured on CUDA) --------------------------------
    def _layer_input(self, layer: int, out: Tensor | None = None) -> Tensor:
        """h entering `layer`: the token's embedding, or the previous layer's h + (routed + shared); into
        `out` [1, E] when given (the fused combine writes it there: no copy after)."""
        if layer == 0:
            if self.rope is not None:
                for buf, table in zip(self.rope, ops.rope_tables(self.pos, self.hp.n_rot,
                                                                 self.hp.rope_freq_base), strict=True):
                    buf.copy_(table)
            h = ops.embedding(self.tok, self.w["token_embd.weight"])  # [1, E]
            return h if out is None else out.copy_(h)
        prev = self.layers[layer - 1]
        routed = prev.routed
        if self.rows is not None:  # [K, E] rows of the previous layer -> [1, E], in k order
            K = self.hp.n_expert_used
            if fused_enabled(prev.h_mid, 1):  # one launch instead of ~2K + 4 (gather, combine), the same bits
                gpu, cpu, hit, inv = self.rows.parts()
                # a resident token's graphs (resident_form) read the device's rows alone: every entry a hit
                gather = None if self._resident_form() else (cpu, hit.view(1, K), inv.view(1, K))
                return combine_fused(prev.h_mid, gpu.view(1, K, -1), prev.weights, prev.shared, gather=gather,
                                     out=out)
            routed = combine_rows(self.rows.rows().view(1, K, -1), prev.weights)
        moe = routed if prev.shared is None else routed + prev.shared
        return torch.add(prev.h_mid, moe, out=out)

    def _resident_form(self) -> bool:
        """Whether the token being captured or run is the rows backend's resident form (resident_graphs)."""
        return bool(getattr(self.rows, "resident_form", False))

    def _moe_inputs(self, layer: int, h: Tensor, mixer_out: Tensor) -> None:
        """The mixer's residual h + mixer_out, then the MoE's normed input and routing, written straight into
        the buffers (the kernels take them as outputs: no copies in the graphs)."""
        hp, w, buf = self.hp, self.w, self.layers[layer]
        ops.add_rms_norm(h, mixer_out, w[f"blk.{layer}.{self.model.ffn_norm}.weight"], hp.rms_eps,
                         out=(buf.h_mid, buf.x))
        route(w[f"blk.{layer}.ffn_gate_inp.weight"], buf.x, hp.n_expert_used, out=(buf.ids, buf.weights))

    def _predict(self, layer: int, h: Tensor) -> Tensor:
        """The layer's routing from its input h [1, E] instead of its mixer's output: ids [1, K] in rank order
        (only where to copy experts ahead: the layer's real routing follows the mixer as always)."""
        hp, w = self.hp, self.w
        x, ids, weights = self._pred
        ops.rms_norm(h, w[f"blk.{layer}.{self.model.ffn_norm}.weight"], hp.rms_eps, out=x)
        route(w[f"blk.{layer}.ffn_gate_inp.weight"], x, hp.n_expert_used, out=(ids, weights))
        return ids

    def _shared(self, layer: int) -> None:
        """The shared expert of the layer's MoE input into its buffer: a segment of its own, because only the
        next layer reads it (the expert backend enqueues it beside its CPU rows: `step`)."""
        buf = self.layers[layer]
        shared_expert(self.w, layer, buf.x, out=buf.shared)

    def _split(self, layer: int, body: Callable[[Tensor], None], shared: Callable | None) -> tuple:
        """A layer of one segment, body(h) after the combine: whole, or (with copies ahead) its input into
        h_in as a segment of its own, then the body over h_in (the copies start between the two)."""
        if not self._ahead:
            return (lambda: body(self._layer_input(layer))), None, shared, None
        h_in = self.layers[layer].h_in

        def head():
            self._layer_input(layer, out=h_in)

        return head, None, shared, (lambda: body(h_in))

    def _build_segments(self) -> tuple[list[tuple], Callable]:
        """Per layer (first segment, after attention or None, shared expert or None, the rest of the first
        segment or None: see _split); the head. The eager attention core runs between the first two."""
        hp, w = self.hp, self.w
        segments = []
        for layer, buf in enumerate(self.layers):
            norm = w[f"blk.{layer}.attn_norm.weight"]
            shared = None if buf.shared is None else (lambda layer=layer: self._shared(layer))
            if buf.gdn is not None:
                def gdn_body(h, layer=layer, buf=buf, norm=norm):
                    x = ops.rms_norm(h, norm, hp.rms_eps)
                    # one token: pos0 picks no other form; the state updated in its buffers
                    out, _ = gdn_block(hp, w, layer, x, buf.gdn, 0, state_out=buf.gdn)
                    self._moe_inputs(layer, h, out)

                segments.append(self._split(layer, gdn_body, shared))
                continue

            if self.attn is not None:
                def attn_body(h, layer=layer, norm=norm):
                    x = ops.rms_norm(h, norm, hp.rms_eps)
                    q, k, v, gate = attention_inputs(hp, w, layer, x, self.pos, self.rope)
                    table = self.kv_table[layer]
                    self.attn.append(table, self.pos, k, v)
                    o = self.attn(q, table, self.pos, hp.head_dim**-0.5)  # [1, H, D]
                    self._moe_inputs(layer, h, attention_output(w, layer, o, gate))

                segments.append(self._split(layer, attn_body, shared))
                continue

            def attn_in(layer=layer, buf=buf, norm=norm):
                h = self._layer_input(layer, out=buf.h_in)  # the input the copies ahead predict from, too
                x = ops.rms_norm(h, norm, hp.rms_eps)
                q, k, v, gate = attention_inputs(hp, w, layer, x, self.pos, self.rope)
                buf.q.copy_(q)
                buf.k.copy_(k)
                buf.v.copy_(v)
                if gate is not None:
                    buf.gate.copy_(gate)

            def attn_out(layer=layer, buf=buf):
                self._moe_inputs(layer, buf.h_in, attention_output(w, layer, buf.o, buf.gate))

            segments.append((attn_in, attn_out, shared, None))

        def head():
            hidden = ops.rms_norm(self._layer_input(hp.n_layer), w["output_norm.weight"], hp.rms_eps)
            self.hidden.copy_(hidden)
            self.logits.copy_(ops.linear(hidden, w.get("output.weight", w["token_embd.weight"])))
            if self.chain:  # the next token's input, chosen here (greedy: the first of the largest logits)
                self.tok.copy_(torch.argmax(self.logits, dim=-1))

        return segments, head

    # -- capture ------------------------------------------------------------------------------------------
    def _runners(self) -> tuple[list[tuple[Callable, Callable | None]], Callable] | list:
        """The segments as callables: the functions themselves, or their graphs' replay (captured once);
        in the token mode the pieces of _capture_token."""
        segments, head = self._segments
        if not self.capture:
            if self.token_graph:
                return [p if isinstance(p, int) else (lambda p=p: [fn() for fn in p])
                        for p in self._token_pieces(segments, head)]
            return segments, head
        if self._graphs is None:
            self._graphs = self._capture(segments, head)
        return self._graphs

    def describe(self) -> str:
        """The decode's form in a few words, for the load log and the benchmarks."""
        if self.token_graph:
            pieces = "one graph a token" if self.attn is not None else "a graph a run of layers"
            form = f"token graphs ({pieces})"
        else:
            form = "a graph or two a layer" + (", device attention" if self.attn is not None else "")
        ahead = getattr(self.rows, "ahead", 0)
        early = " (picked a layer early)" if self._ahead_next else ""
        warm = ", the CPU's predicted rows read ahead" if getattr(self.rows, "warm", False) else ""
        chain = ", tokens chosen and chained on the device" if self.chain else ""
        return form + (f", {ahead} experts copied ahead a layer{early}" if ahead else "") + warm + chain

    def capture_now(self) -> None:
        """Capture the graphs now (otherwise the first step does); nothing to do without capture."""
        self._runners()

    def _capture(self, segments, head):
        """Warm every segment up on a side stream (lazy cuBLAS/Triton init), then capture each into a graph
        sharing one memory pool. Runs before a sequence's state is copied in: the buffers it scribbles on
        are overwritten by the adoption that follows."""
        flat = [f for fns in segments for f in fns if f is not None] + [head]
        if self.attn is not None:  # position 0 of the warm-up cache until the first step points at its own
            self.pos.zero_()
            row = self.attn.table_row(self._kv_warmup[0], self._kv_warmup[1])
            self.kv_table[:, 0].fill_(row[0])
            self.kv_table[:, 1].fill_(row[1])
            self._kv_at = [None] * len(self.layers)
        self._warm(flat)
        # layer l's routing predicted from its own input, or (a layer early) from layer l - 1's
        src = [layer - 1 if self._ahead_next and layer else layer for layer in range(len(self.layers))]
        predicts = [lambda layer=layer, buf=self.layers[src[layer]]: self._predict(layer, buf.h_in)
                    for layer in range(len(self.layers))] if self._ahead else None
        if self.rows is not None and self.rows.capture_all([buf.x for buf in self.layers],
                                                           [buf.ids for buf in self.layers],
                                                           besides=[fns[2] for fns in segments],
                                                           predicts=predicts, graphs=not self.token_graph):
            if self.token_graph:
                pieces = self._capture_token(segments, head)
                if getattr(self.rows, "resident_graphs", False):  # and the resident tokens' set
                    self._resident_pieces = self._capture_resident(segments, head)
                return pieces
            # the backend took each shared expert into its layer's graph (beside the rows)
            segments = [(a, b, None, t) for a, b, _, t in segments]
            flat = [f for fns in segments for f in fns if f is not None] + [head]
        pool = torch.cuda.graph_pool_handle()
        graphs = {}
        for fn in flat:
            g = torch.cuda.CUDAGraph()
            with capture_graph(g, pool):
                fn()
            graphs[fn] = g.replay
        return [tuple(graphs[f] if f is not None else None for f in fns) for fns in segments], graphs[head]

    def _token_pieces(self, segments, head) -> list:
        """The token as pieces: a tuple of functions (one graph), or a layer index (its eager attention
        core, between two graphs). Per layer: its first segment, the copies ahead once its input is there
        (after the eager core for an attention layer: a fork must join inside its graph), the rest, the
        backend's rows with the shared expert beside them; then the head. With STRATA_TOKEN_GRAPH_LAYERS=N
        a run also ends after every N-th layer (every fork of a layer joins inside it)."""
        pieces: list = []
        run: list[Callable] = []
        every = token_graph_layers()
        for layer, (before, after, shared, rest) in enumerate(segments):
            if every and layer and layer % every == 0 and run:
                pieces.append(tuple(run))
                run = []
            buf = self.layers[layer]
            run.append(before)
            if after is not None:
                pieces += [tuple(run), layer]
                run = []
            if self._ahead and not self._ahead_next:
                run.append(lambda layer=layer: self.rows.token_ahead(layer))
            elif self._ahead:  # a layer early: layer l + 1's pick from layer l's input (and layer 0's own)
                for ahead in ([0] if layer == 0 else []) + ([layer + 1] if layer + 1 < len(segments) else []):
                    run.append(lambda ahead=ahead: self.rows.token_ahead(ahead))
            run += [f for f in (after, rest) if f is not None]
            run.append(lambda layer=layer, buf=buf, shared=shared:
                       self.rows.token_layer(layer, buf.x, buf.ids, shared))
        return pieces + [(*run, head)]

    def _capture_token(self, segments, head) -> list:
        """_token_pieces with each tuple captured as one graph (one memory pool: they replay in order)."""
        pool = torch.cuda.graph_pool_handle()
        out: list = []
        for piece in self._token_pieces(segments, head):
            if isinstance(piece, int):
                out.append(piece)
                continue
            g = torch.cuda.CUDAGraph()
            with capture_graph(g, pool):
                for fn in piece:
                    fn()
            out.append(g.replay)
        return out

    def _warm(self, fns: list[Callable[[], object]]) -> None:
        """Run fns once on a side stream (lazy cuBLAS / Triton init and compiles: none inside a capture), the
        current stream waiting for them."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def _capture_resident(self, segments, head) -> list:
        """The token graphs again with the rows backend's resident_form on (no flag waits, the combine over
        the device's rows alone), for the tokens whose every expert is resident; the one new kernel form (the
        combine without its gather) warmed up first on a side stream, as _capture warms the others."""
        self.rows.resident_form = True
        try:
            # one combine of each form the layers take (with and without a shared expert)
            forms = {self.layers[layer - 1].shared is None: layer for layer in range(1, self.hp.n_layer + 1)}
            self._warm([lambda layer=layer: self._layer_input(layer, out=self.hidden)
                        for layer in forms.values()])
            return self._capture_token(segments, head)
        finally:
            self.rows.resident_form = False

    # -- the step -----------------------------------------------------------------------------------------
    def _adopt(self, state: SequenceState) -> None:
        """Make the GDN buffers hold `state`'s recurrent state (and `state` point at them)."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not state:
            for layer, buf in enumerate(self.layers):  # the previous owner keeps its own copies
                st = owner.gdn.get(layer)
                if st is not None and st.S is buf.gdn.S:
                    owner.gdn[layer] = buf.gdn.clone()
        for layer, buf in enumerate(self.layers):
            st = state.gdn.get(layer)
            if buf.gdn is None or st is None or st.S is buf.gdn.S:
                continue
            buf.gdn.S.copy_(st.S)
            buf.gdn.conv.copy_(st.conv)
            state.gdn[layer] = GDNState(buf.gdn.S, buf.gdn.conv)
        self._owner = weakref.ref(state)

    def _reserve_kv(self, state: SequenceState, need: int) -> None:
        """Room for `need` tokens in every attention layer's cache, and kv_table pointing at the caches."""
        if need > self.attn.max_keys:
            raise ValueError(f"decode position {need - 1} is past the model's context ({self.attn.max_keys})")
        for layer, buf in enumerate(self.layers):
            if buf.q is None:
                continue
            kv = state.kv[layer]
            at = kv.reserve(need, buf.k)
            if at != self._kv_at[layer]:  # a new sequence, or its cache grew: a kernel argument, no copy
                keys, values = kv.buffers()
                if keys.dtype != torch.float32 or keys.shape[1:] != buf.k.shape[1:]:
                    raise ValueError(f"layer {layer}'s KV cache is {keys.dtype} {list(keys.shape[1:])}; the "
                                     f"decode graphs write float32 {list(buf.k.shape[1:])}")
                row = self.attn.table_row(keys, values)
                self.kv_table[layer, 0].fill_(row[0])
                self.kv_table[layer, 1].fill_(row[1])
                self._kv_at[layer] = at

    def _attention_core(self, layer: int, state: SequenceState, pos0: int) -> None:
        """An attention layer's core over its growing KV cache, eager (its shapes change every token)."""
        buf = self.layers[layer]
        k_all, v_all = state.kv[layer].append(buf.k, buf.v)
        buf.o.copy_(ops.attention(buf.q, k_all, v_all, pos0, self.hp.head_dim**-0.5))

    def step(self, ids: Tensor | Sequence[int], state: SequenceState,
             return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """One token (ids of length 1) at position state.pos -> logits [1, V] (and hidden [1, E]), exactly
        as Model.forward computes them."""
        if self._inflight:
            raise RuntimeError("decode graphs: a chained token is still in flight (complete() it first)")
        self.launch(ids, state, return_hidden=return_hidden, advance=False)
        return self.complete()

    def launch(self, ids: Tensor | Sequence[int] | None, state: SequenceState, *, return_hidden: bool = False,
               advance: bool = True, choose: Callable[[Tensor, Tensor], None] | None = None,
               copy_logits: bool = False) -> None:
        """Enqueue one token at state.pos; complete() returns its logits, in launch order. ids None (the
        chained decode): the token the previous launch chose on the device. advance (a chained launch): the
        state moves on now, so that the next launch may follow before this one completes, and the choice is
        copied out for complete_choice(); else (step()) the state moves in complete(). The choice is the
        head's arg-max, or what choose(logits [V], self.tok) writes over it (enqueued after the head).
        copy_logits (a chained launch): its logits are copied out beside the choice as well, for
        complete_choice(with_logits=True), without a wait for the tokens launched after it."""
        if ids is None and not (self.chain and self._launched):
            raise RuntimeError("decode graphs: a launch without ids follows a chained launch")
        runners = self._runners()  # the token mode's pieces (_capture_token), or (segments, head)
        pieces, (segments, head) = (runners, ((), None)) if self.token_graph else ((), runners)
        self._adopt(state)
        if isinstance(ids, Tensor):
            self.tok.copy_(ids.reshape(1))
        elif ids is not None:
            self.tok.fill_(int(ids[0]))  # a kernel argument: no host-to-device copy
        pos0 = state.pos
        self.pos.fill_(pos0)
        experts = self.model.experts
        if self.attn is not None:
            self._reserve_kv(state, pos0 + 1)
        try:
            if self.token_graph:  # graphs of many layers, the eager attention cores between them
                self.rows.token_begin()
                resident = getattr(self.rows, "resident_graphs", False) and self.rows.resident_token
                if resident and self.capture:
                    pieces = self._resident_pieces
                self.rows.resident_form = resident  # uncaptured, the pieces read it as they run
                try:
                    for piece in pieces:
                        if isinstance(piece, int):
                            self._attention_core(piece, state, pos0)
                        else:
                            piece()
                finally:
                    self.rows.resident_form = False
                self.rows.token_end()
            for layer, (before, after, shared, rest) in enumerate(segments):
                buf = self.layers[layer]
                before()
                if self._ahead:  # the layer's input is in h_in: its copies ahead start beside the rest
                    self.rows.ahead_begin(layer)
                if after is not None:  # the attention core over the growing KV cache, eager
                    self._attention_core(layer, state, pos0)
                    after()
                if rest is not None:
                    rest()
                if self.rows is not None:  # the shared expert beside the CPU rows: off the critical path
                    self.rows.step(layer, buf.x, buf.ids, beside=shared)
                else:
                    buf.routed.copy_(experts(layer, buf.x, buf.ids, buf.weights))
                    if shared is not None:
                        shared()
            if not self.token_graph:
                head()
            if choose is not None:  # a sampled chain: the draw overwrites the head's arg-max
                choose(self.logits[0], self.tok)
        except BaseException:
            abort = getattr(self.rows, "abort", None)  # a worker waiting on this token's flags
            if abort is not None:
                abort()
            raise
        self._launched += 1
        # this token's outputs, copied in stream order before the next launch's graphs overwrite them
        logits = self.logits.clone()
        hidden = self.hidden.clone() if return_hidden else None
        choice, done, logits_out = None, None, None
        if self.chain and advance:  # a chained launch: its head's choice for complete_choice()
            choice = self._choices[self._launched % 2]
            choice.copy_(self.tok, non_blocking=True)
            if copy_logits:  # two buffers, as the choices: at most one launch ahead of complete_choice()
                if not self._logits_out:
                    pin = self.device.type == "cuda"
                    self._logits_out = [torch.empty(self.hp.n_vocab, pin_memory=pin) for _ in range(2)]
                logits_out = self._logits_out[self._launched % 2]
                logits_out.copy_(self.logits[0], non_blocking=True)
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        self._inflight.append((state, pos0, not advance, logits, hidden, choice, done, logits_out))
        if advance:
            self._advance(state, pos0)

    def _advance(self, state: SequenceState, pos0: int) -> None:
        if self.attn is not None:  # the graphs wrote this token's k, v rows
            for layer, buf in enumerate(self.layers):
                if buf.q is not None:
                    state.kv[layer].advance(1)
        state.pos = pos0 + 1

    def complete(self) -> Tensor | tuple[Tensor, Tensor]:
        """The oldest launched token: its rows joined (a worker's error is raised here), its state advanced
        where launch() left that for now; its logits [1, V] (and hidden [1, E] where asked)."""
        logits, hidden, _, _ = self._complete()
        return (logits, hidden) if hidden is not None else logits

    def complete_choice(self, with_logits: bool = False) -> int | tuple[int, Tensor]:
        """The chained decode: complete() the oldest token and return the id its head chose, read from
        page-locked memory (no wait for the tokens launched after it); with_logits, (id, its logits [V] f32
        on the host: a copy of what its launch with copy_logits copied out)."""
        _, _, choice, logits_out = self._complete()
        if choice is None:
            raise RuntimeError("decode graphs: complete_choice() after a launch that chose nothing")
        if not with_logits:
            return int(choice[0])
        if logits_out is None:
            raise RuntimeError("decode graphs: complete_choice(with_logits=True) after a launch that copied "
                               "no logits")
        return int(choice[0]), logits_out.clone()

    def _complete(self) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        state, pos0, later, logits, hidden, choice, done, logits_out = self._inflight.popleft()
        if self.rows is not None:  # the token's last CPU rows: joined (errors raised) before it counts
            self.rows.finish()
        if later:
            self._advance(state, pos0)
        if done is not None:
            done.synchronize()
        return logits, hidden, choice, logits_out

    def cancel(self) -> None:
        """Drop the launched tokens not yet completed (after a stop id): their work still runs, their rows
        are joined; the state keeps their positions (a chained decode's state is not reused after it)."""
        while self._inflight:
            self._complete()
