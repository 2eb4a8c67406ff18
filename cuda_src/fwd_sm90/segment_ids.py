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

from common.dsl_common import INT32_MAX, WARP_SIZE


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
def load_tile_ids(mSeg: cute.Tensor, batch, start, coords: cute.Tensor, extent: cutlass.Constexpr):
    """Segment ids mSeg[batch, start + coords[i][1]] for this thread's
    columns of a tile of `extent` columns. Only a tile that crosses the end
    of the sequence clamps its columns (callers mask those anyway):
    unclamped loads share one base address and differ by immediates, which
    keeps register pressure down in the consumer loop."""
    num = cute.size(coords)
    seqlen = mSeg.shape[1]
    ids = cute.make_rmem_tensor(num, cutlass.Int32)
    if start + extent <= seqlen:
        for i in cutlass.range_constexpr(num):
            ids[i] = mSeg[batch, start + coords[i][1]]
    else:
        for i in cutlass.range_constexpr(num):
            ids[i] = mSeg[batch, cutlass.min(start + coords[i][1], seqlen - 1)]
    return ids


@cute.jit
def warp_tile_segment(mSeg: cute.Tensor, batch, start, extent: cutlass.Constexpr):
    """(id, uniform): the segment id at column `start` and whether all
    `extent` columns from `start` (clamped to the sequence) hold it. Lanes
    read consecutive columns (coalesced) and vote, so every lane of the warp
    gets the same answer: a tile inside one document then costs a few loads
    instead of an id comparison per score."""
    last = cutlass.min(start + extent, mSeg.shape[1]) - 1
    lane = cute.arch.lane_idx()
    tile_id = mSeg[batch, cutlass.min(start, last)]
    differs = cutlass.Int32(0)
    # A last, partial pass re-reads the final column in its spare lanes.
    for i in cutlass.range_constexpr((extent + WARP_SIZE - 1) // WARP_SIZE):
        differs = differs | (mSeg[batch, cutlass.min(start + i * WARP_SIZE + lane, last)] ^ tile_id)
    return tile_id, cute.arch.vote_all_sync(differs == 0)
