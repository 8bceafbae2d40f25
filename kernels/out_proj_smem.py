"""The folded output projection's launch with every row's weight copied into shared memory before its
PDL wait (Gluon, sm_90 and later): `folded_router._out_proj_logits_kernel`'s contract, and what
`folded_router.folded_moe` launches where the GPU runs it (`folded_router.OUT_PROJ_SMEM`).

Why. At batch 1 the output projection's launch starts while the attention runs, which moves 0.6 MB
and leaves memory idle for about 7 us. The Triton kernel can hold only half of its rows' weight in
registers across its wait (all of it was 2-7 % slower: registers taken from the launches around
it); the rest, 9 MB at the 30B shape, is read after the wait, on the step's critical path. Here
each program asks for its whole share with cp.async into shared memory (32 kB a program of 4 rows
of 4,096 columns) before the wait, so after it only the heads' outputs (8 kB, from L2) are read.
Triton's `tl` reaches shared memory only through its loop pipeliner, which puts no load before an
op that comes ahead of the loop, so the kernel is written in Gluon (`triton.experimental.gluon`),
where the kernel allocates its shared memory and issues the copies itself. Gluon has no
interpreter: only the GPU runs it (the interpreter and GPUs before sm_90 keep the Triton kernel).

Each program keeps at most DEPTH steps (512 columns of its 4 rows, 4 kB) of copies in flight before
the wait, waiting for the oldest before it asks for the next. With every step in flight at once
(17 MB from all 544 programs) the attention running beside the launch took longer than the
projection gained (sessions 55 and 57: the batch-1 step 1-1.5 % slower); at most 2 steps a program,
it was 0.4-1.2 % faster than the Triton kernel at 256- and 4,096-token contexts on an H100 (two runs),
1.0-1.4 % at 256 tokens and even at 4,096 on an H200 (docs/PERFORMANCE.md, session 57).
"""
from __future__ import annotations

from .dependent_launch import wait_for_inputs  # a Triton function, which Gluon calls as its own

from triton.experimental import gluon  # after zipmoe.kernels (the package) chose the interpreter on CPU-only machines
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def _copy_rows(smem, w_ptr, n, N, K: gl.constexpr, BLOCK_K: gl.constexpr, DEPTH: gl.constexpr, layout: gl.constexpr):
    """cp.async of rows n of w [N, K], in steps of BLOCK_K columns, into smem [K / BLOCK_K, BLOCK_N,
    BLOCK_K], a group a step; DEPTH > 0: at most DEPTH steps in flight (the program waits for the
    oldest before it asks for the next)."""
    k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    rows = w_ptr + gl.expand_dims(n.to(gl.int64) * K, 1)
    ok = gl.expand_dims(n < N, 1) & gl.expand_dims(k < BLOCK_K, 0)
    for step in gl.static_range(K // BLOCK_K):
        if DEPTH > 0:
            if step >= DEPTH:
                async_copy.wait_group(DEPTH - 1)
        async_copy.async_copy_global_to_shared(smem.index(step), rows + gl.expand_dims(step * BLOCK_K + k, 0),
                                               mask=ok)
        async_copy.commit_group()


@gluon.jit
def _rows_times(smem, x_ptr, K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """float32 sums [BLOCK_N] of the rows in smem times x [K] (as `gemv.gemv_rows`: a [BLOCK_N,
    BLOCK_K] float32 accumulator over the width's steps, then its sum along the columns)."""
    k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    for step in gl.static_range(K // BLOCK_K):
        x = gl.load(x_ptr + step * BLOCK_K + k).to(gl.float32)
        acc += smem.index(step).load(layout).to(gl.float32) * gl.expand_dims(x, 0)
    return gl.sum(acc, axis=1)


@gluon.jit
def out_proj_logits_smem_kernel(attn_ptr, res_ptr, o_ptr, norm_ptr, gate_r_ptr, gate_o_ptr, h_out_ptr, y_ptr,
                                logits_ptr, acc_ptr, H, E, A: gl.constexpr, HK: gl.constexpr, BLOCK_N: gl.constexpr,
                                BLOCK_K: gl.constexpr, DEPTH: gl.constexpr, ZERO_SLOTS: gl.constexpr,
                                WARPS: gl.constexpr, PDL: gl.constexpr):
    # Programs [0, cdiv(H, BLOCK_N)): rows of h = r + W_o a and y = g * h; the rest: rows of the
    # folded router, (W_r g) r + (W_r g W_o) a in float32 (see `_out_proj_logits_kernel`). The rows'
    # weight over a goes to shared memory before the wait; r, g and the router's sums over r are
    # read before it too, as the Triton kernel reads them.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, WARPS], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    smem = gl.allocate_shared_memory(o_ptr.dtype.element_ty, [A // BLOCK_K, BLOCK_N, BLOCK_K],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    pid = gl.program_id(0)
    out_programs = gl.cdiv(H, BLOCK_N)
    n = gl.arange(0, BLOCK_N, layout=rows_layout)
    if pid < out_programs:
        n = pid * BLOCK_N + n
        _copy_rows(smem, o_ptr, n, H, A, BLOCK_K, DEPTH, layout)
        r = gl.load(res_ptr + n, mask=n < H, other=0.0)
        g = gl.load(norm_ptr + n, mask=n < H, other=0.0)
        wait_for_inputs(PDL)
        async_copy.wait_group(0)
        o = _rows_times(smem, attn_ptr, A, BLOCK_N, BLOCK_K, layout)
        h = (r.to(gl.float32) + o.to(r.dtype).to(gl.float32)).to(r.dtype)
        gl.store(h_out_ptr + n, h, mask=n < H)
        gl.store(y_ptr + n, (g.to(gl.float32) * h.to(gl.float32)).to(h.dtype), mask=n < H)
        for k in gl.static_range(ZERO_SLOTS):
            gl.store(acc_ptr + k * H + n, gl.zeros([BLOCK_N], gl.float32, rows_layout), mask=n < H)
    else:
        e = (pid - out_programs) * BLOCK_N + n
        _copy_rows(smem, gate_o_ptr, e, E, A, BLOCK_K, DEPTH, layout)
        k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        over_r = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        for step in gl.static_range(HK // BLOCK_K):
            w = gl.load(gate_r_ptr + gl.expand_dims(e.to(gl.int64) * HK, 1) + gl.expand_dims(step * BLOCK_K + k, 0),
                        mask=gl.expand_dims(e < E, 1), other=0.0)
            x = gl.load(res_ptr + step * BLOCK_K + k).to(gl.float32)
            over_r += w.to(gl.float32) * gl.expand_dims(x, 0)
        wait_for_inputs(PDL)
        async_copy.wait_group(0)
        o = _rows_times(smem, attn_ptr, A, BLOCK_N, BLOCK_K, layout)
        gl.store(logits_ptr + e, gl.sum(over_r, axis=1) + o, mask=e < E)
