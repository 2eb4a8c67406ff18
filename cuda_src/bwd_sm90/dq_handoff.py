"""The consumers' side of the dQ hand-off in the sm90 backward (kernel.py):
each query tile's dQ through shared memory to the writer warps' TMA add
(warp_roles.ProducerWarps._write_dq).

dQ leaves the consumers through a shared fp32 tile: two more producer warps,
taking the query tiles in turn (warp_roles.DQ_WARP), add it to the fp32
accumulator in global memory with one TMA reduce-add per query tile, so the
consumers never wait on global reductions (issuing them as red.global from
the consumer warps cost about a sixth of their time, measured with Nsight
Compute on H100). In the deterministic variant these warps also wait for
the tile's turn (see query_tile_of), which leaves the consumers' loop
identical to the plain one."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from .barriers import BAR_STAGE_READ, bar_dq_empty, bar_dq_full
from .warp_roles import DQ_BAR_THREADS, HALF_BAR_THREADS, NUM_MMA_THREADS
from .wgmma_views import store_dq_fragments


class DqHandOff:
    """Needs dq_in_stage, dq_in_tiles, dq_writers and staggered (set by
    FlashBwdSm90.__init__)."""

    @cute.jit
    def _hand_dq_to_writer(self, acc_dQ, it, s, wg, dq_warp, lane, sdQ, r2s_dq, thr_r2s_dq, tdQsdQ):
        """The consumers' side of _write_dq: query tile `it`'s dQ (this
        WG's part, scaled; stage s) into shared memory once its writer is
        done with the buffer, fenced for the TMA, and signalled."""
        if cutlass.const_expr(self.dq_in_stage):
            # Over this stage's Q and dO, once no GEMM of either WG reads
            # them; a writer warp frees the stage after its TMA add.
            warpgroup.wait_group(0)
            cute.arch.barrier(barrier_id=BAR_STAGE_READ, number_of_threads=NUM_MMA_THREADS)
            if cutlass.const_expr(self.dq_in_tiles):
                store_dq_fragments(acc_dQ, sdQ[None, None, s].iterator, wg, dq_warp, lane)
            else:
                cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQsdQ[None, None, None, s])
        else:
            # To shared memory, for the writer warps' TMA add, once the
            # writer of the previous tile (staggered: this WG's half of
            # it) has read that one.
            if cutlass.const_expr(self.staggered):
                cute.arch.barrier(barrier_id=bar_dq_empty(wg), number_of_threads=HALF_BAR_THREADS)
            else:
                previous_writer = (it + self.dq_writers - 1) % self.dq_writers
                cute.arch.barrier(barrier_id=bar_dq_empty(previous_writer), number_of_threads=DQ_BAR_THREADS)
            if cutlass.const_expr(self.dq_in_tiles):
                store_dq_fragments(acc_dQ, sdQ.iterator, wg, dq_warp, lane)
            else:
                cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQsdQ)
        cute.arch.fence_view_async_shared()
        if cutlass.const_expr(self.staggered):
            cute.arch.barrier_arrive(barrier_id=bar_dq_full(wg), number_of_threads=HALF_BAR_THREADS)
        else:
            cute.arch.barrier_arrive(barrier_id=bar_dq_full(it % self.dq_writers), number_of_threads=DQ_BAR_THREADS)
