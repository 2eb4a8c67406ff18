"""Which keys a query row sees, and what a NaN or Inf in a V tile does to
the rows that see it (docs/numerics.md, "NaN and Inf"): shared by the
forward kernels (fwd_sm90/value_check.py, fwd_sm80/kernel.py)."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from .nonfinite import WORD_BITS, is_nonfinite

NAN = float("nan")


@cute.jit
def visible_columns(row, q_len, kv_len, diag_offset, window_left, window_right):
    """[col_lo, col_hi): the columns row `row` sees as far as lengths,
    diagonal and window go (kernel_api.h); empty past q_len."""
    col_lo = cutlass.Int32(0)
    if window_left >= 0:
        col_lo = row + diag_offset - window_left
    col_hi = kv_len
    if window_right >= 0:
        col_hi = cutlass.min(row + diag_offset + window_right + 1, kv_len)
    if row >= q_len:
        col_hi = cutlass.Int32(0)
    return col_lo, col_hi


class RowMask:
    """What decides which keys the rows of an output tile see: its first
    row, the mask of kernel_api.h, and with packed documents the rows'
    segment ids (row_seg, one per accumulator row of the thread) and
    mKVSeg."""

    def __init__(self, row_start, q_len, kv_len, diag_offset, window_left, window_right,
                 row_seg=None, mKVSeg=None, batch=None):
        self.row_start = row_start
        self.bounds = (q_len, kv_len, diag_offset, window_left, window_right)
        self.row_seg = row_seg
        self.mKVSeg = mKVSeg
        self.batch = batch


@cute.jit
def poison_seen_columns(acc_O_mn, tOcO, sV_tile, n_start, rows_valid, mask: RowMask):
    """acc_O[r, c] = NaN where row r sees a key of this tile (sV_tile, the
    (head_dim_v, keys) stage) whose value in column c is NaN or Inf. Slow
    (a value at a time, in loops that keep few registers: this runs beside
    the accumulators), for the tiles that hold one."""
    num_rows = cute.size(acc_O_mn, mode=[0])
    num_cols = cute.size(acc_O_mn, mode=[1])
    words = (num_cols + WORD_BITS - 1) // WORD_BITS
    key_lo = cute.make_rmem_tensor(num_rows, Int32)
    key_hi = cute.make_rmem_tensor(num_rows, Int32)
    # Bit c % 32 of word c // 32 of row r: column c of row r turns NaN.
    poisoned = cute.make_rmem_tensor(num_rows * words, Uint32)
    poisoned.fill(0)
    for r in cutlass.range_constexpr(num_rows):
        col_lo, col_hi = visible_columns(mask.row_start + tOcO[r, 0][0], *mask.bounds)
        key_lo[r] = col_lo - n_start
        key_hi[r] = col_hi - n_start
    for j in cutlass.range(rows_valid, unroll=1):
        key_seg = Int32(0)
        if cutlass.const_expr(mask.row_seg is not None):
            key_seg = mask.mKVSeg[mask.batch, n_start + j]
        sees = []
        seen_here = False
        for r in cutlass.range_constexpr(num_rows):
            seen = j >= key_lo[r] and j < key_hi[r]
            if cutlass.const_expr(mask.row_seg is not None):
                seen = seen and mask.row_seg[r] == key_seg
            sees.append(seen)
            seen_here = seen_here or seen
        if seen_here:
            for c in cutlass.range(num_cols, unroll=1):
                bad = is_nonfinite(Float32(sV_tile[tOcO[0, c][1], j]))
                bit = Uint32(1) << Uint32(c % WORD_BITS)
                for r in cutlass.range_constexpr(num_rows):
                    for w in cutlass.range_constexpr(words):
                        if bad and sees[r] and c // WORD_BITS == w:
                            poisoned[r * words + w] = poisoned[r * words + w] | bit
    for r in cutlass.range_constexpr(num_rows):
        for c in cutlass.range_constexpr(num_cols):
            hit = (poisoned[r * words + c // WORD_BITS] >> Uint32(c % WORD_BITS)) & Uint32(1)
            acc_O_mn[r, c] = Float32(NAN) if hit != Uint32(0) else acc_O_mn[r, c]
