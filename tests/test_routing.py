"""Routing policies on hand-built cases, and in the engine (reference: DESIGN.md "SERE routing")."""
from __future__ import annotations

import torch

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.prefill_graphs import PrefillGraphs
from zipmoe.engine.routing import OeaPolicy, RoutingPolicy, RoutingStats, SerePolicy, TruncatePolicy
from zipmoe.engine.sequence import SamplingParams
from zipmoe.kernels.fused_moe import fused_experts_reference

from test_chunked_prefill import engine

E = 6


def sere(sim, protect=None, k1=1, rho=0.5):
    protect = torch.zeros(1, E, dtype=torch.bool) if protect is None else protect
    return SerePolicy(sim[None], protect, {0: 0}, primary_k=k1, threshold=rho)


def similarity():
    """Expert 3 is close to 0 (0.9), expert 4 close to 1 (0.6), expert 5 like nobody (0.1)."""
    sim = torch.full((E, E), 0.1)
    sim.fill_diagonal_(1.0)
    for a, b, s in [(3, 0, 0.9), (4, 1, 0.6), (2, 1, 0.7)]:
        sim[a, b] = sim[b, a] = s
    return sim


# Two tokens, top-3 each; primaries (k1 = 1) are {0, 1}.
IDS = torch.tensor([[0, 3, 5], [1, 4, 2]])
W = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
PROBS = torch.zeros(2, E)


def test_sere_moves_secondaries_to_most_similar_primary():
    ids, w = sere(similarity()).route(0, PROBS, IDS, W, None)
    assert ids.tolist() == [[0, 0, 5], [1, 1, 1]]  # 3->0 (0.9), 5 stays (0.1 < 0.5), 4->1, 2->1
    assert torch.equal(w, W)  # weights untouched
    assert set(ids.unique().tolist()) <= set(IDS.unique().tolist())  # union never grows


def test_sere_keeps_protected_and_below_threshold_and_primary_slots():
    protect = torch.zeros(1, E, dtype=torch.bool)
    protect[0, 3] = True
    ids, _ = sere(similarity(), protect, rho=0.65).route(0, PROBS, IDS, W, None)
    assert ids.tolist() == [[0, 3, 5], [1, 4, 1]]  # 3 protected; 4 (0.6 < 0.65) stays; 2 (0.7) moves
    already = torch.tensor([[0, 1, 5], [1, 0, 2]])  # secondaries 1 and 0 are primaries: kept
    ids, _ = sere(similarity()).route(0, PROBS, already, W, None)
    assert ids[:, 1].tolist() == [1, 0]


def test_sere_with_k_prime_equal_k_and_opt_out_is_plain_topk():
    ids, _ = sere(similarity(), k1=3).route(0, PROBS, IDS, W, None)
    assert torch.equal(ids, IDS)
    ids, _ = sere(similarity()).route(0, PROBS, IDS, W, torch.tensor([True, False]))
    assert ids.tolist() == [[0, 3, 5], [1, 1, 1]]  # token 0 opted out; it still supplied primary 0


def test_duplicate_ids_add_their_weights():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g)
    gate_up, down = torch.randn(E, 2 * 4, 8, generator=g), torch.randn(E, 4, 8, generator=g)
    dup = fused_experts_reference(x, torch.tensor([[1, 1], [2, 3]]), torch.tensor([[0.25, 0.75], [0.5, 0.5]]),
                                  gate_up, down)
    one = fused_experts_reference(x, torch.tensor([[1, 2], [2, 3]]), torch.tensor([[1.0, 0.0], [0.5, 0.5]]),
                                  gate_up, down)
    torch.testing.assert_close(dup, one)


def test_oea_fills_only_from_the_union_and_renormalises():
    probs = torch.tensor([[0.40, 0.05, 0.05, 0.30, 0.15, 0.05],
                          [0.05, 0.50, 0.20, 0.05, 0.10, 0.10]])
    ids = probs.topk(3).indices
    w = probs.gather(1, ids)
    new_ids, new_w = OeaPolicy(k0=1).route(0, probs, ids, w / w.sum(1, keepdim=True), None)
    union = {0, 1}  # everyone's top-1
    assert set(new_ids[:, 1:].unique().tolist()) <= union | set(new_ids[:, :1].reshape(-1).tolist())
    assert new_ids[0].tolist()[:2] == [0, 1] and new_ids[1].tolist()[:2] == [1, 0]
    torch.testing.assert_close(new_w.sum(1), torch.ones(2))
    assert new_w[0, 2] == 0 and new_w[1, 2] == 0  # no third union member: empty slot, weight 0


PROMPTS = [list(range(10 + i, 30 + i)) for i in range(16)]


def run(checkpoint, policy: RoutingPolicy, n=16, steps=12):
    eng = LLMEngine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=128, max_model_len=256,
                                             max_num_batched_tokens=512))  # CPU tables (GPU: test_engine_cuda)
    eng.set_routing_policy(policy)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True)) for p in PROMPTS[:n]]
    while eng.has_work:
        eng.step()
    return [s.output_ids for s in seqs], eng.routing_stats


def random_tables(seed=0, layers=4, experts=16):
    g = torch.Generator().manual_seed(seed)
    sim = torch.rand(layers, experts, experts, generator=g)
    sim = (sim + sim.transpose(1, 2)) / 2
    return sim, torch.zeros(layers, experts, dtype=torch.bool), {i: i for i in range(layers)}


def test_sere_above_one_is_exactly_topk(tiny_checkpoint):
    want, base = run(tiny_checkpoint, RoutingPolicy())
    got, stats = run(tiny_checkpoint, SerePolicy(*random_tables(), primary_k=2, threshold=1.5))
    s = stats.snapshot()
    assert got == want and s["rerouted_slots"] == 0 and s["union_after"] == s["union_before"]


def test_sere_shrinks_the_mean_union_of_a_16_request_batch(tiny_checkpoint):
    _, base = run(tiny_checkpoint, RoutingPolicy())
    _, stats = run(tiny_checkpoint, SerePolicy(*random_tables(), primary_k=2, threshold=0.0))
    s, b = stats.snapshot(), base.snapshot()
    assert s["rerouted_slots"] > 0
    assert s["union_after"] / s["layer_steps"] < b["union_after"] / b["layer_steps"]
    assert s["union_before"] >= s["union_after"]


def test_truncate_keeps_the_first_k_experts_renormalised():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    ids = probs.topk(3).indices
    w = probs.gather(1, ids)
    new_ids, new_w = TruncatePolicy(k=2).route(0, probs, ids, w, torch.tensor([False, True]))
    assert new_ids[0].tolist() == [0, 1, 0] and torch.allclose(new_w[0], torch.tensor([0.625, 0.375, 0.0]))
    assert torch.equal(new_ids[1], ids[1]) and torch.equal(new_w[1], w[1])  # opted out


def test_a_snapshot_that_does_not_wait_reads_the_last_landed_copy():
    """snapshot(wait=False) never syncs: on CUDA it returns the sums of the last copy handed to
    landed() (queued beside a step's tokens), never an older one; on the CPU it is snapshot()."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stats = RoutingStats()
    ids = torch.tensor([[0, 1], [1, 2]], device=device)
    stats.add_step([(ids, ids)] * 3, rows=2, num_experts=4)
    one = {"layer_steps": 3, "union_before": 9, "union_after": 9, "rerouted_slots": 0}
    copy = stats.queue_copy()
    stats.add_step([(ids, ids)] * 3, rows=2, num_experts=4)
    if device == "cpu":
        assert copy is None and stats.snapshot(wait=False) == {k: 2 * v for k, v in one.items()}
        return
    assert stats.snapshot(wait=False) == dict.fromkeys(one, 0)  # nothing landed yet
    torch.cuda.synchronize()
    stats.landed(copy)
    assert stats.snapshot(wait=False) == one  # as of the copy, not the step after it
    later = stats.queue_copy()
    assert stats.snapshot() == {k: 2 * v for k, v in one.items()}
    torch.cuda.synchronize()
    stats.landed(copy)  # an older copy handed over late: the sums only grow
    assert stats.snapshot(wait=False) == {k: 2 * v for k, v in one.items()}
    stats.landed(later)
    assert stats.snapshot(wait=False) == {k: 2 * v for k, v in one.items()}


def test_decode_rows_beside_a_chunk_re_route_where_their_decode_batch_would(tiny_checkpoint):
    """Truncation beside a prompt chunk (test_chunked_prefill: the tokens), routing_min_batch 2: one
    decode row keeps its top-K (as a decode step of one would), two re-route; on both paths of such a
    step (prepare_mixed, prompt_rows)."""
    eng = engine(tiny_checkpoint, 64, policy="truncate", routing_min_batch=2)
    streams = [eng.add_request(list(range(10 + i, 20 + i)), SamplingParams(max_tokens=8, ignore_eos=True))
               for i in range(2)]
    while not all(s.output_ids for s in streams):
        eng.step()
    eng.add_request(list(range(30, 42)), SamplingParams(max_tokens=2))
    batch = eng.scheduler.schedule()
    assert [n for _, n in batch] == [1, 1, 12]
    runner = eng.runner
    assert runner.prepare_mixed([batch[0], batch[2]])[1].opt_out is None
    assert runner.prompt_rows([batch[0], batch[2]])[0]["opt_out"].all()
    want = [False, False] + [True] * 12
    assert runner.prepare_mixed(batch)[1].opt_out.tolist() == want
    assert runner.prompt_rows(batch)[0]["opt_out"].tolist() == want


def test_a_new_policy_captures_the_prefill_pieces_again_where_per_token_changes(tiny_checkpoint):
    """The pieces route a step's decode rows or not as the policy was when they were captured."""
    eng = engine(tiny_checkpoint, 12)
    eng.runner.prefill_graphs = first = PrefillGraphs(eng.model, eng.runner.kv, 40, capture=False)
    eng.set_routing_policy(OeaPolicy())  # batch-aware as topk: the same pieces
    assert eng.runner.prefill_graphs is first
    eng.set_routing_policy(TruncatePolicy(k=1))
    again = eng.runner.prefill_graphs
    assert again is not first and again.per_token and again.max_tokens == 40 and not again.captured
