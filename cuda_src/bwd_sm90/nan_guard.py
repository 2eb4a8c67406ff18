"""NaN and Inf in the Hopper backward (FlashBwdSm90; docs/numerics.md, "NaN
and Inf").

The dV, dK and dQ GEMMs multiply the zero P and dS of hidden pairs with
whatever dO, Q and K hold, and 0 x NaN is NaN. Hidden pairs get P = 0 by a
select (transposed_scores.zero_hidden_pairs), and dS = P (dP - delta) is
then 0 too wherever dP - delta is finite, which this makes sure of; full
tiles (every pair visible) need nothing more.

- K (loaded once per CTA) is checked once (check_keys): its rows past the
  key length and its NaN and Inf values are zeroed, and a key whose K held
  one makes P NaN at every pair that sees it (force_bad_keys); the CTA then
  treats every tile as partial. V needs nothing: dP = dO V^T at a hidden
  pair is only ever multiplied by a zero P through the select below, and
  a NaN in V reaches the rows that see it through their delta.
- dS: zero where P is hidden (common/hidden_pairs.zero_where_hidden, reading
  the -0.0 mark zero_hidden_pairs leaves), whatever dP - delta is.
- Q and dO: a query row whose q or dO holds a NaN or Inf has a lse or
  delta that is not finite. So a partial tile checks its rows'
  statistics, not its data (query_rows_flagged: the stats warp's flag, or
  the lanes' own pairs), and only where one is not finite zeroes the NaN
  and Inf values of the Q and dO stage before the dV and dK GEMMs read
  them (zero_query_stage), and makes P NaN in the rows whose delta is not
  finite (poison_bad_delta_rows): the keys they see still get a NaN dV.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.nonfinite import (
    any_nonfinite, barrier_any, is_nonfinite, vector_copy, zero_nonfinite, zero_nonfinite_everywhere,
)
from .wgmma_views import transposed

NAN = float("nan")
WARP_THREADS = 32


@cute.jit
def check_keys(sK, tScS, n0, kv_len, tidx, barrier_id, threads: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """Before the consumers' first GEMM (sK: (keys, head_dim, 1)): zero K's
    rows past the key length and its NaN and Inf values. Returns 0 where K
    held none (in every thread), else a bitmask of which of this thread's
    S^T key rows (tScS's mode 0) held one, with bit HELD set. `threads`
    consumer threads meet on barrier_id."""
    keys, head_dim = cute.size(sK, mode=[0]), cute.size(sK, mode=[1])
    rows_valid = cutlass.max(cutlass.min(kv_len - n0, keys), 0)
    tile = transposed(sK)[None, None, 0]
    copy = vector_copy(dtype, (head_dim, keys), threads)
    held = barrier_any(any_nonfinite(tile, copy, tidx, rows_valid, dtype), barrier_id, threads)
    key_bad = Int32(0)
    if held != 0:
        key_bad = Int32(HELD)
        for r in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
            key = tScS[r, 0][0]
            if key < rows_valid:
                for d in cutlass.range(head_dim, unroll=1):
                    if is_nonfinite(Float32(sK[key, d, 0])):
                        key_bad = key_bad | (1 << r)
    # Every thread read K for its flags before any zeroes it. The barriers
    # outside the branch (inside it, ptxas spilled at head dim 128).
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if held != 0 or rows_valid < keys:
        zero_nonfinite(tile, copy, tidx, rows_valid, dtype)
        # Generic-proxy stores, read by WGMMA (async proxy).
        cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    return key_bad


# check_keys: the bit that says K held a NaN or Inf (above a
# thread's key rows).
HELD = 1 << 30


@cute.jit
def force_bad_keys(acc_P_mn, key_bad):
    """P^T rows (keys) that check_keys found a NaN or Inf in (key_bad's low
    bits) become NaN; the mask then zeroes their hidden pairs."""
    if key_bad != 0:
        for r in cutlass.range_constexpr(cute.size(acc_P_mn, mode=[0])):
            if (key_bad >> r) & 1 != 0:
                for c in cutlass.range_constexpr(cute.size(acc_P_mn, mode=[1])):
                    acc_P_mn[r, c] = Float32(NAN)


@cute.jit
def query_rows_flagged(pairs, nan_flags, stats_stage):
    """Warp-uniform: whether a query row of the tile has a lse or delta that
    is not finite, i.e. may hold a NaN or Inf in q or dO. The stats warp
    says so in nan_flags (pairs None); without it, this lane's pairs
    (lse_log2_pair, delta_pair), voted on: the warp's lanes cover the rows."""
    flagged = False
    if cutlass.const_expr(pairs is None):
        flagged = nan_flags[stats_stage] != 0
    else:
        for values in pairs:
            for b in cutlass.range_constexpr(2):
                flagged = flagged or is_nonfinite(values[b])
        flagged = cute.arch.vote_any_sync(flagged)
    return flagged


@cute.jit
def poison_bad_delta_rows(acc_P_mn, stats):
    """P^T columns (query rows) whose delta is not finite become NaN (the
    mask then zeroes their hidden pairs): the dV of the keys such a row sees
    is NaN, as when its dO, zeroed by zero_query_stage, still held the NaN
    or Inf. (Also where only its output held one: more than the reference,
    whose dv stays finite there, within the keys the row sees.)"""
    for c in cutlass.range_constexpr(cute.size(acc_P_mn, mode=[1])):
        bad = is_nonfinite(stats.delta(c))
        for r in cutlass.range_constexpr(cute.size(acc_P_mn, mode=[0])):
            acc_P_mn[r, c] = Float32(NAN) if bad else acc_P_mn[r, c]


@cute.jit
def zero_query_stage(sQ, sdO, stage, lane, dtype: cutlass.Constexpr):
    """Zero the NaN and Inf values of Q and dO in `stage`, each warp all of
    them (so that no warp of either consumer warpgroup waits for another:
    the WGMMAs read them once every warp of the group is past this), and
    fence them for WGMMA."""
    for s in (sQ, sdO):
        zero_nonfinite_everywhere(s[None, None, stage], lane, WARP_THREADS, dtype)
    cute.arch.fence_view_async_shared()
