"""The forward's mask: which KV tiles a warpgroup's rows see, and the
per-element mask of one S tile held as (rows, cols) register fragments (the
mask of kernel_api.h, and equal segment ids for the packed-document
variant)."""

import cutlass
import cutlass.cute as cute

from ..common.seen_values import visible_columns
from ..common.segment_tiles import MIXED
from .segment_ids import lane_tile_ids, same_segment, same_segment_masks


@cute.jit
def unseen_leading_tiles(row_start, rows: cutlass.Constexpr, tile_n: cutlass.Constexpr, q_len,
                         kv_len, diag_offset, window_right, n_block_max, num_n_blocks):
    """How many of the CTA's KV tiles, walked from n_block_max - 1 down, no
    row of the `rows` rows from row_start sees: all of them for rows outside
    [0, q_len), else those right of its last row's window."""
    seen_max = n_block_max
    if row_start < 0 or row_start >= q_len:
        seen_max = n_block_max - num_n_blocks
    elif window_right >= 0:
        last_row = cutlass.min(row_start + rows, q_len) - 1
        col_end = cutlass.min(last_row + diag_offset + window_right + 1, kv_len)
        seen_max = cutlass.min(cute.ceil_div(cutlass.max(col_end, 0), tile_n), n_block_max)
    # Uniform by construction; said so, or ptxas serialises the WGMMAs behind
    # a branch it takes for divergent.
    return cute.arch.make_warp_uniform(cutlass.min(cutlass.max(n_block_max - seen_max, 0), num_n_blocks))


@cute.jit
def mask_tile(
    acc_S_mn, tScS, row_start, n_block, tile_n: cutlass.Constexpr, full_lo, full_hi, q_len,
    kv_len, diag_offset, window_left, window_right, row_seg, tile_id, mKVSeg, batch,
):
    """Masks one S tile. Tiles in [full_lo, full_hi) are visible to every row
    as far as lengths, diagonal and window go. For the packed-document variant
    (row_seg given), a tile whose keys all belong to one document (tile_id,
    common/segment_tiles.segment_key) only masks the rows of other documents; any
    other tile compares ids element by element."""
    n_start = n_block * tile_n
    if cutlass.const_expr(row_seg is not None):
        if tile_id != MIXED:
            if n_block < full_lo or n_block >= full_hi:
                apply_mask(acc_S_mn, tScS, row_start, n_start, q_len, kv_len,
                           diag_offset, window_left, window_right)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                if row_seg[r] != tile_id:
                    for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                        acc_S_mn[r, c] = -cutlass.Float32.inf
        else:
            apply_mask(acc_S_mn, tScS, row_start, n_start, q_len, kv_len, diag_offset, window_left,
                       window_right, row_seg, lane_tile_ids(mKVSeg, batch, n_start, tile_n))
    elif n_block < full_lo or n_block >= full_hi:
        apply_mask(acc_S_mn, tScS, row_start, n_start, q_len, kv_len,
                   diag_offset, window_left, window_right)


@cute.jit
def apply_mask(
    acc_S_mn, tScS, row_start, n_start, q_len, kv_len,
    diag_offset, window_left, window_right, row_seg=None, lane_ids=None,
):
    """Set S to -inf where row i may not see column j (kernel_api.h), and
    with row_seg / lane_ids (lane_tile_ids) where their segment ids differ."""
    masks = None
    if cutlass.const_expr(row_seg is not None):
        masks = same_segment_masks(lane_ids, row_seg)
    lane = cute.arch.lane_idx()
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        col_lo, col_hi = visible_columns(row_start + tScS[r, 0][0], q_len, kv_len, diag_offset,
                                         window_left, window_right)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            col = n_start + tScS[0, c][1]
            if cutlass.const_expr(row_seg is not None):
                if col < col_lo or col >= col_hi or not same_segment(masks, r, c, cute.size(lane_ids), lane):
                    acc_S_mn[r, c] = -cutlass.Float32.inf
            elif col < col_lo or col >= col_hi:
                acc_S_mn[r, c] = -cutlass.Float32.inf
