"""One token's MoE block with the router folded into the output projection (`folded_moe`, two
launches, or three with the down GEMM apart) against its unfolded reference (CPU: Triton's
interpreter, float32; GPU: bf16 at the 30B shape, and in a CUDA graph), keeping the top-K, or, as
OEA and truncation leave a lone token, its first experts, or re-routing its later slots as SERE
does; and the reference against those policies."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zipmoe.engine.engine import EngineConfig, LLMEngine
from zipmoe.engine.routing import OeaPolicy, SerePolicy, TruncatePolicy
from zipmoe.kernels import dependent_launch, fold_routing, folded_router
from zipmoe.kernels.folded_router import fold_router, folded_moe, folded_moe_reference
from zipmoe.kernels.router import add_norm_router_reference

import triton  # after zipmoe.kernels, which chose the interpreter on machines without CUDA
import triton.language as tl

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _block(device, H, A, E, I, seed=0, spread=4.0):
    """Inputs of one token's block. The router's rows are spread apart (`spread`) so that its top-K
    is clear of the fold's rounding: what the test compares is the arithmetic, not a near-tie."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if device == "cpu" else torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dt)

    h, attn = rand(1, H), rand(1, A)
    o_weight, norm = rand(H, A, scale=A ** -0.5), (torch.rand(H, generator=g) + 0.5).to(device, dt)
    gate = rand(E, H, scale=spread * H ** -0.5)
    gate_up, down = rand(E, 2 * I, H, scale=H ** -0.5), rand(E, I, H, scale=I ** -0.5)
    return (h, attn, o_weight, norm, gate) + fold_router(gate, norm, o_weight) + (gate_up, down)


def _assert_matches(got, want, device, args):
    """float32 (CPU): the same experts, the same values. bf16: an expert may differ from the
    reference's only where both had near-equal router probabilities (the fold rounds otherwise, see
    folded_router.py); outputs are compared on the slots that agree."""
    tol = dict(rtol=1e-4, atol=1e-4) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    h, per_slot, router_ids, ids, weights = got
    per_slot = per_slot.to(want[1].dtype)  # float32 where the gate/up programs sum them (FUSED_DOWN)
    torch.testing.assert_close(h, want[0], **tol)
    same = (router_ids == want[2]) & (ids == want[3])
    if device == "cpu":
        assert same.all()
    else:
        h_ref, attn, o_weight, norm, gate = args[:5]
        probs = add_norm_router_reference(h_ref, F.linear(attn, o_weight), norm, gate, ids.shape[1], True, 1e-6)[2]
        assert torch.allclose(probs.gather(1, router_ids), probs.gather(1, want[2]), rtol=3e-2, atol=1e-4)
        assert same.float().mean() >= 0.75
    torch.testing.assert_close(per_slot[same], want[1][same], **tol)
    if same.all():
        torch.testing.assert_close(weights, want[4], **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H,A,E,I,K,normalize", [(64, 128, 16, 32, 4, True), (96, 80, 60, 48, 8, False),
                                                 (40, 64, 7, 16, 2, True), (64, 64, 16, 32, 1, True)])
def test_folded_moe_matches_reference(device, H, A, E, I, K, normalize):
    """Sizes not powers of two, experts not a multiple of the GEMV's rows a program, both
    normalisations, a single expert a token; twice in a row (nothing left over from a call)."""
    args = _block(device, H, A, E, I, seed=H + E)
    want = folded_moe_reference(*args, K, normalize, K, normalize, None, 1e-6)
    for _ in range(2):
        _assert_matches(folded_moe(*args, K, normalize, K, normalize, None, 1e-6), want, device, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("load_ahead", [0.0, 0.5, 1.0])
def test_folded_moe_loads_any_share_of_its_rows_ahead(device, load_ahead, monkeypatch):
    """None, half (as committed) or all of the output projection's and router's rows over a loaded
    ahead of the wait, and of the down GEMM's rows, as its own launch, over an expert's width of 160
    (two steps of the loop and a short one: the loop goes on after the rows ahead)."""
    monkeypatch.setattr(dependent_launch, "load_ahead", load_ahead)
    test_folded_moe_matches_reference(device, 64, 128, 16, 160, 4, True)
    monkeypatch.setattr(folded_router, "FUSED_DOWN", False)
    test_folded_moe_matches_reference(device, 64, 128, 16, 160, 4, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columns", [0, 12])
def test_folded_moe_gate_up_programs_take_columns_short_of_their_tile(device, columns, monkeypatch):
    """A gate/up program's columns as many as its tile's width (0), or fewer (a power of two): 12 of
    16 (tl.dot's least), 14 programs an expert of 160, the last past the width. The other tests take
    the committed 24 of 32."""
    monkeypatch.setattr(folded_router, "FOLD_COLUMNS", columns)
    test_folded_moe_matches_reference(device, 64, 128, 16, 160, 4, True)


@pytest.mark.parametrize("device", DEVICES)
def test_folded_moe_gate_up_programs_rank_block_wide(device, monkeypatch):
    """Each gate/up program's expert from the routing program's block-wide top-K (`RANK_IN_WARPS`
    off, as before session 51), which the other tests rank within each warp."""
    monkeypatch.setattr(folded_router, "RANK_IN_WARPS", False)
    test_folded_moe_matches_reference(device, 96, 80, 60, 48, 8, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused,down_n,down_ahead", [(True, 32, 0), (True, 128, 64), (False, 256, 0)])
def test_folded_moe_runs_the_down_gemm_either_way(device, fused, down_n, down_ahead, monkeypatch):
    """The down GEMM in the gate/up programs (FUSED_DOWN, the other tests: 256 rows a step), adding
    into the slots' float32 sums, at other rows a step (H a multiple of them, or not) and rows loaded
    before the gate/up loop; or as a launch of its own (FUSED_DOWN off). With the experts ranked within
    each warp or block-wide, columns short of a tile, OEA's kept slots (weights renormalised or not, a
    token that opted out) and SERE's moves, whose weights the gate/up programs work out themselves."""
    monkeypatch.setattr(folded_router, "FUSED_DOWN", fused)
    monkeypatch.setattr(folded_router, "DOWN_N", down_n)
    monkeypatch.setattr(folded_router, "DOWN_AHEAD", down_ahead)
    test_folded_moe_matches_reference(device, 64, 128, 16, 32, 4, True)
    test_folded_moe_matches_reference(device, 96, 80, 60, 48, 8, False)
    test_folded_moe_gate_up_programs_take_columns_short_of_their_tile(device, 12, monkeypatch)
    test_folded_moe_gate_up_programs_rank_block_wide(device, monkeypatch)
    for keep, keep_normalize, opt_out in [(2, True, None), (1, False, False), (3, True, True)]:
        test_folded_moe_keeps_the_first_experts(device, keep, keep_normalize, opt_out)
    test_folded_moe_reroutes_as_sere(device, 2, False)
    if device == "cpu":
        test_folded_moe_op_schema_and_fake()  # the fake's output dtype
    else:
        test_folded_moe_30b_shape_in_a_cuda_graph()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep,keep_normalize", [(2, True), (1, False), (3, True)])
@pytest.mark.parametrize("opt_out", [None, False, True])
def test_folded_moe_keeps_the_first_experts(device, keep, keep_normalize, opt_out):
    """A lone token keeping its first `keep` experts: the other slots at its first expert with weight
    0 and outputs 0; a token that opted out keeps its top-K and the router's weights."""
    args = _block(device, 64, 128, 16, 32, seed=keep)
    flag = None if opt_out is None else torch.tensor([opt_out], device=device)
    want = folded_moe_reference(*args, 4, True, keep, keep_normalize, flag, 1e-6)
    got = folded_moe(*args, 4, True, keep, keep_normalize, flag, 1e-6)
    _assert_matches(got, want, device, args)
    dropped = slice(4 if opt_out else keep, None)
    assert (got[4][:, dropped] == 0).all() and (got[1][:, dropped] == 0).all()
    assert (got[3][:, dropped] == got[2][:, :1]).all()


def _sere_tables(E: int, seed: int = 0):
    """A similarity table [E, E] in [0, 1) and a protection mask [E] (about a quarter protected)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(E, E, generator=g), torch.rand(E, generator=g) < 0.25


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("primary_k", [1, 2])
@pytest.mark.parametrize("opt_out", [None, False, True])
def test_folded_moe_reroutes_as_sere(device, primary_k, opt_out):
    """A lone token's later slots moved to its most similar primary (protected experts and slots
    under the threshold stay; a token that opted out keeps its top-K), the weights kept; a moved
    slot computes its primary's expert again."""
    args = _block(device, 64, 128, 16, 32, seed=3)
    similarity, protect = (t.to(device) for t in _sere_tables(16))
    flag = None if opt_out is None else torch.tensor([opt_out], device=device)
    sere = (similarity, protect, primary_k, 0.5)
    want = folded_moe_reference(*args, 8, True, 8, True, flag, 1e-6, *sere)
    assert (want[3] != want[2]).any() != bool(opt_out)  # the case moves some slot, unless opted out
    for _ in range(2):
        _assert_matches(folded_moe(*args, 8, True, 8, True, flag, 1e-6, *sere), want, device, args)


@pytest.mark.parametrize("policy", [OeaPolicy(2, normalize=True), OeaPolicy(3, normalize=False),
                                    TruncatePolicy(2, normalize=True),
                                    SerePolicy(*(t[None] for t in _sere_tables(16)), {0: 0}, primary_k=2)],
                         ids=["oea", "oea-raw", "truncate", "sere"])
@pytest.mark.parametrize("opt_out", [False, True])
def test_reference_routes_a_lone_token_as_the_policy(policy, opt_out):
    """`one_token_route` says what the policy does to one token: the reference given it routes as the
    policy's own `route` after the router."""
    args = _block("cpu", 64, 128, 16, 32)
    h, attn, o_weight, norm, gate = args[:5]
    route = policy.one_token_route(0, 4, True)
    flag = torch.tensor([opt_out])
    _, _, router_ids, ids, weights = folded_moe_reference(*args, 4, True, route.keep, route.normalize, flag, 1e-6,
                                                          route.similarity, route.protect, route.primary_k,
                                                          route.threshold)
    _, _, probs, top_ids, top_w = add_norm_router_reference(h, F.linear(attn, o_weight), norm, gate, 4, True, 1e-6)
    want_ids, want_w = policy.route(0, probs, top_ids, top_w, flag)
    assert torch.equal(router_ids, top_ids) and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)


def test_fold_is_the_norm_then_the_router():
    """(W_r g) r + (W_r g W_o) a, scaled by 1 / RMS(h), is the router's logits of rms_norm(h)."""
    h, attn, o_weight, norm, gate, gate_r, gate_o, _, _ = _block("cpu", 64, 128, 16, 32)
    full = h + attn @ o_weight.T
    x = full * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    folded = (h @ gate_r.T + attn @ gate_o.T) * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(folded, x @ gate.T, rtol=1e-4, atol=1e-4)


def test_folded_moe_op_schema_and_fake():
    args = _block("cpu", 64, 128, 16, 32)
    for keep, opt_out in ((4, None), (2, torch.tensor([False]))):
        torch.library.opcheck(torch.ops.zipmoe.folded_moe.default, args + (4, True, keep, True, opt_out, 1e-6),
                              test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.zipmoe.folded_moe.default,
                          args + (4, True, 4, True, None, 1e-6) + _sere_tables(16) + (2, 0.5),
                          test_utils=("test_schema", "test_faketensor"))


def test_folded_moe_refuses_more_than_one_token():
    h, attn, *rest = _block("cpu", 64, 128, 16, 32)
    with pytest.raises(ValueError, match="one token"):
        folded_moe(h.repeat(2, 1), attn.repeat(2, 1), *rest, 4, True, 4, True, None, 1e-6)
    with pytest.raises(ValueError, match="keeps 1 to top_k"):
        folded_moe(h, attn, *rest, 4, True, 5, True, None, 1e-6)
    similarity, protect = _sere_tables(16)
    for keep, primary_k, sim in ((2, 2, similarity), (4, 4, similarity), (4, 2, similarity[:8]),
                                 (4, 2, similarity.double())):
        with pytest.raises(ValueError, match="re-routes as SERE"):
            folded_moe(h, attn, *rest, 4, True, keep, True, None, 1e-6, sim, protect, primary_k, 0.5)


@pytest.mark.gpu
def test_folded_moe_30b_shape_in_a_cuda_graph():
    """Qwen3-30B-A3B's block (H 2048, 32 x 128 heads, 128 experts of 768, top-8), captured once and
    replayed with another token, twice: the replays give the new token's routing and outputs."""
    args = list(_block("cuda", 2048, 4096, 128, 768, spread=8.0))
    static_h, static_attn = args[0].clone(), args[1].clone()
    torch.cuda.synchronize()
    folded_moe(static_h, static_attn, *args[2:], 8, True, 8, True, None, 1e-6)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = folded_moe(static_h, static_attn, *args[2:], 8, True, 8, True, None, 1e-6)
    fresh = _block("cuda", 2048, 4096, 128, 768, seed=7, spread=8.0)
    static_h.copy_(fresh[0])
    static_attn.copy_(fresh[1])
    graph.replay()
    graph.replay()  # twice: nothing of the first replay left in the second (FUSED_DOWN's sums zeroed)
    want = folded_moe_reference(fresh[0], fresh[1], *args[2:], 8, True, 8, True, None, 1e-6)
    _assert_matches(out, want, "cuda", fresh)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["topk", "sere"])
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_output_projection_in_shared_memory_matches_the_triton_kernel(policy, depth, monkeypatch):
    """At the 30B shape the output projection's launch is `out_proj_smem`'s (Gluon, its rows copied
    into shared memory before the wait, every step or at most `depth` in flight); with OUT_PROJ_SMEM
    off, the Triton kernel's. Both give the same routing and, within their sums' order, the same h
    and slot outputs."""
    monkeypatch.setattr(folded_router, "OUT_PROJ_SMEM", True)
    monkeypatch.setattr(folded_router, "OUT_PROJ_SMEM_DEPTH", depth)
    args = _block("cuda", 2048, 4096, 128, 768, seed=3, spread=8.0)
    assert folded_router._out_proj_in_shared_memory(args[0], 4096, 512)
    sere = ()
    if policy == "sere":
        sim = torch.rand(128, 128, generator=torch.Generator().manual_seed(5)).cuda()
        sere = (sim, torch.zeros(128, dtype=torch.bool, device="cuda"), 2, 0.5)
    got = folded_moe(*args, 8, True, 8, True, None, 1e-6, *sere)
    monkeypatch.setattr(folded_router, "OUT_PROJ_SMEM", False)
    want = folded_moe(*args, 8, True, 8, True, None, 1e-6, *sere)
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[4], want[4], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("limit,folded", [(folded_router.FOLD_MAX_EXPERTS, True), (1, False)])
def test_the_model_folds_its_routers_up_to_the_expert_limit(tiny_checkpoint, monkeypatch, limit, folded):
    """Every MoE layer gets its folded rows at load, unless it has more experts than the rank pass
    was built for; then `_folded_route` keeps the unfolded router."""
    monkeypatch.setattr(folded_router, "FOLD_MAX_EXPERTS", limit)
    eng = LLMEngine(tiny_checkpoint, EngineConfig(num_kv_blocks=8, block_size=16, max_model_len=64,
                                                  max_num_batched_tokens=64))
    moe = [layer for layer in eng.model.layers if layer.is_moe]
    assert moe and all((layer.gate_r is not None) == folded for layer in moe)


@triton.jit
def _top_k_ids_kernel(logit_ptr, ids_ptr, E, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      PACKED: tl.constexpr):
    e = tl.arange(0, E_PAD)
    ids, _ = fold_routing.top_k_ids(tl.load(logit_ptr + e, mask=e < E, other=float("-inf")), e, K, K_PAD, PACKED)
    tl.store(ids_ptr + tl.arange(0, K_PAD), ids, mask=tl.arange(0, K_PAD) < K)


@triton.jit
def _ranked_expert_kernel(logit_ptr, ids_ptr, weights_ptr, kept, E, K: tl.constexpr, E_PAD: tl.constexpr,
                          PACKED: tl.constexpr, DTYPE: tl.constexpr, WARPS: tl.constexpr):
    slot = tl.program_id(0)
    expert, weight = fold_routing.ranked_expert(logit_ptr, 1.0, slot, kept, E, DTYPE, K, E_PAD, PACKED, WARPS,
                                                True, True, True)
    tl.store(ids_ptr + slot, expert)
    tl.store(weights_ptr + slot, weight)


def _ranked(logits: list[float]) -> list[int]:
    """The experts in rank order: a NaN first, then the larger logit, then the lower id."""
    return sorted(range(len(logits)), key=lambda i: (logits[i] == logits[i], -logits[i] if logits[i] == logits[i]
                                                     else 0.0, i))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_top_k_ids_rank_larger_logits_then_lower_ids(device, packed):
    """The routing program's top-K (K rounds of a max over one integer key an expert) and each gate/up
    program's expert (`ranked_expert`, the same rounds within each warp, with its weight) against a sort,
    on logits with many ties that are bfloat16 values (what PACKED keys assume, exactly): negative
    and positive, -0.0 beside +0.0, -inf, a NaN (ahead of all, as torch.topk has it), experts not a
    power of two. The ids are always distinct experts."""
    g = torch.Generator().manual_seed(7)
    E, K = 100, 8
    for case in range(6):
        logits = (torch.randint(-6, 6, (E,), generator=g) / 4.0).to(torch.bfloat16).float()  # ties everywhere
        logits[torch.randperm(E, generator=g)[:6]] = torch.tensor([0.0, -0.0, -0.0, float("-inf"), 1e-30, -1e-30])
        if case % 2:
            logits[case * 7] = float("nan")
        if case >= 4:  # the largest are zeros, of both signs
            logits = -logits.abs()
            logits[(logits == 0) & (torch.arange(E) % 2 == 0)] = 0.0
        logits = logits.to(device)
        ids = torch.empty(K, dtype=torch.int64, device=device)
        _top_k_ids_kernel[(1,)](logits, ids, E, K=K, K_PAD=8, E_PAD=128, PACKED=packed)
        assert ids.tolist() == _ranked(logits.tolist())[:K], case
        for warps, kept in ((4, K), (8, 3)):  # each slot's expert as the GEMM programs rank it, warp by warp
            ids.fill_(-1)
            weights = torch.empty(K, device=device)
            _ranked_expert_kernel[(K,)](logits, ids, weights, kept, E, K=K, E_PAD=128, PACKED=packed,
                                        DTYPE=tl.bfloat16 if packed else tl.float32, WARPS=warps, num_warps=warps)
            assert ids.tolist() == _ranked(logits.tolist())[:K], (case, warps)
            if not logits.isnan().any():  # the weights renormalised over the first `kept` slots
                p = torch.softmax(logits.cpu(), 0)[ids.cpu()]
                want = torch.where(torch.arange(K) < kept, p / p[:kept].sum(), 0.0)
                torch.testing.assert_close(weights.cpu(), want, rtol=1e-5, atol=1e-7)
