"""Decode attention over the engine's paged KV cache: a Triton split-K kernel and its reference.

One query token per sequence attends to its whole context, whose keys and values lie scattered
over the cache in blocks named by the sequence's block table (engine/kv_cache.py). The reference
gathers every context into a dense [B, max_ctx, kv_heads, head_dim] copy; the kernel (what the
engine runs on CUDA) reads the blocks in place instead.

Why it is shaped this way:
- The launch grid is (sequence, kv head, split), with the number of splits taken from the batch
  shape alone, never from context_lens' contents: nothing is read back to the host, so a decode
  step can be captured in a CUDA graph once per batch shape and replayed with new block tables and
  context lengths written in place. Each program takes its share of its own context, the context
  cut into `splits` chunks of whole key tiles; splits a short context does not reach return at once.
- Splitting each context ("flash-decoding") gives small decode batches enough programs to fill the
  GPU; large batches fill it with few splits. The number of programs does not grow with the
  table's width: a graph's tables are padded to max_model_len, and a grid of fixed-size
  partitions over them launched thousands of programs that only returned (an H200 sweep at the
  30B shape, partitions of 256 keys, B=64 with 1k contexts: 70 us in a 32k-wide table against 55 us
  in an exact one).
- The split count depends on the batch shape, so a sequence's output can differ in the last bits
  with its batch (as the GEMMs' do, whose kernels cuBLAS picks by shape).
- The splits' (max, sum, acc) are merged with log-sum-exp weights by the last program of their
  (sequence, kv head) to finish (`kernels/arrivals.py`), not by a second kernel; a context that
  one split holds whole is written out by its only program directly.
- One program serves all the query heads of a GQA group (Qwen3-30B-A3B: 8 q heads per kv head),
  so each K/V tile is read from memory once per group rather than once per query head, and the
  group's scores come from one tl.dot.
- Under PDL each program loads its first tile of keys and values before its wait, while the q/k/v
  launch before still runs (`keys_ahead`): the lengths and block tables are copied in before the
  step, and the only key a decode step writes is each sequence's newest, which the program loads
  after the wait into its place. That, with 64 keys a tile (a tile of 128 held in registers
  across the wait made the step slower than none ahead), made the batch-1 step 4 % faster and the
  batch-64 one 3 % than 128 keys after the wait, the choice before (graph replay on an H100,
  session 38: docs/PERFORMANCE.md). After the wait a program asks for that key and value and for
  q at once, their slot looked up before it (session 39: three waits on L2 there were one).
  Only where the launch's programs are all resident at once (KEYS_AHEAD_PER_SM): a program that
  holds its keys across the wait holds its multiprocessor too, and at batches 16 and 64 (then 1,024
  programs) the step was 1-4 % faster with the keys loaded after the wait (session 42, H100).
- The last program of a split context merges the splits MERGE_AT_ONCE a round, loading their
  partials together: four a round made the batch-1 step 1.3 % faster at a 4,096-token context (16
  splits) and changed nothing measurable at 256 tokens or at batches 16 and 64 (session 42, H100;
  sixteen a round was as fast at 4,096 tokens, 0.5 % slower at 256).
"""
from __future__ import annotations

import functools

import torch

from .arrivals import arrival_counters, last_to_arrive
from .dependent_launch import launch_options, wait_for_inputs

import triton  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
import triton.language as tl

# Programs one launch aims for: B x kv heads x splits, splits at most MAX_SPLITS (the last program
# merges them, MERGE_AT_ONCE a round). At the 30B shape (4 kv heads): 16 splits up to B=8, 8 at B=16,
# 2 at B=64, 1 from B=128 on. 512, where 1,024 were aimed for before session 53 (16 splits at B=16, 4
# at B=64, taken from the attention alone): the decode step 0.2-2.3 % faster at batch 16 and 1.1-3.6 %
# at 64, over contexts of 256 to 2,048 tokens (graph replay on an H100, bench_step_knobs'
# "splits_large" set); 2,048 slower, and batches up to 8 keep their 16 splits.
TARGET_PROGRAMS = 512
MAX_SPLITS = 16
# Splits the last program merges a round (`_merge_split`), their partials' loads in flight together.
MERGE_AT_ONCE = 4
MAX_GROUPS = 1 << 16  # (sequence, kv head) pairs in one launch: one arrival counter each (256 kB)
# Each program loads its first tile of keys and values, all but the newest key, before its PDL
# wait (`_partition_kernel`), where the launch has at most KEYS_AHEAD_PER_SM programs per
# multiprocessor (an H100 holds two of them, by their registers; at the 30B shape batch 1 has 64
# programs, 4 has 256, 16 and 64 have 512); the benchmarks set it off (bench_one_token,
# bench_step_knobs).
keys_ahead = True
KEYS_AHEAD_PER_SM = 2


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     block_size: int, scale: float) -> torch.Tensor:
    """q [B, Hq, D], k/v_cache [slots, Hkv, D], block_tables [B, max_blocks], context_lens [B] -> [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    positions = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    slots = block_tables.long()[:, positions // block_size] * block_size + positions % block_size  # [B, L]
    keys = k_cache[slots].float().repeat_interleave(Hq // Hkv, dim=2)  # [B, L, Hq, D]
    vals = v_cache[slots].float().repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    valid = (positions[None, :] < context_lens.long()[:, None])[:, None, :]  # [B, 1, L]
    scores = scores.masked_fill(~valid, float("-inf"))
    # An empty context has no finite score; its max is taken as 0 so that it sums to 0, not NaN.
    m = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhl,blhd->bhd", p, vals) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    return out.to(q.dtype)


@triton.jit
def _slots(tables_ptr, seq, pos, load, stride_tb, BLOCK_SIZE: tl.constexpr):
    """The cache slots of one sequence's context positions pos, where `load` (0 elsewhere, nothing read)."""
    block = tl.load(tables_ptr + seq.to(tl.int64) * stride_tb + pos // BLOCK_SIZE, mask=load, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _keys_and_values(k_ptr, v_ptr, slot, kv_head, load, d, stride_ks, stride_kh, stride_vs, stride_vh):
    """The keys and values at cache slots `slot` of one kv head, where `load` ([BLOCK_N, HEAD_DIM]
    tiles; zeros elsewhere, nothing read there)."""
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=load[:, None], other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=load[:, None], other=0.0)
    return k, v


@triton.jit
def _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """The running (max, sum, acc) of the group's heads after one tile of keys (online softmax, base 2)."""
    # Scaled after the dot, in fp32: scaling q first would round it to bf16 a second time.
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, arrivals_ptr, out_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_tb,
    table_len,  # keys the block table can name: a longer context is read no further (as the reference)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, AHEAD: tl.constexpr,
    MERGE_AT_ONCE: tl.constexpr, PDL: tl.constexpr,
):
    if not AHEAD:
        wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    splits = tl.num_programs(2)
    ctx = tl.minimum(tl.load(lens_ptr + seq), table_len)
    chunk = tl.cdiv(tl.cdiv(ctx, splits), BLOCK_N) * BLOCK_N  # whole key tiles; 0 for an empty context
    start = part * chunk
    end = tl.minimum(start + chunk, ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_N)
    # AHEAD: the first tile's keys and values but the newest are loaded before the wait, while the
    # q/k/v launch before still runs: the lengths and tables are copied in before the step, and the
    # only key a decode step writes is each sequence's newest, the one loaded after the wait.
    # The tile's slots, the newest key's too, are looked up before the wait as well.
    pos = start + offs
    slot = _slots(tables_ptr, seq, pos, pos < end, stride_tb, BLOCK_SIZE)
    if AHEAD:
        early = (pos < end) & (pos < ctx - 1)
    else:
        early = pos < end
    k, v = _keys_and_values(k_ptr, v_ptr, slot, kv_head, early, d, stride_ks, stride_kh, stride_vs, stride_vh)
    if AHEAD:
        wait_for_inputs(PDL)
    q_heads = kv_head * GROUP + g
    store = g < GROUP
    out_rows = out_ptr + seq.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + d[None, :]
    if (ctx == 0) & (part == 0):  # an empty context has no split to merge: its output is 0
        tl.store(out_rows, tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=store[:, None])
    if start >= ctx:
        return  # only the splits a context reaches check in

    if AHEAD:  # the newest key and value, which the launch before wrote: asked for with q, one wait on L2
        newest = (pos < end) & (pos == ctx - 1)
        k_new, v_new = _keys_and_values(k_ptr, v_ptr, slot, kv_head, newest, d, stride_ks, stride_kh, stride_vs,
                                        stride_vh)
    # Rows past the group are padding for tl.dot's minimum tile; they load zeros and are never stored.
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + d[None, :],
                mask=store[:, None], other=0.0)
    if AHEAD:  # into their place
        k = tl.where(newest[:, None], k_new, k)
        v = tl.where(newest[:, None], v_new, v)
    # Every tile visited holds at least one key of the context, so m_i is finite after the first.
    m_i, l_i, acc = _attend(q, k, v, pos < end, tl.full([GROUP_PAD], float("-inf"), tl.float32),
                            tl.zeros([GROUP_PAD], tl.float32), tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32), qk_scale,
                            DOT_PRECISION)
    for tile in range(start + BLOCK_N, end, BLOCK_N):
        pos = tile + offs
        k, v = _keys_and_values(k_ptr, v_ptr, _slots(tables_ptr, seq, pos, pos < end, stride_tb, BLOCK_SIZE), kv_head,
                                pos < end, d, stride_ks, stride_kh, stride_vs, stride_vh)
        m_i, l_i, acc = _attend(q, k, v, pos < end, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    used = tl.cdiv(ctx, chunk)  # at most `splits`: the programs that check in
    if used == 1:  # the whole context was this program's: no split to merge with
        tl.store(out_rows, (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=store[:, None])
        return
    rows = (seq * tl.num_programs(1) * GROUP + q_heads).to(tl.int64) * splits
    tl.store(m_ptr + rows + part, m_i, mask=store)
    tl.store(l_ptr + rows + part, l_i, mask=store)
    tl.store(acc_ptr + (rows + part)[:, None] * HEAD_DIM + d[None, :], acc, mask=store[:, None])
    counter = arrivals_ptr + seq * tl.num_programs(1) + kv_head
    if last_to_arrive(counter, used):  # the last one merges them all
        m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_run = tl.zeros([GROUP_PAD], tl.float32)
        out = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        # MERGE_AT_ONCE splits a round, their loads written before any of their sums, so above 1 they
        # are in flight together (one at a time waits on L2 once per split: 16 times at a 4k context).
        for first in range(0, used, MERGE_AT_ONCE):
            for i in tl.static_range(MERGE_AT_ONCE):
                m_run, l_run, out = _merge_split(m_ptr, l_ptr, acc_ptr, rows, first + i, used, store, d, m_run, l_run,
                                                 out, HEAD_DIM)
        tl.store(out_rows, (out / tl.maximum(l_run, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=store[:, None])


@triton.jit
def _merge_split(m_ptr, l_ptr, acc_ptr, rows, j, used, store, d, m_run, l_run, out, HEAD_DIM: tl.constexpr):
    """The running (max, sum, acc) of the log-sum-exp merge after split j (as it was past `used`)."""
    # .cg: from L2, where the other programs' partials are, never this SM's L1. Padding rows read
    # m = 0, so their weights stay finite (they are never stored). A split past `used` reads
    # m = -inf: weight 0, the running max kept (a max raised to 0 would underflow the sums).
    ok = store & (j < used)
    m = tl.where(j < used, tl.load(m_ptr + rows + j, mask=ok, other=0.0, cache_modifier=".cg"), float("-inf"))
    l = tl.load(l_ptr + rows + j, mask=ok, other=0.0, cache_modifier=".cg")
    a = tl.load(acc_ptr + (rows + j)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0,
                cache_modifier=".cg")
    m_new = tl.maximum(m_run, m)
    w = tl.exp2(m - m_new)  # this split's log-sum-exp weight against the running max
    scale_old = tl.exp2(m_run - m_new)
    return m_new, l_run * scale_old + w * l, out * scale_old[:, None] + w[:, None] * a


def _check(q, k_cache, v_cache, block_tables, context_lens, block_size):
    B, Hq, D = q.shape
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[2] != D:
        raise ValueError(f"k/v cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    Hkv = k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} kv heads")
    if D & (D - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim {D} and block_size {block_size} must be powers of two")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError("block_tables must be [B, max_blocks] and context_lens [B]")


def _tile_config(head_dim: int, block_size: int) -> tuple[int, int, int]:
    """(keys per tile, warps, pipeline stages). A tile spans whole blocks.

    64 keys (4 blocks of 16), 4 warps, 2 stages. Without keys loaded ahead of the wait, 128 keys
    were the best or within 3% of it at head_dim 128 (a sweep of tiles 32/64/128, 4/8 warps and 2/3
    stages over B 1..64 and contexts 1k..4k on an H200). With them, a program holds its first tile in
    registers across the wait, and 128 keys made the decode step slower than loading none ahead; 64
    keys ahead made it the fastest of the four at batches 1, 16 and 64 and contexts of 256 to 4k
    (graph replay on an H100, docs/PERFORMANCE.md, session 38).
    """
    return max(block_size, 64), 4, 2


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def loads_keys_ahead(programs: int, device: torch.device) -> bool:
    """Whether a launch of `programs` programs on `device` loads its first tile of keys ahead of the
    PDL wait: `keys_ahead`, and on a GPU at most KEYS_AHEAD_PER_SM programs per multiprocessor
    (without CUDA, in the interpreter, `keys_ahead` alone: the tests take both paths)."""
    device = torch.device(device)
    return keys_ahead and (device.type != "cuda" or programs <= KEYS_AHEAD_PER_SM * _multiprocessors(device))


def num_splits(batch: int, kv_heads: int, table_len: int, tile: int) -> int:
    """Splits per (sequence, kv head): TARGET_PROGRAMS programs in all, at most MAX_SPLITS, and no
    more than the table has key tiles."""
    return max(1, min(TARGET_PROGRAMS // max(1, batch * kv_heads), MAX_SPLITS, triton.cdiv(table_len, tile)))


def _launch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, tile):
    _check(q, k_cache, v_cache, block_tables, context_lens, block_size)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    if q.stride(2) != 1:
        q = q.contiguous()  # small; the caches are never copied
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the head dimension of the caches must be contiguous")
    block_n, num_warps, num_stages = _tile_config(D, block_size)
    if tile:
        if tile % block_size or tile & (tile - 1) or tile < 16:
            raise ValueError(f"tile {tile} must be a power of two, at least 16 (tl.dot's smallest) and a multiple "
                             f"of block_size {block_size}")
        block_n = tile
    table_len = block_tables.shape[1] * block_size
    splits = num_splits(B, Hkv, table_len, block_n)
    out = torch.empty_like(q)
    m = torch.empty(B, Hq, splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B, Hq, splits, D, device=q.device, dtype=torch.float32)
    if B == 0:
        return out
    if B * Hkv > MAX_GROUPS:
        raise ValueError(f"{B} sequences x {Hkv} kv heads: more than the {MAX_GROUPS} groups one launch merges")
    _partition_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, m, l, acc,
        arrival_counters("paged_decode_attention", q.device, MAX_GROUPS), out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        table_len,
        scale * 1.4426950408889634,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        AHEAD=loads_keys_ahead(B * Hkv * splits, q.device),
        MERGE_AT_ONCE=MERGE_AT_ONCE, num_warps=num_warps, num_stages=num_stages, **launch_options(q.device),
    )
    return out


@torch.library.custom_op("zipmoe::paged_decode_attention", mutates_args=())
def _paged_decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                               scale: float, tile: int = 0) -> torch.Tensor:
    return _launch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, tile)


@_paged_decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, tile=0):
    return torch.empty_like(q)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, tile: int = 0) -> torch.Tensor:
    """Same contract as the reference; block_tables and context_lens are int32 on q's device.

    tile (keys per tile, a power of two and a multiple of block_size; 0: the tuned size) only
    changes how the work is cut; tests lower it to split short contexts and exercise the merge.
    """
    return torch.ops.zipmoe.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                   block_size, scale, tile)
