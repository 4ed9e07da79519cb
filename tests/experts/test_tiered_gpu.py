"""Expert tiers on CUDA (run on the GPU machine with -m gpu): greedy tokens identical for three cache
sizes (plus adaptive rounds) and equal to the all-CPU-pool placement; backend rows on CUDA bit-identical
to the CPU primary's."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from strata_ray.config import EngineConfig
from strata_ray.experts.build import load_tiered_model
from tests.experts.decoding import generate_and_check_prompt_counts, greedy_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = list(range(3, 27))  # 24 tokens: a prompt chunk (> 8) streams misses through the ring slots
DECODE = 10


def greedy(loaded):
    model = loaded.model
    with torch.inference_mode():
        state = model.new_state()
        logits = model.forward(PROMPT, state)
        out = []
        for _ in range(DECODE):
            out.append(int(logits[-1].argmax()))
            logits = model.forward([out[-1]], state)
    return out


def test_greedy_tokens_identical_across_cache_sizes_on_cuda(tiny_next_q4):
    base = EngineConfig(model=tiny_next_q4, device="cuda")
    runs = {
        "cpu pool only": replace(base, expert_cache=0),
        "third cached": replace(base, expert_cache=10, adapt_every=0),
        "third cached, adaptive": replace(base, expert_cache=10, adapt_every=1, adapt_swaps=8),
        "all cached": replace(base, expert_cache=32),
    }
    tokens, swaps = {}, {}
    for name, cfg in runs.items():
        loaded, tiers = load_tiered_model(cfg, "cuda", progress=False)
        tokens[name] = greedy(loaded)
        tiers.finish()
        swaps[name] = tiers.metrics.counts.swaps
        assert tiers.cache.is_cuda
    assert swaps["third cached, adaptive"] > 0
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens


@pytest.mark.parametrize("n_tok", [1, 5, 24])
@pytest.mark.parametrize("copies", ["staged", "ring overlap", "pinned store", "pinned, overlap",
                                    "pinned, overlap, per-part copies", "pinned, overlap, stream all",
                                    "overlap, stream all", "pinned, overlap, stream all, whole halves"])
def test_backend_rows_on_cuda_equal_the_cpu_primary_bit_for_bit(tiny_next_q4, n_tok, copies, monkeypatch):
    """24 tokens stream the misses through the ring: from staging buffers on the compute stream, in two
    halves on the ring stream (STRATA_RING_OVERLAP), or straight from a page-locked store (one gather
    kernel a batch, or with STRATA_GATHER_COPY=0 three copies a pair). "stream all": a chunk this size
    streams every non-resident expert (as 1024+ tokens do) through a 4-slot ring, several batches a layer,
    and each layer copies the next one's first batch ahead; "whole halves": the default ring, a layer's
    stream in one half, so each layer also copies the layer after next into the half it just read."""
    import strata_ray.experts.tiered as tiered_module

    if "per-part" in copies:
        monkeypatch.setenv("STRATA_GATHER_COPY", "0")
    if "stream all" in copies:
        monkeypatch.setattr(tiered_module, "STREAM_ALL_TOKENS", 16)
        if "whole halves" not in copies:
            monkeypatch.setenv("STRATA_RING_SLOTS", "4")
    cfg = EngineConfig(model=tiny_next_q4, device="cuda", expert_cache=12,
                       ring_overlap="overlap" in copies, arena_pin_gib=1.0 if "pinned" in copies else 0.0)
    _, gpu = load_tiered_model(cfg, "cuda", progress=False)
    assert (gpu.store.pinned_bytes > 0) == ("pinned" in copies)
    _, cpu = load_tiered_model(
        EngineConfig(model=tiny_next_q4, device="cpu", expert_cache=0), "cpu", progress=False
    )
    hp = gpu.store.hp
    g = torch.Generator().manual_seed(n_tok)
    x = torch.randn(n_tok, hp.n_embd, generator=g)
    ids = torch.stack([torch.randperm(hp.n_expert, generator=g)[: hp.n_expert_used] for _ in range(n_tok)])
    w = torch.softmax(torch.randn(n_tok, hp.n_expert_used, generator=g), -1)
    for layer in range(hp.n_layer + hp.n_nextn):  # the MTP layer too (never resident)
        got = gpu(layer, x.cuda(), ids.cuda(), w.cuda()).cpu()
        want = cpu(layer, x, ids, w)
        assert np.array_equal(got.numpy(), want.numpy()), f"layer {layer}"
    if "stream all" in copies and n_tok >= 16:
        assert gpu.prefetches_used >= hp.n_layer - 1  # every trunk layer after the first found its batch
        assert (gpu.deep_prefetches >= hp.n_layer - 2) == ("whole halves" in copies)


@pytest.mark.parametrize("mode", ["sync", "cpu_thread", "pipeline", "pipeline-pcie", "pipeline-ahead",
                                  "pipeline-pcie-ahead", "pipeline-token", "pipeline-pcie-ahead-token",
                                  "pipeline-ahead-token-device-attention", "pipeline-defaults",
                                  "pipeline-pcie-ahead-token-device-attention-warm",
                                  "pipeline-pcie-ahead-token-device-attention-split",
                                  "pipeline-pcie-ahead-token-device-attention-next",
                                  "pipeline-ahead-token-device-attention-next",
                                  "pipeline-pcie-ahead-token-device-attention-split-next"])
@pytest.mark.parametrize("cache", [0, 10, 32])
def test_decode_graphs_give_the_eager_bits_on_cuda(tiny_next_q4, cache, mode, monkeypatch):
    """Captured decode (dense segments + the tiers' per-layer graphs) == the op-by-op forward, bit for bit;
    cpu_thread: the CPU rows from the helper thread behind the host flag (STRATA_DECODE_CPU_THREAD);
    pipeline: the whole token enqueued, a numba worker behind two flags (STRATA_DECODE_PIPELINE);
    pipeline-pcie: with 60% of each layer's misses read by the GPU from the page-locked store over PCIe
    (STRATA_PCIE_SHARE; the eager forward has no such tier: its CPU entries are the two tiers' sum);
    ahead: experts copied ahead of the routing from its prediction beside the mixer (STRATA_DECODE_PREFETCH:
    2 alone, 3 with the share); token: runs of layers as one graph, the worker's rows waited for inside
    (STRATA_TOKEN_GRAPH; with the device attention the whole token is one graph); defaults: the engine's
    (token graphs, the device attention; where experts can miss 2 copied ahead, a 40% share); warm: the
    worker reads each layer's predicted CPU rows ahead (STRATA_DECODE_WARM); split: the token as graphs of
    at most 2 layers (STRATA_TOKEN_GRAPH_LAYERS); next: each layer's copies picked from the input of the
    layer before (STRATA_AHEAD_LAYER=next; a token of several graphs keeps the same layer's pick)."""
    pcie = 600 if "pcie" in mode else 0
    ahead = (3 if pcie else 2) if "ahead" in mode else 0
    token = "token" in mode
    if mode == "pipeline-defaults":
        pcie, ahead, token = EngineConfig.pcie_share, 2, True
        monkeypatch.delenv("STRATA_TOKEN_GRAPH", raising=False)
        monkeypatch.delenv("STRATA_DECODE_DEVICE_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("STRATA_TOKEN_GRAPH", "1" if token else "0")  # else on where experts miss
        monkeypatch.setenv("STRATA_DECODE_DEVICE_ATTENTION", "1" if "device-attention" in mode else "0")
    monkeypatch.setenv("STRATA_DECODE_WARM", "1" if "warm" in mode else "0")
    monkeypatch.setenv("STRATA_TOKEN_GRAPH_LAYERS", "2" if "split" in mode else "0")
    if mode == "pipeline-defaults":
        monkeypatch.delenv("STRATA_AHEAD_LAYER", raising=False)  # the default: next
    else:
        monkeypatch.setenv("STRATA_AHEAD_LAYER", "next" if "next" in mode else "same")
    base = EngineConfig(model=tiny_next_q4, device="cuda", expert_cache=cache, adapt_every=1, adapt_swaps=8,
                        decode_cpu_thread=mode == "cpu_thread", decode_pipeline=mode.startswith("pipeline"),
                        pcie_share=pcie, decode_prefetch=None if mode == "pipeline-defaults" else ahead)
    got = {}
    for graphs in (True, False):
        loaded, tiers = load_tiered_model(replace(base, decode_graphs=graphs), "cuda", progress=False)
        if pcie is None:  # the defaults: the share this host's memory rate gives (experts/pcie_share),
            pcie = tiers.pcie_share  # measured only where the cache misses
            assert (tiers.host_gbs is not None) == (cache < 32) and pcie % 50 == 0
            assert cache < 32 or pcie == 0
        assert (loaded.model.decode_graphs is not None) == graphs
        if graphs:
            graphs_of = loaded.model.decode_graphs
            assert graphs_of.token_graph == (token and mode.startswith("pipeline"))
            assert (graphs_of.attn is not None) == ("device-attention" in mode or (mode == "pipeline-defaults"
                                                                                  and token))
        got[graphs] = greedy_logits(loaded.model, PROMPT, DECODE)
        if graphs and token and mode.startswith("pipeline"):  # every expert resident: the second set too
            assert (loaded.model.decode_graphs._resident_pieces is not None) == (cache == 32)
        tiers.finish()
        c = tiers.metrics.counts
        got[graphs, "counts"] = (c.slot_hits, c.cpu_entries + c.pcie_entries)
        got[graphs, "pcie"] = c.pcie_entries
        got[graphs, "ahead"] = (c.ahead_entries, c.ahead_copies)
        got[graphs, "warm"] = (c.warm_hits, c.warm_entries)
        rows = getattr(loaded.model.decode_graphs, "rows", None)
        if graphs and ahead and cache < 32:
            picked_next = "next" in mode or mode == "pipeline-defaults"  # next: the default since session 36
            assert rows.ahead_next == (picked_next and "split" not in mode)
        got[graphs, "predicted"] = int(rows.predicted.host[0]) if hasattr(rows, "predicted") else 0
    assert torch.equal(got[True], got[False])
    assert got[True, "counts"] == got[False, "counts"]
    assert got[False, "pcie"] == 0 and got[False, "ahead"] == (0, 0)
    if pcie and cache < 32:  # misses were split: some of them went over PCIe (with copies ahead, maybe all)
        assert 0 < got[True, "pcie"] <= got[True, "counts"][1]
        assert ahead or got[True, "pcie"] < got[True, "counts"][1]
    if ahead and cache < 32:  # some copies ahead were routed misses, each one counted with the GPU's
        used, copied = got[True, "ahead"]
        assert 0 < used <= copied and used <= got[True, "pcie"]
    if not ahead or cache == 32:
        assert got[True, "ahead"] == (0, 0)
    if "warm" in mode and cache < 32:  # the device handed its predictions over (on this small model the
        # routing often comes before the worker sees one: it reads ahead little, or nothing)
        hits, read = got[True, "warm"]
        assert hits <= read and got[True, "predicted"] > 0
    else:
        assert got[True, "warm"] == (0, 0) and got[True, "predicted"] == 0


@pytest.mark.parametrize("cache,token", [(0, ""), (10, ""), (32, ""), (32, "0")],
                         ids=["0", "10", "32", "32-per-layer"])
def test_the_chained_greedy_decode_gives_the_same_tokens_on_cuda(tiny_next_q4, cache, token, monkeypatch):
    """STRATA_DECODE_CHAIN=1 with the engine's defaults (token graphs, the device attention; where experts
    miss copies ahead, a PCIe share) and adaptive rounds: each token launched before the host reads the one
    before, the worker's jobs queued, each with its token's residency snapshot: the greedy ids of the plain
    step-by-step decode (the same decode without the chain), also through engine.generate. Every expert
    resident (cache 32): no worker, each token's ids copied out for the window counts; with
    STRATA_TOKEN_GRAPH=0 over the per-layer graphs, the eager attention cores between them. A sampled
    request chains too (its draws on the device): the step-by-step draws' ids; so does a request for
    logprobs (each token's logits copied out beside its choice): the step-by-step values, to the bit."""
    from strata_ray.engine.generate import generate
    from strata_ray.engine.sampling import SamplingParams
    from strata_ray.model.decode_graph import decode_chain

    sampled = SamplingParams(temperature=1.0, top_p=0.95, seed=9)

    for name in ("STRATA_TOKEN_GRAPH", "STRATA_DECODE_DEVICE_ATTENTION", "STRATA_DECODE_WARM",
                 "STRATA_TOKEN_GRAPH_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    if token:
        monkeypatch.setenv("STRATA_TOKEN_GRAPH", token)
    cfg = EngineConfig(model=tiny_next_q4, device="cuda", expert_cache=cache, adapt_every=1, adapt_swaps=8)
    got = {}
    for chain in ("0", "1"):
        monkeypatch.setenv("STRATA_DECODE_CHAIN", chain)
        loaded, tiers = load_tiered_model(cfg, "cuda", progress=False)
        graphs = loaded.model.decode_graphs
        assert graphs.chain == (chain == "1") and graphs.token_graph == (token != "0")
        assert (graphs.attn is not None) == graphs.token_graph
        with torch.inference_mode():
            state = loaded.model.new_state()
            first = int(loaded.model.forward(PROMPT, state)[-1].argmax())
            if chain == "1":
                ids = [first, *decode_chain(graphs, first, state, DECODE - 1)]
            else:
                ids = [first]
                for _ in range(DECODE - 1):
                    ids.append(int(loaded.model.forward([ids[-1]], state)[-1].argmax()))
        got[chain] = ids
        got[chain, "generate"] = generate(loaded.model, PROMPT, DECODE).token_ids
        got[chain, "sampled"] = generate(loaded.model, PROMPT, DECODE, sampling=sampled).token_ids
        r = generate(loaded.model, PROMPT, DECODE, sampling=sampled, logprobs=4)
        got[chain, "logprobs"] = (r.token_ids, r.top_logprobs, r.token_logprobs)
        tiers.finish()
        c = tiers.metrics.counts
        if cache < 32:
            assert c.cpu_entries + c.pcie_entries > 0  # experts missed: the worker served the tokens
        else:
            assert c.cpu_entries + c.pcie_entries == 0 and c.slot_hits > 0
        got[chain, "heat"] = tiers.heat.copy()  # each token counted from its own ids
    assert np.array_equal(got["1", "heat"], got["0", "heat"]) and got["1", "heat"].sum() > 0
    assert got["1"] == got["0"] == got["0", "generate"] == got["1", "generate"]
    assert len(set(got["0"])) > 2
    assert got["1", "sampled"] == got["0", "sampled"] != got["0"]  # drawn on the device: the host's draws
    assert got["1", "logprobs"] == got["0", "logprobs"] and got["1", "logprobs"][0] == got["1", "sampled"]


def test_prompt_logprobs_leave_the_generation_alone_on_cuda(tiny_next_q4):
    """An echo's prompt scores (every row of the prompt's logits; the first token from the last row's LM
    head alone, as without them): the same tokens and logprob bits as the request without them, the chained
    decode included; the scores near the CPU engine's."""
    from strata_ray.engine.generate import generate
    from strata_ray.engine.prefill import prefill_chunk

    prompt = [3 + i % 200 for i in range(600)]  # > 512 rows: the LM head over two slices
    got = {}
    for device in ("cuda", "cpu"):
        cfg = EngineConfig(model=tiny_next_q4, device=device, expert_cache=10 if device == "cuda" else 0)
        loaded, _ = load_tiered_model(cfg, device, progress=False)
        chunk = prefill_chunk(cfg, device)  # the engine's (4096 on CUDA): the plain prompt's state
        plain = generate(loaded.model, prompt, DECODE, logprobs=2, prefill_chunk=chunk)
        got[device] = generate(loaded.model, prompt, DECODE, logprobs=2, prompt_logprobs=3,
                               prefill_chunk=chunk)
        assert (got[device].token_ids, got[device].token_logprobs) == (plain.token_ids, plain.token_logprobs)
        assert len(got[device].prompt_logprobs) == len(prompt) - 1
    cuda, cpu = ([e.logprob for e in got[d].prompt_logprobs] for d in ("cuda", "cpu"))
    assert cuda == pytest.approx(cpu, abs=5e-2) and all(lp <= 0 for lp in cuda)


@pytest.mark.parametrize("chain", ["0", "1"])
def test_a_loan_of_ring_slots_gives_the_same_bits_over_two_requests_on_cuda(tiny_next_q4, chain, monkeypatch):
    """STRATA_RING_LOAN with a 4-slot ring and the engine's decode defaults (token graphs, copies ahead, a
    PCIe share; chained or not) and adaptive rounds: the decode borrows the ring (its copies on the swap
    stream after the prompt's ring copies), gives it back at the next prompt, which streams through it
    again: every logit of both requests equals the run without a loan, with more hits; a third request
    through engine.generate (the chained decode where on) gives the same ids."""
    from strata_ray.engine.generate import generate

    for name in ("STRATA_TOKEN_GRAPH", "STRATA_DECODE_DEVICE_ATTENTION", "STRATA_DECODE_WARM",
                 "STRATA_TOKEN_GRAPH_LAYERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STRATA_RING_SLOTS", "4")
    monkeypatch.setenv("STRATA_DECODE_CHAIN", chain)
    cfg = EngineConfig(model=tiny_next_q4, device="cuda", expert_cache=10, adapt_every=1, adapt_swaps=8)
    got = {}
    for loan in (True, False):
        loaded, tiers = load_tiered_model(replace(cfg, ring_loan=loan), "cuda", progress=False)
        assert tiers.residency.n_lendable == (4 if loan else 0)
        first = greedy_logits(loaded.model, PROMPT, DECODE)
        lent = int((tiers.residency.slot_pair[10:] >= 0).sum())
        second = greedy_logits(loaded.model, PROMPT[::-1], DECODE)
        third = generate(loaded.model, PROMPT[5:], DECODE).token_ids  # chained where STRATA_DECODE_CHAIN=1
        tiers.finish()
        got[loan] = (first, second, lent, tiers.metrics.counts, third)
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    assert got[True][4] == got[False][4]
    assert got[True][2] == 4 and got[False][2] == 0
    assert got[True][3].loaned >= 8 and got[True][3].slot_hits > got[False][3].slot_hits


def test_auto_cache_leaves_the_prompt_chunk_free(tiny_next_q4):
    """--expert-cache auto on CUDA keeps --vram-reserve-mib plus the prompt chunk's temporaries free."""
    from strata_ray.engine.prefill import chunk_bytes
    from strata_ray.experts.host_store import HostStore
    from strata_ray.experts.slot_cache import MIB, cache_slots
    from strata_ray.model.gguf_file import GGUFFile

    file = GGUFFile(tiny_next_q4)
    store = HostStore(file)
    free, total = torch.cuda.mem_get_info()
    used, blob, hp = total - free, store.max_blob, file.hparams
    n_pairs = hp.n_layer * hp.n_expert
    budget_mib = (used + 600 * MIB + chunk_bytes(hp, 8192) + 10 * blob) // MIB
    slots = {}
    for chunk in (512, 8192):
        cfg = EngineConfig(model=tiny_next_q4, device="cuda", prefill=chunk, vram_reserve_mib=600,
                           vram_budget_mib=budget_mib)
        slots[chunk] = cache_slots(cfg, store, torch.device("cuda"))
    assert max(0, 10 - MIB // blob - 1) <= slots[8192] <= 10 < n_pairs  # the budget rounds down to whole MiB
    assert chunk_bytes(hp, 8192) - chunk_bytes(hp, 512) > n_pairs * blob  # what the smaller chunk frees
    assert slots[512] == n_pairs


@pytest.mark.parametrize("prompt_len,cache", [(1, 12), (3, 12), (1, 32)],
                         ids=["1-worker", "3-worker", "1-resident"])
def test_a_short_prompt_counts_as_a_prompt_on_cuda(tiny_next_q4, prompt_len, cache, monkeypatch):
    """The CUDA pipelined decode (chained, a token joined after the next launched): a prompt of one or a few
    tokens runs the decode's graphs, and its entries are counted as prompt entries even when its token is
    joined after the prompt ended; the windows, tokens and hit counts are the decode's alone. With every
    expert resident (cache 32) there is no worker: the token's ids are copied out and counted the same way."""
    monkeypatch.delenv("STRATA_DECODE_CHAIN", raising=False)
    cfg = EngineConfig(model=tiny_next_q4, device="cuda", expert_cache=cache, adapt_every=0)
    loaded, tiers = load_tiered_model(cfg, "cuda", progress=False)
    rows = getattr(loaded.model.decode_graphs, "rows", None)  # the pipelined decode (None: all resident)
    generate_and_check_prompt_counts(loaded.model, tiers, PROMPT[:prompt_len], DECODE,
                                     ahead=getattr(rows, "ahead", 0))


@pytest.mark.parametrize("room", [True, False])
def test_a_fused_gate_up_file_gives_the_unfused_files_logits_on_cuda(tiny_next_q4, tmp_path, monkeypatch,
                                                                     room):
    """A Q4_0 model written with ffn_gate_up_exps (synth --fused-gate-up: the same rows) decodes the unfused
    file's logits bit for bit on CUDA at three cache sizes, with the engine's decode defaults. With host
    memory its layers are split (or pinned) into memory of their own and the pipelined decode takes them;
    with none (no spare memory, no pinning) they stay strided views of the file map, and the decode keeps
    the per-layer form (decode_pipeline.pipeline_supported: the worker would copy every such layer)."""
    import strata_ray.experts.host_store as host_store
    from strata_ray.experts.decode_pipeline import PipelinedDecodeRows, pipeline_supported
    from strata_ray.model.synth import write_synth

    fused = tmp_path / "fused.gguf"
    write_synth(fused, arch="qwen3next", preset="tiny", expert_type="Q4_0", progress=False,
                fused_gate_up=True)
    if not room:
        monkeypatch.setattr(host_store, "spare_memory_gib", lambda: 0.0)
    for cache in (0, 10, 32):
        got = []
        for path in (tiny_next_q4, str(fused)):
            cfg = EngineConfig(model=path, device="cuda", expert_cache=cache, adapt_every=0,
                               arena_pin_gib=None if room else 0.0)
            loaded, tiers = load_tiered_model(cfg, "cuda", progress=False)
            got.append(greedy_logits(loaded.model, PROMPT, DECODE))
            rows = getattr(loaded.model.decode_graphs, "rows", None)
            if path != tiny_next_q4:
                assert pipeline_supported(tiers) is room
                assert (tiers.store.arena_bytes > 0) is room
            assert isinstance(rows, PipelinedDecodeRows) is pipeline_supported(tiers), (cache, path)
            tiers.finish()
        assert torch.equal(got[0], got[1]), (cache, room)
