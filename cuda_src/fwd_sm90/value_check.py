"""NaN and Inf in V for the Hopper forward (FlashFwdSm90; docs/numerics.md,
"NaN and Inf").

The PV GEMM multiplies the zero probabilities of masked pairs with whatever
the V tile holds, and 0 x NaN is NaN: a NaN or Inf in V would reach rows
that do not see it. Full tiles (every row sees every key) need nothing. On
a partial tile each consumer warpgroup checks V at the top of the tile's
iteration, before its GEMM turn. Where V holds a NaN or Inf it makes NaN
the output columns of its rows that see one (reading V as loaded), and,
inside its next turn, right before the PV GEMM, zeroes the tile's
non-finite values; rows past the key length are zeroed there too. The
warpgroups share the V stage, and the turns go round them in order
(pingpong), so every one of them checks the tile before any zeroes it.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.dsl_common import INT32_MAX
from ..common.nonfinite import any_nonfinite, barrier_any, vector_copy, zero_nonfinite
from ..common.seen_values import RowMask, poison_seen_columns
from .consumer_turns import WG_THREADS
from ..common.segment_tiles import MIXED, segment_key


class ValueChecks:
    """FlashFwdSm90's checks of V (module docstring); need dtype,
    head_dim_v, tile_n, tile_m, has_segments and bar_epilogue."""

    def _value_copy(self):
        return vector_copy(self.dtype, (self.head_dim_v, self.tile_n), WG_THREADS)

    @cute.jit
    def _full_tiles_from(self, full_lo, mQSeg, batch, m_start):
        """full_lo for the packed-document variant: past every tile where
        the CTA's query rows carry more than one id, so that every tile
        counts as partial there (mask_tile then also applies the length /
        diagonal / window mask on its single-document tiles)."""
        if cutlass.const_expr(self.has_segments):
            if segment_key(mQSeg, batch, cutlass.max(m_start, 0), self.tile_m) == MIXED:
                full_lo = cutlass.Int32(INT32_MAX)
        return full_lo

    @cute.jit
    def _partial_tile(self, n_block, full_lo, full_hi, tile_seg, row_seg):
        """Whether the mask cuts KV tile n_block for some row of the CTA: the
        same answer in every warpgroup. With packed documents also a tile
        whose keys do not all carry the id of the CTA's rows (one id, or
        _full_tiles_from made every tile partial; row_seg: this thread's)."""
        partial = n_block < full_lo or n_block >= full_hi
        if cutlass.const_expr(self.has_segments):
            partial = partial or tile_seg != row_seg[0]
        return partial

    @cute.jit
    def _check_values(self, sV, pipe_v, kv_state, n_block, partial, kv_len, tidx, wg, acc_O_mn, tOcO,
                      mask: RowMask):
        """Before this warpgroup's GEMM turn on KV tile n_block (kv_state):
        on a partial tile, NaN into the output columns that see a NaN or Inf
        of V. Returns nonzero if its PV GEMM must zero V first
        (_clean_values): it holds one, or rows past the key length."""
        clean = Int32(0)
        if partial:
            n_start = n_block * self.tile_n
            rows_valid = cutlass.max(cutlass.min(kv_len - n_start, self.tile_n), 0)
            pipe_v.consumer_wait(kv_state)
            sV_tile = sV[None, None, kv_state.index]
            found = any_nonfinite(sV_tile, self._value_copy(), tidx, rows_valid, self.dtype)
            bad = barrier_any(found, self.bar_epilogue + wg, WG_THREADS)
            if bad != 0:
                poison_seen_columns(acc_O_mn, tOcO, sV_tile, n_start, rows_valid, mask)
            # Past the key length the buffer, or the last page, holds anything
            # (past the tensor TMA wrote zeros; zeroed again, once a CTA).
            if bad != 0 or rows_valid < self.tile_n:
                clean = Int32(1)
        return clean

    @cute.jit
    def _clean_values(self, sV, pipe_v, v_state, clean, v_block, kv_len, tidx, wg):
        """In this warpgroup's GEMM turn, before the PV GEMM of KV tile
        v_block (v_state): zero the non-finite values of V and its rows past
        the key length, where _check_values asked for it."""
        if clean != 0:
            rows_valid = cutlass.max(cutlass.min(kv_len - v_block * self.tile_n, self.tile_n), 0)
            pipe_v.consumer_wait(v_state)
            zero_nonfinite(sV[None, None, v_state.index], self._value_copy(), tidx, rows_valid, self.dtype)
            # Generic-proxy stores, read by WGMMA (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=self.bar_epilogue + wg, number_of_threads=WG_THREADS)
