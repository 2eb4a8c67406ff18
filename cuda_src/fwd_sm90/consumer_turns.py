"""The consumer warpgroups' GEMM issues in the Hopper forward (FlashFwdSm90),
and the turns they take at issuing them (pingpong): a ring of named
barriers, one per consumer, lets one warpgroup issue its GEMMs while the
others run their softmax. The V checks (value_check.py) rely on the turns'
order as well."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common.segment_tiles import segment_key

WG_THREADS = 128  # one warpgroup
# Named barriers (0 is __syncthreads): one per consumer for the pingpong,
# then one per consumer for its epilogue.
BAR_PINGPONG = 1


class ConsumerTurns:
    """FlashFwdSm90's GEMM issues and turns (they read its pingpong,
    consumers, has_segments and tile_n)."""

    @cute.jit
    def _turn_wait(self, wg):
        """Pingpong: wait until the previous consumer has issued its GEMMs."""
        if self.pingpong:
            cute.arch.barrier(barrier_id=BAR_PINGPONG + wg, number_of_threads=2 * WG_THREADS)

    @cute.jit
    def _turn_pass(self, wg):
        """Pingpong: let the next consumer issue its GEMMs."""
        if self.pingpong:
            # 1 - wg for two: the same code as before three were possible.
            following = 1 - wg if cutlass.const_expr(self.consumers == 2) else (wg + 1) % self.consumers
            cute.arch.barrier_arrive(
                barrier_id=BAR_PINGPONG + following, number_of_threads=2 * WG_THREADS
            )

    @cute.jit
    def _gemm_qk(self, tiled_mma, acc_S_shape, tSrQ, tSrK, stage):
        """Issue S = Q K(stage)^T asynchronously; the caller waits."""
        acc_S = cute.make_rmem_tensor(acc_S_shape, cutlass.Float32)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
        warpgroup.commit_group()
        return acc_S

    @cute.jit
    def _gemm_pv(self, tiled_mma, acc_O, tOrP, tOrV, stage):
        """Issue O += P V(stage) asynchronously with P in registers."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _tile_segment(self, mKVSeg, batch, n_start):
        """The segment_key of a KV tile's ids; None for the plain variant."""
        tile_seg = None
        if cutlass.const_expr(self.has_segments):
            tile_seg = segment_key(mKVSeg, batch, n_start, self.tile_n)
        return tile_seg
