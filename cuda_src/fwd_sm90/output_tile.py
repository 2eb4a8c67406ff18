"""The end of a consumer warpgroup's query tile in the sm90 forward: O
normalised by the row sums (the attention sink's term included), the LSE
written, and O stored through the warpgroup's Q buffer with one TMA store."""

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .online_softmax import quad_allreduce

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


@cute.jit
def store_output_tile(
    tidx, barrier_id, tOsO, acc_O, acc_O_mn, tScS, row_max, row_sum, scale_log2, sink, sO, tma_o,
    mO, mLSE, head_q, batch, wg_tile, row_start, q_len,
    dtype: cutlass.Constexpr, tile_shape: cutlass.Constexpr, threads: cutlass.Constexpr,
):
    """Normalise O, write the natural-log LSE (the sink's for a row that
    sees no key, whose O is exactly zero; NaN for one that saw a NaN or +Inf
    logit, whose sum is NaN), and store the warpgroup's O tile (tile_shape:
    rows, head_dim_v) through sO, whose partition for the PV accumulator is
    tOsO. The TMA store clips rows past seqlen_q; a tile before row 0
    (wg_tile < 0) stores nothing. barrier_id: a named barrier of the
    warpgroup's threads.

    sink: the attention sink of this query head (natural log; -inf for
    none), a softmax term e^sink without a value (docs/numerics.md). A row
    that saw keys gets lse = logaddexp(lse of its keys, sink) and O scaled by
    e^(lse of its keys - lse); a sink of -inf takes no part, so that every
    bit stays as without it, and a NaN one makes the row NaN.
    """
    seqlen_q = mO.shape[0]
    sink_log2 = sink * LOG2E
    for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
        total = quad_allreduce(row_sum[r], lambda a, b: a + b)
        row = row_start + tScS[r, 0][0]
        # A row saw a key iff its sum is not zero (NaN is not). The others,
        # rows past q_len included, store zeros whatever their accumulator
        # holds (rows of their own: a NaN there is no other row's).
        seen = total != 0.0 and row < q_len
        inv = cute.arch.rcp_approx(total)
        lse = sink
        if seen:
            lse_log2 = row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)
            if sink_log2 != -cutlass.Float32.inf:
                # logaddexp around the larger term, so that exp2 cannot
                # overflow; a NaN takes the second branch and stays NaN.
                keys_log2 = lse_log2
                if sink_log2 > keys_log2:
                    lse_log2 = sink_log2 + cute.math.log2(
                        1.0 + cute.arch.exp2(keys_log2 - sink_log2), fastmath=True)
                else:
                    lse_log2 = keys_log2 + cute.math.log2(
                        1.0 + cute.arch.exp2(sink_log2 - keys_log2), fastmath=True)
                inv = inv * cute.arch.exp2(keys_log2 - lse_log2)
            lse = lse_log2 * LN2
        for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
            acc_O_mn[r, c] = acc_O_mn[r, c] * inv if seen else cutlass.Float32(0.0)
        if tidx % 4 == 0 and row >= 0 and row < seqlen_q:
            mLSE[batch, head_q, row] = lse

    rO = cute.make_rmem_tensor(acc_O.layout, dtype)
    rO.store(acc_O.load().to(dtype))
    # Every warp of this warpgroup must be done reading Q before O lands.
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    cute.autovec_copy(rO, tOsO)
    # Generic-proxy smem writes must be visible to the TMA (async proxy).
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if tidx < 32 and wg_tile >= 0:
        gO = cute.local_tile(mO[None, None, head_q, batch], tile_shape, (wg_tile, 0))
        tOsO_tma, tOgO = cpasync.tma_partition(
            tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2),
        )
        cute.copy(tma_o, tOsO_tma, tOgO)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
