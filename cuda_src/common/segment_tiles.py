"""Whether a tile's positions all carry one segment id (packed documents):
the forward kernels (fwd_sm90, fwd_sm80) skip the per-element id mask, or
the NaN checks, where they do."""

import cutlass
import cutlass.cute as cute

from .dsl_common import WARP_SIZE

# segment_key of a span whose positions carry more than one id. A real id of
# this value only makes its spans take the per-position paths.
MIXED = -(2**31)


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


@cute.jit
def segment_key(mSeg: cute.Tensor, batch, start, extent: cutlass.Constexpr):
    """warp_tile_segment as one register: the id, or MIXED where the span
    is not uniform."""
    seg_id, uniform = warp_tile_segment(mSeg, batch, start, extent)
    return seg_id if uniform else cutlass.Int32(MIXED)
