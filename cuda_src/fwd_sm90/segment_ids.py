"""Packed-document helpers of the Hopper forward kernel (has_segments).

Traced into the kernel like any @cute.jit call; kept apart so that kernel.py
stays about the pipeline. The CTA-wide bounds union of common/dsl_common.py
reduces through shared memory behind a CTA barrier; here each warp instead
computes the union itself from global memory (128 rows: 4 loads per lane),
which needs no shared memory, so the plain variant's shared storage and code
stay exactly as they were.
"""

import cutlass
import cutlass.cute as cute

from ..common.dsl_common import INT32_MAX, WARP_SIZE

QUAD = 4  # lanes that share a WGMMA accumulator row


@cute.jit
def warp_bounds_union(mBounds: cute.Tensor, batch, first_row, last_row, rows: cutlass.Constexpr):
    """[min first, max last) of the per-row [first, last) ranges in
    mBounds[batch, first_row .. last_row] (at most `rows` rows; rows with an
    empty range add nothing). Every lane of the calling warp returns it, and
    every warp that asks gets the same answer, so warps with different roles
    agree on a KV range without shared memory or a barrier."""
    lane = cute.arch.lane_idx()
    first = cutlass.Int32(INT32_MAX)
    last = cutlass.Int32(0)
    for i in cutlass.range_constexpr((rows + WARP_SIZE - 1) // WARP_SIZE):
        row = first_row + i * WARP_SIZE + lane
        if row <= last_row:
            b0 = mBounds[batch, row, 0]
            b1 = mBounds[batch, row, 1]
            if b1 > b0:
                first = cutlass.min(first, b0)
                last = cutlass.max(last, b1)
    for i in cutlass.range_constexpr(5):  # butterfly over the 32 lanes
        offset = (WARP_SIZE // 2) >> i
        first = cutlass.min(first, cute.arch.shuffle_sync_bfly(first, offset=offset))
        last = cutlass.max(last, cute.arch.shuffle_sync_bfly(last, offset=offset))
    return first, last


@cute.jit
def lane_tile_ids(mSeg: cute.Tensor, batch, start, extent: cutlass.Constexpr):
    """Segment ids mSeg[batch, start + 32 m + lane] of a tile of `extent`
    columns, m = 0, 1, ...: the warp holds every column's id once, and a
    thread takes those of its accumulator columns by shuffles (column_id).
    Columns past the sequence read its last id (callers mask them anyway).
    Three registers at 80 columns where a thread's own 20 ids took 20: the
    packed-document kernel at head dim 256 spilled."""
    last = mSeg.shape[1] - 1
    lane = cute.arch.lane_idx()
    ids = cute.make_rmem_tensor((extent + WARP_SIZE - 1) // WARP_SIZE, cutlass.Int32)
    for m in cutlass.range_constexpr(cute.size(ids)):
        ids[m] = mSeg[batch, cutlass.min(start + m * WARP_SIZE + lane, last)]
    return ids


@cute.jit
def same_segment_masks(lane_ids, row_seg):
    """Per accumulator row r of this thread and register m of lane_ids
    (lane_tile_ids): bit b of word r * len(lane_ids) + m says whether
    column 32 m + b of the tile carries row r's id. A ballot per row of
    the warp (the 8 quads' rows, in a loop that keeps few registers); the
    ids of a thread's own columns, up to 20, all held at once, made the
    packed-document kernel spill at head dim 256."""
    lane = cute.arch.lane_idx()
    num_rows = cute.size(row_seg)
    words = cute.size(lane_ids)
    masks = cute.make_rmem_tensor(num_rows * words, cutlass.Int32)
    masks.fill(0)
    for quad in cutlass.range(WARP_SIZE // QUAD, unroll=1):
        for r in cutlass.range_constexpr(num_rows):
            row_id = cute.arch.shuffle_sync(row_seg[r], QUAD * quad)
            for m in cutlass.range_constexpr(words):
                same = cute.arch.vote_ballot_sync(lane_ids[m] == row_id)
                if lane // QUAD == quad:
                    masks[r * words + m] = same
    return masks


@cute.jit
def same_segment(masks, r: cutlass.Constexpr, c: cutlass.Constexpr, words: cutlass.Constexpr, lane):
    """Whether accumulator column c (rows-cols view) of this thread carries
    row r's id (same_segment_masks). A WGMMA accumulator's lane l holds the
    columns 8 g + 2 (l % 4) + e, c = 2 g + e: bit (8 g + ...) % 32 of word
    g // 4."""
    g, e = c // 2, c % 2
    bit = 8 * (g % 4) + 2 * (lane % QUAD) + e
    return ((masks[r * words + g // 4] >> bit) & 1) != 0
