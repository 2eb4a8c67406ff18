"""The forward's per-element mask of one S tile held as (rows, cols)
register fragments (the mask of kernel_api.h, and equal segment ids for the
packed-document variant)."""

import cutlass
import cutlass.cute as cute


@cute.jit
def apply_mask(
    acc_S_mn, tScS, row_start, n_start, q_len, kv_len,
    diag_offset, window_left, window_right, row_seg=None, col_seg=None,
):
    """Set S to -inf where row i may not see column j (kernel_api.h)."""
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        row = row_start + tScS[r, 0][0]
        col_lo = cutlass.Int32(0)
        if window_left >= 0:
            col_lo = row + diag_offset - window_left
        col_hi = kv_len
        if window_right >= 0:
            col_hi = cutlass.min(row + diag_offset + window_right + 1, kv_len)
        if row >= q_len:
            col_hi = cutlass.Int32(0)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            col = n_start + tScS[0, c][1]
            if cutlass.const_expr(row_seg is not None):
                if col < col_lo or col >= col_hi or row_seg[r] != col_seg[c]:
                    acc_S_mn[r, c] = -cutlass.Float32.inf
            elif col < col_lo or col >= col_hi:
                acc_S_mn[r, c] = -cutlass.Float32.inf
