"""TieredExperts on a CPU primary: rows match the kernels' reference, and greedy tokens do not depend on
placement (cache size, profile, adaptive rounds), which is the point of the arithmetic contract."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from strata_ray.actors.coordinator import Coordinator
from strata_ray.config import EngineConfig
from strata_ray.engine.engine import Engine, unavailable_feature
from strata_ray.experts.adaptive import AdaptiveTier
from strata_ray.experts.build import build_expert_backend, load_tiered_model
from strata_ray.experts.profile import Profile, ProfileError, read_profile, write_profile
from strata_ray.experts.tiered import DueCounts
from strata_ray.kernels.reference import expert_ffn_ref
from strata_ray.model.gguf_file import GGUFFile
from strata_ray.model.moe import combine_rows
from strata_ray.model.routing_digest import routing_digest
from tests.experts.decoding import generate_and_check_prompt_counts

PROMPT = [5, 17, 101, 42, 250, 7, 64, 3, 99, 180]
DECODE = 8


def config(tiny_next, **kw):
    return replace(EngineConfig(model=tiny_next, device="cpu"), **kw)


def greedy(loaded, prompt=PROMPT, n=DECODE):
    model = loaded.model
    with torch.inference_mode():
        state = model.new_state()
        logits = model.forward(prompt, state)
        out = []
        for _ in range(n):
            out.append(int(logits[-1].argmax()))
            logits = model.forward([out[-1]], state)
    return out


def test_rows_match_the_kernel_reference(tiny_next):
    loaded, tiers = load_tiered_model(
        config(tiny_next, expert_cache=10, adapt_every=0), "cpu", progress=False
    )
    hp = loaded.hp
    layer = 2
    x = torch.randn(3, hp.n_embd, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 5], [3, 0], [7, 6]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    assert 0 < (tiers.residency.layer_slots(layer)[ids.numpy()] >= 0).sum() < ids.numel()  # both tiers used
    got = tiers(layer, x, ids, w)
    tok = np.repeat(np.arange(3), 2)
    ref = expert_ffn_ref(
        x.numpy(), tok, ids.numpy().reshape(-1), tiers.store.layer(layer), quantize_acts=True
    )
    want = combine_rows(torch.from_numpy(ref).view(3, 2, -1), w)
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()))
    # and bit for bit what an all-CPU placement gives
    _, cpu_only = load_tiered_model(config(tiny_next, expert_cache=0), "cpu", progress=False)
    assert torch.equal(got, cpu_only(layer, x, ids, w))


def test_a_one_token_cpu_layer_takes_the_token_form_with_the_same_bits(tiny_next, monkeypatch):
    """A decode token whose entries all go to the one-thread CPU tier runs the layer's TokenMoe (its rows
    and their combine with no Python between the kernels; the layer's views checked once) and gives
    expert_ffn_cpu's rows combined, bit for bit; two tokens keep the general form; where TokenMoe does not
    serve (STRATA_FUSED_DECODE=0, as weights tracked by autograd), expert_ffn_cpu_token and combine_rows,
    the same bits again."""
    import strata_ray.experts.tiered as tiered_module

    _, tiers = load_tiered_model(config(tiny_next, expert_cache=0, adapt_every=0), "cpu", progress=False)
    layer, n_embd = 1, tiers.store.layer(1).n_embd
    x = torch.randn(2, n_embd, generator=torch.Generator().manual_seed(3))
    ids, w = torch.tensor([[4, 6], [6, 2]]), torch.tensor([[0.7, 0.3], [0.55, 0.45]])
    calls, checks = [], []
    token_form, checked = tiered_module.expert_ffn_cpu_token, tiered_module.token_layer
    fused = tiered_module.TokenMoe.__call__
    monkeypatch.setattr(tiered_module.TokenMoe, "__call__", lambda *a: calls.append("fused") or fused(*a))
    monkeypatch.setattr(tiered_module, "expert_ffn_cpu_token",
                        lambda *a: calls.append("rows") or token_form(*a))
    monkeypatch.setattr(tiered_module, "token_layer", lambda lay: checks.append(1) or checked(lay))
    one = tiers(layer, x[:1], ids[:1], w[:1])
    assert calls == ["fused"] and checks == [1]
    both = tiers(layer, x, ids, w)  # two tokens: expert_ffn_cpu, whose first row is the same token's
    assert calls == ["fused"] and torch.equal(one, both[:1])
    assert torch.equal(tiers(layer, x[:1], ids[:1], w[:1]), one)
    assert calls == ["fused"] * 2 and checks == [1]  # the layer's views kept, not checked again
    monkeypatch.setenv("STRATA_FUSED_DECODE", "0")
    assert torch.equal(tiers(layer, x[:1], ids[:1], w[:1]), one)
    monkeypatch.delenv("STRATA_FUSED_DECODE")
    tracked = w[:1].clone().requires_grad_()
    out = tiers(layer, x[:1], ids[:1], tracked)
    assert torch.equal(out.detach(), one) and out.requires_grad  # the combine's gradient is torch's
    assert calls == ["fused"] * 2 + ["rows"] * 2 and checks == [1]


@pytest.mark.parametrize("room", [True, False])
def test_a_fused_gate_up_file_gives_the_unfused_files_tokens(tiny_next, tmp_path, monkeypatch, room):
    """The same model written with ffn_gate_up_exps (synth --fused-gate-up: the same rows) decodes the same
    greedy tokens as the unfused file with every expert on the CPU (the one-token form) and with CPU slots
    (the slot tier's strided views): its layers split into memory of their own where the host has room, read
    through their routed experts where it has none."""
    import strata_ray.experts.host_store as host_store
    from strata_ray.model.synth import write_synth

    fused = tmp_path / "fused.gguf"
    write_synth(fused, arch="qwen3next", preset="tiny", progress=False, fused_gate_up=True)
    file = GGUFFile(fused)
    assert file.has("blk.0.ffn_gate_up_exps.weight") and not file.has("blk.0.ffn_gate_exps.weight")
    if not room:
        monkeypatch.setattr(host_store, "spare_memory_gib", lambda: 0.0)
    for cache in (0, 12):
        want = greedy(load_tiered_model(config(tiny_next, expert_cache=cache, adapt_every=0), "cpu",
                                        progress=False)[0])
        loaded, tiers = load_tiered_model(config(str(fused), expert_cache=cache, adapt_every=0), "cpu",
                                          progress=False)
        assert (tiers.store.arena_bytes > 0) is room
        assert greedy(loaded) == want, (cache, room)


def test_greedy_tokens_do_not_depend_on_placement(tiny_next, tmp_path):
    hp = GGUFFile(tiny_next).hparams
    n_pairs = hp.n_layer * hp.n_expert
    backwards = Profile(hp.n_layer, hp.n_expert, np.stack(divmod(np.arange(n_pairs)[::-1], hp.n_expert), 1))
    write_profile(tmp_path / "p.strp", backwards)
    runs = {
        "cache 0": config(tiny_next, expert_cache=0),
        "all cached": config(tiny_next, expert_cache=n_pairs),
        "profile": config(
            tiny_next, expert_cache=n_pairs // 3, expert_profile=str(tmp_path / "p.strp"), adapt_every=0
        ),
        "adaptive": config(tiny_next, expert_cache=n_pairs // 3, adapt_every=1, adapt_swaps=8),
    }
    tokens, swaps = {}, {}
    for name, cfg in runs.items():
        loaded, tiers = load_tiered_model(cfg, "cpu", progress=False)
        tokens[name] = greedy(loaded)
        tiers.finish()
        swaps[name] = tiers.metrics.counts.swaps
    assert swaps["adaptive"] > 0 and swaps["profile"] == 0
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens


def test_dense_blocks_on_the_cpu_keep_placement_invariance(tiny_next):
    """STRATA_CPU_DENSE_BLOCKS: the dense Q8_0 matrices stay blocks of the file map, decode calls run the
    contract's kernels; the greedy tokens still do not depend on placement, and stay near the float32
    path's (the same first token: the prompt's chunk takes the reference F.linear)."""
    from strata_ray.kernels.dense_blocks import BlockMatrix

    hp = GGUFFile(tiny_next).hparams
    tokens = {}
    for cache in (0, hp.n_layer * hp.n_expert):
        loaded, tiers = load_tiered_model(config(tiny_next, expert_cache=cache, cpu_dense_blocks=True), "cpu",
                                          progress=False)
        kept = [n for n, w in loaded.model.weights.items() if isinstance(w, BlockMatrix)]
        assert "output.weight" in kept and any(".attn_qkv." in n for n in kept), kept
        tokens[cache] = greedy(loaded)
        tiers.finish()
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens
    loaded, tiers = load_tiered_model(config(tiny_next, expert_cache=0), "cpu", progress=False)
    assert greedy(loaded)[0] == tokens[0][0]
    tiers.finish()


def test_learned_profile_saved_after_a_generation(tiny_next, tmp_path):
    cfg = config(tiny_next, expert_cache=12, adapt_every=1, adapt_swaps=4)
    loaded, tiers = load_tiered_model(cfg, "cpu", progress=False)
    greedy(loaded, n=4)
    tiers.finish()
    tiers.save_profile(str(tmp_path / "learned.strp"))
    saved = read_profile(tmp_path / "learned.strp")
    hp = loaded.hp
    assert (saved.n_layers, saved.n_expert, saved.n_ranked) == (
        hp.n_layer,
        hp.n_expert,
        hp.n_layer * hp.n_expert,
    )
    resident = set(np.flatnonzero(tiers.residency.resident_mask(include_pending=True).reshape(-1)).tolist())
    assert set(saved.pair_ids()[: len(resident)].tolist()) == resident  # resident pairs first
    assert saved.model == routing_digest(loaded.file)  # the model it was learned on, named in it


def _window_of(tiers, layer: int, expert: int, n: int) -> None:
    """A decode window in which `expert` of `layer` was routed n times (and nothing else)."""
    tiers.count_entries(layer, np.full(n, expert, np.int64), 1, 0, n, True, 0.0)


@pytest.mark.parametrize("defer", [False, True])
def test_a_round_applies_at_the_boundary_after_the_one_that_planned_it(tiny_next, defer):
    """Window boundaries: the closed window's counts plan a round (after the launch where deferred), whose
    victims leave at the next boundary while the newcomers' copies start, and which lands at the one after;
    deferred or not, the same states at every boundary."""
    loaded, tiers = load_tiered_model(config(tiny_next, expert_cache=6, adapt_every=1, adapt_swaps=4), "cpu",
                                      progress=False)
    res = tiers.residency
    expert = int(np.flatnonzero(~res.resident_mask()[0])[0])  # a non-resident expert of layer 0
    pair = expert  # layer 0
    states = []

    def boundary():
        tiers.start_forward(1, defer=defer)
        if defer:
            states.append(("before launch", tiers.heat[0, expert], res.is_resident(pair)))
            tiers.after_launch()
        pending = bool(res.resident_mask(include_pending=True)[0, expert])
        states.append((tiers.heat[0, expert], pending, res.is_resident(pair), tiers.metrics.counts.swaps))

    boundary()
    _window_of(tiers, 0, expert, 5)
    boundary()  # window 1 closed: its round planned, not applied
    assert states[-1] == (5, False, False, 0)
    boundary()  # the round applied: the expert's copy in flight, the victim gone
    assert states[-1][1:] == (True, False, 1)
    boundary()  # landed
    assert states[-1][1:3] == (True, True) and tiers.metrics.counts.rounds == 1
    if defer:  # before its after_launch a boundary has not yet counted the closed window
        assert states[2] == ("before launch", 0, False)  # the second boundary, before its launch
    tiers.finish()


def test_a_loan_filling_does_not_hold_the_rounds_back(tiny_next, monkeypatch):
    """The rounds skip while a round's swaps are in flight, as the reference, not while a loan's copies are
    (a loan of 8 slots filled 2 a boundary here): the round due at the second boundary runs beside the
    loan's copies, its swap lands; the round due while that swap is in flight is skipped."""
    import strata_ray.experts.tiered as tiered_module

    monkeypatch.setenv("STRATA_RING_SLOTS", "8")
    monkeypatch.setattr(tiered_module, "LOAN_STEP", 2)
    loaded, tiers = load_tiered_model(config(tiny_next, expert_cache=6, adapt_every=1, adapt_swaps=4), "cpu",
                                      progress=False)
    res, tier = tiers.residency, tiers.rounds.tier
    order = tiers.learned_profile().pair_ids()  # the loan's order: the expert below is lent last, if at all
    pair = int(order[~res.resident_mask().reshape(-1)[order]][-1])
    layer, expert = divmod(pair, res.n_expert)
    tiers.start_forward(1)  # the loan opens: its first 2 copies
    _window_of(tiers, layer, expert, 5)
    tiers.start_forward(1)  # those landed, 2 more in flight; window 1's round plans beside them
    assert len(res.pending) == 2 and tier.rounds == 1 and not res.is_resident(pair)
    tiers.start_forward(1)  # the round's swap in flight (the loan waits a boundary): window 2's round skips
    assert [c.pair for c in res.pending] == [pair] and tier.rounds == 1
    tiers.start_forward(1)
    assert res.is_resident(pair) and res.slot_of(pair) < res.n_slots and tier.rounds == 2
    tiers.finish()


def test_a_boundary_whose_token_failed_is_completed_at_the_next(tiny_next):
    """start_forward(defer=True) without its after_launch (the token failed before its launch): the next
    boundary counts the closed window first, so no counts are lost."""
    loaded, tiers = load_tiered_model(config(tiny_next, expert_cache=6, adapt_every=1, adapt_swaps=4), "cpu",
                                      progress=False)
    tiers.start_forward(1)
    _window_of(tiers, 1, 2, 3)
    tiers.start_forward(1, defer=True)  # closed, not counted yet
    assert tiers.heat[1, 2] == 0
    _window_of(tiers, 1, 2, 4)
    tiers.start_forward(1)
    assert tiers.heat[1, 2] == 7  # both windows counted
    tiers.finish()


def test_mismatched_profile_is_refused(tiny_next, tmp_path):
    write_profile(tmp_path / "other.strp", Profile(3, 8, np.array([(0, 0)])))
    file = GGUFFile(tiny_next)
    with pytest.raises(ProfileError, match="is for 3 layers x 8 experts, but the model has 4 layers x 8"):
        build_expert_backend(
            config(tiny_next, expert_profile=str(tmp_path / "other.strp")),
            file,
            file.hparams,
            "cpu",
            progress=False,
        )


def test_engine_builds_the_tiers_and_accepts_the_flags(tiny_next):
    cfg = config(tiny_next, expert_cache=5, vram_budget_mib=100, expert_profile_save="/tmp/x.strp")
    assert unavailable_feature(cfg) is None
    engine = Engine(cfg)
    assert engine.tiers is not None and engine.tiers.residency.n_slots == 5
    assert engine.loaded.model.experts is engine.tiers
    assert not any(name.endswith("_exps.weight") for name in engine.loaded.model.weights)


def test_coordinator_plans_rounds_from_sent_counts():
    coord = Coordinator(EngineConfig(adapt_every=2, adapt_swaps=5))
    coord.configure_rounds(2, 4)
    resident = np.array([[True, True, False, False], [True, False, False, False]])
    counts = np.array([[0, 2, 18, 0], [0, 0, 0, 2]])  # one round's two windows
    swaps = coord.adapt_round([counts], resident, False)
    assert [s[:3] for s in swaps] == [(0, 2, 0), (1, 3, 0)]
    assert coord.adapt_round([counts], resident, True) == []  # primary still busy: round skipped
    assert coord.status()["adaptive"] == {"rounds": 1, "swaps": 2, "windows": 4}  # the skipped one uncounted


def test_a_late_message_runs_each_due_round_on_its_own_counts():
    """Two rounds in one message (the coordinator answered late): each round sees its own counts and decays
    them, as an in-process AdaptiveTier run a round at a time; once one returns swaps the next is skipped
    (their copies pending), without decaying."""
    resident = np.array([[True, True, False, False]])
    cold, hot = np.array([[1, 0, 1, 0]]), np.array([[0, 0, 0, 3]])  # hot: expert 3 reaches 2.0 + 1.5
    local = AdaptiveTier(1, 4, adapt_every=1, max_swaps=4)
    local_swaps = []
    for counts in (cold, hot):
        local.record(counts)
        local_swaps = local.run_round(resident).primary
    coord = Coordinator(EngineConfig(adapt_every=1, adapt_swaps=4))
    coord.configure_rounds(1, 4)
    swaps = coord.adapt_round([cold, hot], resident, False)
    assert swaps == [(s.layer, s.candidate, s.victim, s.gain) for s in local_swaps] and swaps
    assert coord._rounds.usage.tobytes() == local.usage.tobytes()  # both decayed twice
    assert coord.status()["adaptive"] == {"rounds": 2, "swaps": len(swaps), "windows": 2}
    before = coord._rounds.usage.copy()
    again = coord.adapt_round([hot, cold], resident, False)  # the hot round's swaps: the cold one skipped
    assert again == [(0, 3, 1, again[0][3])]
    f32 = np.float32
    expected = (before + hot.astype(f32)) * f32(0.7) + cold.astype(f32)
    assert coord._rounds.usage.tobytes() == expected.tobytes()
    assert coord.status()["adaptive"]["rounds"] == 3


def test_due_counts_cut_the_windows_at_each_round():
    due = DueCounts(1, 2, every=2)
    for w in range(5):
        due.add(np.array([[w, 1]]))
        if w == 2:
            assert [d.tolist() for d in due.take()] == [[[1, 2]]]  # windows 0-1
    assert [d.tolist() for d in due.take()] == [[[5, 2]]]  # windows 2-3; window 4 waits for its boundary
    due.add(np.array([[0, 7]]))
    assert [d.tolist() for d in due.take()] == [[[4, 8]]]


def test_engine_generate_reports_tiers_and_saves_the_learned_profile(tiny_next, tmp_path):
    from strata_ray.engine.engine import GenerationRequest

    save = tmp_path / "learned.strp"
    tokens = []
    for cache in (0, 12):
        cfg = config(
            tiny_next, expert_cache=cache, adapt_every=1, adapt_swaps=4, expert_profile_save=str(save)
        )
        summary = Engine(cfg).generate(GenerationRequest(prompt_ids=tuple(PROMPT), max_tokens=6))
        assert "cache hits" in summary.summary_line()
        tokens.append(summary.token_ids)
    assert tokens[0] == tokens[1]
    assert read_profile(save).n_layers == GGUFFile(tiny_next).hparams.n_layer


def test_each_request_reports_its_own_tier_counts(tiny_next):
    """One engine, the same request twice (every expert on the CPU: no rounds, no placement to move): each
    summary counts its own request, so both are equal, and the tiers' totals are their sum."""
    from strata_ray.engine.engine import GenerationRequest

    engine = Engine(config(tiny_next, expert_cache=0))
    request = GenerationRequest(prompt_ids=tuple(PROMPT), max_tokens=5)
    first, second = engine.generate(request), engine.generate(request)
    assert first.expert_stats["cpu_entries"] > 0 and first.expert_stats["tokens"] > 0
    assert second.expert_stats == {**first.expert_stats, **{key: second.expert_stats[key] for key in (
        "host_seconds", "cpu_seconds", "wait_seconds", "gap_seconds", "host_ms_per_token",
        "cpu_ms_per_token", "wait_ms_per_token", "gap_ms_per_token")}}  # all but the times
    assert engine.tiers.metrics.counts.cpu_entries == 2 * first.expert_stats["cpu_entries"]
    assert second.experts.split(", host ")[0] == first.experts.split(", host ")[0]


def test_a_profile_save_that_fails_keeps_the_request(tiny_next, tmp_path):
    """The save's folder gone after the start: the request still returns its tokens, with one line saying
    the profile was not written (the run's exit status and the JSON carry it)."""
    from strata_ray.engine.engine import GenerationRequest

    folder = tmp_path / "gone"
    folder.mkdir()
    engine = Engine(config(tiny_next, expert_cache=12, expert_profile_save=str(folder / "p.strp")))
    request = GenerationRequest(prompt_ids=tuple(PROMPT), max_tokens=6)
    first = engine.generate(request)
    assert first.warnings == () and (folder / "p.strp").exists()
    (folder / "p.strp").unlink()
    folder.rmdir()
    second = engine.generate(request)
    assert second.token_ids == first.token_ids and len(second.token_ids) == 6
    assert second.warnings == (f"--expert-profile-save: expert profile {folder / 'p.strp'}: cannot write "
                               "(No such file or directory)",)


def test_warm_up_runs_every_cpu_path_and_counts_nothing(tiny_next):
    """Load compiles the kernels (warm_up); it must not show up in the decode metrics or the rounds."""
    _, tiers = load_tiered_model(config(tiny_next, expert_cache=10), "cpu", progress=False)
    assert tiers.metrics.counts == type(tiers.metrics.counts)()  # the load's warm-up left no counts
    assert tiers.warm_up() >= 0.0
    assert tiers.metrics.counts == type(tiers.metrics.counts)() and not tiers.heat.any()


@pytest.mark.parametrize("adapt_every", [0, 1])
def test_a_loan_of_ring_slots_serves_decode_and_leaves_before_the_next_prompt(tiny_next, monkeypatch,
                                                                           adapt_every):
    """The ring's slots lent to the decode (STRATA_RING_LOAN; a CPU primary gets a ring from
    STRATA_RING_SLOTS): more hits, given back at the next prompt, and the same greedy tokens as every
    other placement, over two requests (the second one reopens the loan), with and without rounds."""
    hp = GGUFFile(tiny_next).hparams
    n_pairs = hp.n_layer * hp.n_expert
    monkeypatch.setenv("STRATA_RING_SLOTS", "8")
    cfg = config(tiny_next, expert_cache=n_pairs // 3, adapt_every=adapt_every, adapt_swaps=8)
    runs = {}
    for loan in (True, False):
        loaded, tiers = load_tiered_model(replace(cfg, ring_loan=loan), "cpu", progress=False)
        assert tiers.residency.n_lendable == (8 if loan else 0) and tiers.cache.ring_slots == 8
        first = greedy(loaded)
        lent_then = int((tiers.residency.slot_pair[tiers.residency.n_slots:] >= 0).sum())
        with torch.inference_mode():  # the next prompt gives the ring back before its experts run
            loaded.model.forward(PROMPT[::-1], loaded.model.new_state())
        lent_after_prompt = int((tiers.residency.slot_pair[tiers.residency.n_slots:] >= 0).sum())
        second = greedy(loaded, prompt=PROMPT[3:])
        tiers.finish()
        runs[loan] = (first, second, lent_then, lent_after_prompt, tiers.metrics.counts)
    no_cache, _ = load_tiered_model(config(tiny_next, expert_cache=0), "cpu", progress=False)
    lent, plain = runs[True], runs[False]
    assert lent[0] == plain[0] == greedy(no_cache) and lent[1] == plain[1]
    assert lent[2] == 8 and lent[3] == 0 and plain[2] == 0  # full while decoding, empty after the prompt
    assert lent[4].loaned >= 16  # both requests filled the loan
    assert lent[4].slot_hits > plain[4].slot_hits


def test_a_prompt_ordered_loan_takes_the_prompts_hottest_non_resident_pairs(tiny_next, monkeypatch):
    """STRATA_LOAN_ORDER=prompt: the loan holds non-resident pairs the last prompt routed to at least as often
    as to any non-resident pair left out; a new prompt's counts start from zero; the same greedy tokens."""
    hp = GGUFFile(tiny_next).hparams
    monkeypatch.setenv("STRATA_RING_SLOTS", "8")
    cfg = config(tiny_next, expert_cache=hp.n_layer * hp.n_expert // 3, adapt_every=0)
    tokens = {}
    for order in ("profile", "prompt"):
        loaded, tiers = load_tiered_model(replace(cfg, loan_order=order), "cpu", progress=False)
        tokens[order] = greedy(loaded)
        res = tiers.residency
        lent = res.slot_pair[res.n_slots:]
        heat = tiers.prompt_heat.reshape(-1).copy()
        assert heat.sum() == len(PROMPT) * hp.n_expert_used * hp.n_layer  # every prompt entry, once
        left_out = np.flatnonzero(res.res < 0)
        if order == "prompt":
            assert (lent >= 0).all() and heat[lent].min() >= heat[left_out].max()
        with torch.inference_mode():  # a second prompt: its own counts
            loaded.model.forward(PROMPT[:9], loaded.model.new_state())
        assert tiers.prompt_heat.sum() == 9 * hp.n_expert_used * hp.n_layer
        tiers.finish()
    assert tokens["profile"] == tokens["prompt"]


@pytest.mark.parametrize("prompt_len", [3, 10])
def test_a_short_prompt_counts_as_a_prompt_not_a_decode_window(tiny_next, prompt_len):
    """A prompt of <= DECODE_MAX_TOKENS tokens runs the decode's kernels, but its entries are prompt entries:
    the windows, tokens, hit counts and adaptive usage are the decode's alone, as for a long prompt."""
    cfg = config(tiny_next, expert_cache=12, adapt_every=0)
    loaded, tiers = load_tiered_model(cfg, "cpu", progress=False)
    generate_and_check_prompt_counts(loaded.model, tiers, PROMPT[:prompt_len], DECODE)
    assert tiers.metrics.counts.pcie_entries == 0  # a CPU primary: every miss is the CPU pool's


def test_a_prompt_tokens_pcie_entries_are_prompt_entries_too(tiny_next):
    """The pipelined CUDA decode counts a token's entries as (hits, CPU misses, PCIe misses); for a short
    prompt's token all of them are prompt entries (a one-token prompt counted 1 of its 8 on the H200)."""
    cfg = config(tiny_next, expert_cache=12, adapt_every=0)
    loaded, tiers = load_tiered_model(cfg, "cpu", progress=False)
    k = loaded.hp.n_expert_used
    ids = np.arange(k, dtype=np.int64)
    tiers.count_entries(0, ids, 1, 1, 2, False, 0.0, pcie=k - 3)  # 1 hit, 2 CPU, the rest over PCIe
    c = tiers.metrics.counts
    assert c.prompt_entries == k and int(tiers.prompt_heat.sum()) == k
    assert c.slot_hits == c.cpu_entries == c.pcie_entries == 0  # the decode's counts untouched
