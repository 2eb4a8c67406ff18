"""NaN and Inf in the sm80 backward (FlashBwdSm80; docs/numerics.md, "NaN and
Inf").

The dV, dK and dQ MMAs multiply the zero P and dS of hidden pairs with
whatever dO, Q and K hold, and 0 x NaN is NaN. Full tiles (every pair
visible) need nothing; elsewhere:

- K and V rows past the key length are zeroed at the load. K, loaded once
  per CTA, is checked once (check_keys): a key whose K holds a NaN or Inf
  makes P NaN at every pair that sees it (poison_rows) and the CTA treats
  every tile as partial; the values themselves are zeroed. V needs nothing:
  dP = dO V^T reaches a hidden pair only through dS, which the mask zeroes.
- The mask marks a hidden pair's P with common/hidden_pairs.HIDDEN, and dS
  is zeroed there (zero_where_hidden), whatever dP - delta is.
- Q and dO: a query row whose q or dO holds a NaN or Inf has a lse or delta
  that is not finite (so do rows past the query length, rows without keys
  and the padding past seqlen_q: lse +-inf). A partial tile's threads flag
  their rows' statistics (poison_rows), the barrier before the dV / dK MMAs
  ORs the flags, and only where one is set the NaN and Inf of the stage's Q
  and dO are zeroed before those MMAs (zero_flagged_stage; the S and dP
  MMAs, which read them as loaded, are done). A row whose delta is not
  finite has its P made NaN at every pair it sees, so that the keys it sees
  still get a NaN dV.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.nonfinite import any_nonfinite, barrier_any, is_nonfinite, zero_nonfinite

NAN = float("nan")
# check_keys: the bit that says K held a NaN or Inf (above a thread's columns).
HELD = 1 << 30


@cute.jit
def check_keys(sK, tiled_copy, tScS, tidx, threads: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """Once K's cp.async of this thread is complete (its wait): 0 in every
    thread if K holds no NaN or Inf, else a bitmask of the thread's S
    columns (tScS's mode 1) whose key holds one, with bit HELD set; the
    values are zeroed then. Each thread checks the vectors it loaded, and a
    barrier ORs the answers; the caller's next barrier orders the zeros
    before the MMAs."""
    keys, head_dim = cute.size(sK, mode=[0]), cute.size(sK, mode=[1])
    found = any_nonfinite(sK, tiled_copy, tidx, keys, dtype, row_mode=0)
    key_bad = Int32(0)
    # The same in every thread (a barrier's OR), said so: ptxas would
    # otherwise take the barrier below for divergent code and guard the
    # kernel's later shuffles with branches.
    if cute.arch.make_warp_uniform(barrier_any(found, 0, threads)) != 0:
        key_bad = Int32(HELD)
        for c in cutlass.range_constexpr(cute.size(tScS, mode=[1])):
            key = tScS[0, c][1]
            for d in cutlass.range(head_dim, unroll=1):
                if is_nonfinite(Float32(sK[key, d])):
                    key_bad = key_bad | (1 << c)
        # Every thread read K for its flags before any zeroes it.
        cute.arch.barrier()
        zero_nonfinite(sK, tiled_copy, tidx, keys, dtype, row_mode=0)
    return key_bad


@cute.jit
def poison_rows(acc_P_mn, tScS, sLSE, sDelta, stage, key_bad):
    """On a partial tile, before the mask: P NaN in the columns whose key
    check_keys found a NaN or Inf in, and in the rows whose delta is not
    finite. Returns nonzero if one of this thread's rows has a lse or delta
    that is not finite."""
    num_rows, num_cols = cute.size(acc_P_mn, mode=[0]), cute.size(acc_P_mn, mode=[1])
    if key_bad != 0:
        for c in cutlass.range_constexpr(num_cols):
            if (key_bad >> c) & 1 != 0:
                for r in cutlass.range_constexpr(num_rows):
                    acc_P_mn[r, c] = Float32(NAN)
    flagged = Int32(0)
    for r in cutlass.range_constexpr(num_rows):
        row = tScS[r, 0][0]
        bad_delta = is_nonfinite(sDelta[row, stage])
        if bad_delta or is_nonfinite(sLSE[row, stage]):
            flagged = Int32(1)
        for c in cutlass.range_constexpr(num_cols):
            acc_P_mn[r, c] = Float32(NAN) if bad_delta else acc_P_mn[r, c]
    return flagged


@cute.jit
def zero_flagged_stage(rows_flagged, sQ, sdO, tiled_copy, tidx, threads: cutlass.Constexpr,
                       dtype: cutlass.Constexpr):
    """On a partial tile, in place of the barrier before the dV and dK MMAs:
    the barrier ORs the threads' rows_flagged (poison_rows); set, every
    thread zeroes the NaN and Inf of its vectors of the stage's Q and dO
    (sQ, sdO: (rows, head_dim)), and a second barrier publishes them.
    (Reading them as zeros in copies of the MMAs instead made ptxas
    recompute the ldmatrix addresses in every iteration.)"""
    rows = cute.size(sQ, mode=[0])
    # The same in every thread (a barrier's OR), said so (see check_keys).
    if cute.arch.make_warp_uniform(barrier_any(rows_flagged, 0, threads)) != 0:
        zero_nonfinite(sQ, tiled_copy, tidx, rows, dtype, row_mode=0)
        zero_nonfinite(sdO, tiled_copy, tidx, rows, dtype, row_mode=0)
        cute.arch.barrier()
