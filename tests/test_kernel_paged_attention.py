"""Paged decode attention: the Triton kernel against its reference, and the reference against the
engine's current gather + SDPA decode path. On CPU the kernel runs in Triton's interpreter (fp32,
small shapes); the gpu tests use bf16 at Qwen3-30B-A3B's attention shape and a CUDA graph."""
from __future__ import annotations

import random
from collections import deque

import pytest
import torch
import torch.nn.functional as F

from zipmoe.engine.kv_cache import BlockManager, KVCache
from zipmoe.engine.sequence import SamplingParams, Sequence
from zipmoe.kernels import paged_attention
from zipmoe.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from zipmoe.kernels.qkv_norm_rope import fused_qkv_norm_rope_cache, qkv_norm_rope_cache_reference

BLOCK = 16

# Triton's interpreter trips a numpy deprecation on every loop bound it reads from a tensor.


def make_case(lens: list[int], kv_heads: int, group: int, head_dim: int, dtype=torch.float32, device="cpu",
              block_size: int = BLOCK, spare_blocks: int = 3, seed: int = 0):
    """Random q and cache; each sequence owns its own shuffled (non-contiguous) blocks, and the tables
    are padded with block 0 up to the longest context (plus one more block, as an engine batch may be)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        own = order[at:at + n]
        at += n
        tables.append(own + [0] * (max_blocks - n))
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(device=device, dtype=dtype)
    return (q, k, v, torch.tensor(tables, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device))


# Lengths: one token, empty, mid-block, exactly one block, several blocks ending mid-block, and one
# long enough for several key tiles per split.
LENS = [1, 0, 7, BLOCK, 3 * BLOCK + 5, 18 * BLOCK + 2]


@pytest.mark.parametrize("head_dim,kv_heads,group,tile", [
    (16, 2, 1, 0),  # the tuned tile (64 keys): 5 splits of the table's 320 keys, all 5 used by the longest
    (16, 2, 2, 32),  # 10 splits of one tile each for the longest context, 2 for the 53-key one
    (16, 1, 8, 16),  # 16 splits (MAX_SPLITS): the longest context in 10 chunks of 2 tiles
    (128, 1, 8, 64),
    (128, 2, 2, 0),
])
@pytest.mark.parametrize("keys_ahead", [True, False])
def test_paged_decode_attention_matches_reference(head_dim, kv_heads, group, tile, keys_ahead, monkeypatch):
    monkeypatch.setattr(paged_attention, "keys_ahead", keys_ahead)  # the first tile's keys before the wait or after
    q, k, v, tables, lens = make_case(LENS, kv_heads, group, head_dim)
    scale = 4 * head_dim ** -0.5  # peaked softmax: a stale running max would show
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK, scale, tile)
    ref = paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the empty context
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_rescales_when_later_keys_dominate():
    """Scores that grow along the context: every later tile and split raises the running max, so a
    missed rescale anywhere shows (random scores rarely exercise it)."""
    lens = [20 * BLOCK + 3, 9]
    q, k, v, tables, ctx = make_case(lens, 1, 4, 16)
    q = q.abs() + 1.0
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k[slots] = (pos.float() / n * 2.0)[:, None, None] * torch.ones(16)
    for tile in (16, 0):
        out = paged_decode_attention(q, k, v, tables, ctx, BLOCK, 0.5, tile)
        torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, tables, ctx, BLOCK, 0.5),
                                   rtol=1e-5, atol=1e-5)


def test_keys_ahead_only_where_the_launch_fits_at_once(monkeypatch):
    """An H100's 132 multiprocessors at two programs each: batch 1 (64 programs at the 30B shape) and
    4 (256) load their first tile ahead, 16 and 64 (1,024) after the wait; without CUDA every launch
    follows `keys_ahead` alone (the interpreter tests take both paths)."""
    monkeypatch.setattr(paged_attention, "_multiprocessors", lambda device: 132)
    assert [paged_attention.loads_keys_ahead(n, "cuda") for n in (64, 256, 264, 265, 1024)] == [True] * 3 + [False] * 2
    monkeypatch.setattr(paged_attention, "keys_ahead", False)
    assert not paged_attention.loads_keys_ahead(64, "cuda")
    monkeypatch.undo()
    assert paged_attention.loads_keys_ahead(1 << 20, "cpu")


@pytest.mark.parametrize("merge_at_once", [1, 4, 16])
def test_the_merge_keeps_a_running_max_far_below_zero(merge_at_once, monkeypatch):
    """Scores all about -460 (base 2): the last program merges 6 splits MERGE_AT_ONCE a round, so a
    round may run past the splits used; those must leave the running max where it is (raised to 0,
    every weight would underflow to zero)."""
    monkeypatch.setattr(paged_attention, "MERGE_AT_ONCE", merge_at_once)
    lens = [5 * BLOCK + 3]
    q, k, v, tables, ctx = make_case(lens, 1, 2, 16)
    q = torch.ones_like(q)
    k = -20.0 + 0.5 * k  # q.k about -320: every split's max far below zero
    out = paged_decode_attention(q, k, v, tables, ctx, BLOCK, 1.0, 16)  # 7 splits of 16 keys, 6 used
    ref = paged_decode_attention_reference(q, k, v, tables, ctx, BLOCK, 1.0)
    assert ref.abs().max() > 0.1
    # Scores near -320 carry float32 rounding of about 3e-5 each into their exponentials, and the
    # kernel (base 2) and the reference (base e) round differently: 1e-4 relative apart on some
    # CPUs. The failure this guards against, every weight underflowing, is off by the whole output.
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-4)


def test_a_context_longer_than_its_table_is_read_as_far_as_the_table():
    """A bad context length (past what its table names) reads the table's keys, as the reference
    does, and leaves the arrival counters at zero: the launch after it is still right."""
    q, k, v, tables, lens = make_case([3 * BLOCK + 5, 9], 1, 2, 16)
    long = lens.clone()
    long[0] = 100 * BLOCK
    for ctx in (long, lens):
        out = paged_decode_attention(q, k, v, tables, ctx, BLOCK, 0.5, 16)
        torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, tables, ctx, BLOCK, 0.5),
                                   rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_reads_a_layer_view_of_the_engine_cache():
    """k_cache/v_cache as the engine holds them: kv.k[layer] of the [layers, slots, kvh, d] cache."""
    lens = [5, 2 * BLOCK + 1]
    q, k, v, tables, ctx = make_case(lens, 2, 2, 16, spare_blocks=1)
    kv = KVCache(3, k.shape[0] // BLOCK, BLOCK, 2, 16, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    kv.k[1, :k.shape[0]], kv.v[1, :k.shape[0]] = k, v
    out = paged_decode_attention(q, kv.k[1], kv.v[1], tables, ctx, BLOCK, 0.25, 32)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, tables, ctx, BLOCK, 0.25),
                               rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_op_schema_and_fake():
    q, k, v, tables, lens = make_case([3, 9], 1, 2, 16)
    torch.library.opcheck(torch.ops.zipmoe.paged_decode_attention.default,
                          (q, k, v, tables, lens, BLOCK, 0.25, 64),
                          test_utils=("test_schema", "test_faketensor"))


def test_paged_decode_attention_reference_matches_engine_decode_path():
    """The reference against the engine's gather + SDPA decode path (engine/runner.py builds the
    gather slots and mask from the padded block tables, engine/model.py's decode branch attends)."""
    kv_heads, group, head_dim, layer = 2, 4, 16, 1
    lens = [1, 7, BLOCK, 2 * BLOCK + 3, 50]
    blocks = BlockManager(num_blocks=24, block_size=BLOCK)
    blocks._free = deque(random.Random(0).sample(range(24), 24))  # non-contiguous tables
    kv = KVCache(2, 24, BLOCK, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    kv.k.normal_(generator=torch.Generator().manual_seed(1))
    kv.v.normal_(generator=torch.Generator().manual_seed(2))
    seqs = []
    for i, n in enumerate(lens):
        seq = Sequence(seq_id=i, prompt_ids=list(range(n)), params=SamplingParams())
        blocks.hold(seq, len(seq))
        seqs.append(seq)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(3))
    scale = head_dim ** -0.5

    # The runner's decode inputs: padded tables, each context's slots, and the mask of real positions.
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
    ctx = torch.tensor(lens)
    max_len = max(lens)
    gather_slots = (tables[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)[:, :max_len]
    attn_mask = (torch.arange(max_len)[None, :] < ctx[:, None])[:, None, None, :]
    # engine/model.py, Qwen3VLMoeTextDecoder._attention, decode branch
    keys = kv.k[layer][gather_slots]  # [B, L, kvh, d]
    vals = kv.v[layer][gather_slots]
    o = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), vals.transpose(1, 2),
                                       attn_mask=attn_mask, scale=scale, enable_gqa=True)  # [B, heads, 1, d]
    engine_out = o[:, :, 0, :]

    ref = paged_decode_attention_reference(q, kv.k[layer], kv.v[layer], tables.int(), ctx.int(), BLOCK, scale)
    torch.testing.assert_close(ref, engine_out, rtol=1e-5, atol=1e-5)


def _gpu_lens(batch: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    special = [4096, 1, 0, 1000]  # the longest, one token, empty, mid-block
    return (special + [rng.randint(1, 4096) for _ in range(batch)])[:batch] if batch > 1 else [4096]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_paged_decode_attention_matches_reference_bf16_30b_shape(batch):
    q, k, v, tables, lens = make_case(_gpu_lens(batch, batch), 4, 8, 128, torch.bfloat16, "cuda", seed=batch)
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK, 128 ** -0.5)
    ref = paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, 128 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(16, 2, 1), (16, 1, 2), (16, 2, 8), (128, 8, 1), (128, 4, 2)])
def test_paged_decode_attention_matches_reference_gpu_small_shapes(head_dim, kv_heads, group, dtype):
    q, k, v, tables, lens = make_case(LENS + [600], kv_heads, group, head_dim, dtype, "cuda")
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK, head_dim ** -0.5)
    ref = paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, head_dim ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_paged_decode_attention_replays_in_a_cuda_graph_with_new_tables():
    batch, scale = 16, 128 ** -0.5
    q, k, v, tables, lens = make_case(_gpu_lens(batch, 0), 4, 8, 128, torch.bfloat16, "cuda", seed=0)
    paged_decode_attention(q, k, v, tables, lens, BLOCK, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k, v, tables, lens, BLOCK, scale)
    graph.replay()
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, scale),
                               rtol=2e-2, atol=2e-2)

    # New contents in the same buffers: other lengths (longer and shorter), other blocks, new queries.
    g = torch.Generator(device="cuda").manual_seed(1)
    num_blocks = k.shape[0] // BLOCK
    lens.copy_(torch.randint(0, tables.shape[1] * BLOCK + 1, (batch,), device="cuda", generator=g,
                             dtype=torch.int32))
    lens[0] = tables.shape[1] * BLOCK
    tables.copy_(torch.randint(0, num_blocks, tables.shape, device="cuda", generator=g, dtype=torch.int32))
    q.normal_(generator=g)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, scale),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_the_newest_key_written_by_the_launch_before_is_read_after_the_wait():
    """The q/k/v launch writes each sequence's newest key and value; the attention behind it (PDL,
    in a CUDA graph as the engine runs them) loads its other keys before its wait and that one
    after. The newest rows hold 100 before the q/k/v launch writes normed values there: a stale
    read would dominate the softmax."""
    lens, hq, hkv, D, hidden = [1, 37, 300, 129], 32, 4, 128, 256
    q, k, v, tables, ctx = make_case(lens, hkv, hq // hkv, D, torch.bfloat16, "cuda", seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    newest = torch.tensor([tables[i, (n - 1) // BLOCK].item() * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)],
                          device="cuda")
    x = torch.randn(len(lens), hidden, device="cuda", generator=g).bfloat16()
    weight = (torch.randn((hq + 2 * hkv) * D, hidden, device="cuda", generator=g) / hidden ** 0.5).bfloat16()
    angle = torch.rand(len(lens), D, device="cuda", generator=g) * 6.28
    cos, sin, norm = angle.cos().bfloat16(), angle.sin().bfloat16(), torch.ones(D, device="cuda", dtype=torch.bfloat16)
    k_ref, v_ref = k.clone(), v.clone()
    q_ref = qkv_norm_rope_cache_reference(x, weight, norm, norm, cos, sin, k_ref, v_ref, newest, 1e-6, hq, hkv)
    ref = paged_decode_attention_reference(q_ref, k_ref, v_ref, tables, ctx, BLOCK, D ** -0.5)

    def step():
        q = fused_qkv_norm_rope_cache(x, weight, norm, norm, cos, sin, k, v, newest, 1e-6, hq, hkv)
        return paged_decode_attention(q, k, v, tables, ctx, BLOCK, D ** -0.5)

    step()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        k[newest], v[newest] = 100.0, 100.0
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
