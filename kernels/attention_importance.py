"""VisionZip patch importance without the attention matrix.

`patch_importance` is the kernel the vision encoder calls on CUDA. `patch_importance_reference`
(same signature and result, what the encoder runs elsewhere) materialises softmax(q k^T * scale)
for every image: heads x N_i x N_i floats, 64 MiB in float32 for one 1024-patch image at 16
heads, hundreds of MiB for large images. What VisionZip needs is only each key's column sum, so
two streaming passes over key/query tiles suffice and memory stays O(P * heads):

  pass 1, per (query tile, head): the row log-sum-exp over the image's keys, with an online
          max/sum as in flash attention;
  pass 2, per (key tile, head):   sum over the image's queries of exp(q.k * scale - lse), each
          column written once into a [heads, P] buffer (no atomics, so the result is
          deterministic), then summed over heads on the host side of the launch.

Images are packed along P and one image never attends to another, so every tile lies inside one
image and loops only over that image's tiles: the host builds small int32 tables
tile -> (tile start, image start, image end) from cu_seqlens. That needs cu_seqlens on the host,
a sync the vision forward already makes.

Accumulation is float32 whatever the input dtype (bf16 on the GPU, float32 in CPU tests, where
the kernels run in Triton's interpreter). head_dim is padded to a power of two with masks
(Qwen3-VL-30B's vision tower has d = 72).
"""
from __future__ import annotations

import torch
from torch import Tensor

# This package's __init__ (always run before this module) selects Triton's interpreter when there is
# no CUDA; it must do so before triton is first imported.
import triton
import triton.language as tl

# Fastest of {64, 128}^2 tiles x {4, 8} warps x {2, 3, 4} stages on an H200 at 30 images x 1024
# patches, 16 heads, d = 72, bf16 (1.83 ms; 64 x 64 tiles: 2.38 ms). Module-level so a sweep can set them.
BLOCK_M = 128  # queries per tile
BLOCK_N = 128  # keys per tile
NUM_WARPS = 4
NUM_STAGES = 3
_LOG2E = 1.4426950408889634


@triton.jit
def _tile_in_image(tiles_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile start and its image's [start, end), and the head-dim lanes in use."""
    tile = tl.program_id(0)
    dims = tl.arange(0, BLOCK_D)
    return (tl.load(tiles_ptr + 3 * tile), tl.load(tiles_ptr + 3 * tile + 1), tl.load(tiles_ptr + 3 * tile + 2),
            dims, dims < D)


@triton.jit
def _load_rows(ptr, first, end, head, stride_p, stride_h, stride_d, dims, dim_ok,
               BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows first..first+BLOCK of one head as [BLOCK, d] ([d, BLOCK] when TRANSPOSED), zero past
    `end` (the image's end) and past d; with the row indices and which of them are in the image."""
    idx = first + tl.arange(0, BLOCK)
    ok = idx < end
    # int64 offsets: P * heads * d can pass 2^31 for very large batches.
    if TRANSPOSED:
        tile = tl.load(ptr + idx.to(tl.int64)[None, :] * stride_p + head * stride_h + dims[:, None] * stride_d,
                       mask=dim_ok[:, None] & ok[None, :], other=0.0)
    else:
        tile = tl.load(ptr + idx.to(tl.int64)[:, None] * stride_p + head * stride_h + dims[None, :] * stride_d,
                       mask=ok[:, None] & dim_ok[None, :], other=0.0)
    return tile, idx, ok


@triton.jit
def _row_lse_kernel(q_ptr, k_ptr, lse_ptr, tiles_ptr, P,
                    stride_qp, stride_qh, stride_qd, stride_kp, stride_kh, stride_kd,
                    scale_log2,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    head = tl.program_id(1)
    start, seg_start, seg_end, dims, dim_ok = _tile_in_image(tiles_ptr, D, BLOCK_D)

    q, rows, row_ok = _load_rows(q_ptr, start, seg_end, head, stride_qp, stride_qh, stride_qd, dims, dim_ok,
                                 BLOCK_M, False)

    # Base-2 throughout (exp2 is the hardware instruction); scale_log2 = scale * log2(e).
    # Padded query rows see s = 0 on every real key, so m is finite after the first tile and no
    # inf - inf can appear; their lse is never stored.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    for kstart in range(seg_start, seg_end, BLOCK_N):
        kt, cols, col_ok = _load_rows(k_ptr, kstart, seg_end, head, stride_kp, stride_kh, stride_kd, dims, dim_ok,
                                      BLOCK_N, True)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        s = tl.where(col_ok[None, :], s, float("-inf"))  # keys of the next image (or past P)
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m = m_new
    tl.store(lse_ptr + head * P + rows, m + tl.log2(l), mask=row_ok)


@triton.jit
def _column_sum_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, tiles_ptr, P,
                       stride_qp, stride_qh, stride_qd, stride_kp, stride_kh, stride_kd,
                       scale_log2,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    head = tl.program_id(1)
    start, seg_start, seg_end, dims, dim_ok = _tile_in_image(tiles_ptr, D, BLOCK_D)

    k, cols, col_ok = _load_rows(k_ptr, start, seg_end, head, stride_kp, stride_kh, stride_kd, dims, dim_ok,
                                 BLOCK_N, False)

    # Transposed scores (keys x queries): the column sums become row sums, and accumulating the
    # probabilities elementwise defers the one cross-lane reduction to after the loop.
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for qstart in range(seg_start, seg_end, BLOCK_M):
        qt, rows, row_ok = _load_rows(q_ptr, qstart, seg_end, head, stride_qp, stride_qh, stride_qd, dims, dim_ok,
                                      BLOCK_M, True)
        # lse = +inf zeroes queries outside the image; padded keys are computed but never stored.
        lse = tl.load(lse_ptr + head * P + rows, mask=row_ok, other=float("inf"))
        s = tl.dot(k, qt, input_precision=PRECISION) * scale_log2
        acc += tl.exp2(s - lse[None, :])
    tl.store(out_ptr + head * P + cols, tl.sum(acc, 1), mask=col_ok)


def patch_importance_reference(q: Tensor, k: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Attention each patch receives, per image, averaged over heads and queries, times N_i.

    q, k: [P, heads, d] of one vision attention layer, all images packed; cu_seqlens: int [N+1]
    image boundaries (attention is full inside an image and never crosses images). Returns [P]
    float32. The factor N_i makes uniform attention 1.0, so images of different sizes are read
    on one scale; each image's values sum to N_i. Materialises softmax(q k^T * scale) per image.
    """
    out = torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        logits = torch.einsum("qhd,khd->hqk", q[start:end].float(), k[start:end].float()) * scale
        out[start:end] = logits.softmax(dim=-1).mean(dim=(0, 1)) * (end - start)
    return out


def _tile_table(bounds: list[int], block: int, device: torch.device) -> Tensor:
    """int32 [tiles, 3]: (tile start, image start, image end); tiles never straddle two images."""
    rows = [(t, s, e) for s, e in zip(bounds[:-1], bounds[1:]) for t in range(s, e, block)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(device, non_blocking=True)


def patch_importance_with_tiles(q: Tensor, k: Tensor, cu_seqlens: Tensor, scale: float,
                                block_m: int | None = None, block_n: int | None = None) -> Tensor:
    """`patch_importance` with the tile shape given (None: BLOCK_M, BLOCK_N). block_m/block_n
    (powers of two >= 16) only change the tiling, so the tests can cover many tiles with small
    images."""
    if q.shape != k.shape or q.dim() != 3:
        raise ValueError(f"q and k must both be [P, heads, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    n_patches, heads, d = q.shape
    block_m, block_n = block_m or BLOCK_M, block_n or BLOCK_N
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != n_patches or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must rise from 0 to P={n_patches}, got {bounds[:4]}...{bounds[-2:]}")
    if n_patches == 0:
        return torch.empty(0, dtype=torch.float32, device=q.device)
    query_tiles = _tile_table(bounds, block_m, q.device)
    key_tiles = _tile_table(bounds, block_n, q.device)

    lse = torch.empty(heads, n_patches, dtype=torch.float32, device=q.device)
    column_sums = torch.empty(heads, n_patches, dtype=torch.float32, device=q.device)
    meta = dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=block_n,
                # float32 inputs (CPU tests, fp32 towers) must match the float32 reference, not TF32.
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    strides = (*q.stride(), *k.stride())
    scale_log2 = float(scale) * _LOG2E
    _row_lse_kernel[(query_tiles.shape[0], heads)](q, k, lse, query_tiles, n_patches, *strides, scale_log2, **meta)
    _column_sum_kernel[(key_tiles.shape[0], heads)](q, k, lse, column_sums, key_tiles, n_patches, *strides,
                                                     scale_log2, **meta)
    return column_sums.sum(0).div_(heads)


@torch.library.custom_op("zipmoe::patch_importance", mutates_args=())
def patch_importance(q: Tensor, k: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Same contract as `patch_importance_reference`: q, k [P, heads, d] (any strides), cu_seqlens
    int [N+1]; returns [P] float32, for each patch the attention it receives summed over its
    image's queries and averaged over heads. A torch op, so traced/compiled code keeps it as one
    opaque node."""
    return patch_importance_with_tiles(q, k, cu_seqlens, scale)


@patch_importance.register_fake
def _(q: Tensor, k: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape[0], dtype=torch.float32)
