"""The staggered sm90 backward (FlashBwdSm90.staggered): the two consumer
warpgroups never wait for each other's arithmetic.

In step, the WGs met three times per query tile (the stats warp's barrier,
BAR_PDS before the dQ^T GEMM, the dQ writer's), so both ran their exp and
dS arithmetic at the same time while the tensor pipe waited. Staggered:
- WG 1 (the follower) issues its half of dQ^T = K^T dS^T for tile j once WG
  0's dS^T rows of tile j are stored; WG 0 (the leader) issues its half for
  tile j while it computes tile j + 1, once WG 1's rows of tile j are
  stored. Each WG signals its dS^T rows of a buffer (bar_ds_full) and, once
  its dQ^T GEMM has read a buffer, that it is free (bar_ds_free).
- Each WG stores its half of the dQ tile when its GEMM is done, and the
  writer warp adds each half as a box of its own (_write_dq_halves). The
  deterministic variant has a writer warp per half, and each half of a query
  tile its own turns.
- Each WG meets the stats warp on a barrier of its own (warp_roles).
The leader's dQ^T of the tile before its first (no tile: "tile -1", dS
buffer 1) runs like every other, so that neither the GEMM nor the store sits
in a branch (ptxas serialised the WGMMAs of every such variant); the
follower signals that buffer as stored before its first tile, and the
writer takes the leader's first half without adding it. Where a WG meets
nobody (no buffer to wait for or to free), it syncs on barrier 0 alone
instead of branching around the barrier, for the same reason.

Staggered, the backward runs faster than in step and ahead of cuDNN at hd128
(docs/kernel-evidence.md).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from .barriers import BAR_ALONE, bar_dq_empty, bar_dq_full, bar_ds_free, bar_ds_full
from ..common.dsl_common import query_tile_of, release_add_s32, wait_field_at_least
from .warp_roles import HALF_BAR_THREADS, NUM_MMA_THREADS, NUM_MMA_WG, WG_THREADS
from .wgmma_views import dq_tile_layout, issue_wgmma, tiled_mma


def dq_half_shape(m_block: int, head_dim: int, splits_queries: bool):
    """Each WG's half of the (query rows, head dim) dQ tile: its query rows
    where the WGs split dQ^T's query columns (hd64), else its head-dim
    columns."""
    if splits_queries:
        return m_block // NUM_MMA_WG, head_dim
    return m_block, head_dim // NUM_MMA_WG


def dq_half_layout(m_block: int, head_dim: int, splits_queries: bool):
    """The shared layout of one half (a TMA box of its own)."""
    return dq_tile_layout(*dq_half_shape(m_block, head_dim, splits_queries), head_dim // NUM_MMA_WG, False)


def staggered_dq_layout(m_block: int, head_dim: int, splits_queries: bool):
    """The fp32 dQ tile with each half in one piece: dq_tile_layout's, whose
    column blocks already are, or for a split of the query rows two row
    halves one after the other."""
    if not splits_queries:
        return dq_tile_layout(m_block, head_dim, head_dim // NUM_MMA_WG, False)
    return cute.tile_to_shape(dq_half_layout(m_block, head_dim, True), (m_block, head_dim), order=(0, 1))


class StaggeredConsumers:
    """Needs head_dim, m_block, stages, dtype, deterministic and
    dq_splits_queries."""

    @cute.jit
    def _announce_virtual_tile(self, wg, n_iters):
        """Before the loop: the follower's dS^T of "tile -1" (buffer 1), which
        the leader's first dQ^T GEMM reads."""
        if wg == 1 and n_iters > 0:
            cute.arch.barrier_arrive(barrier_id=bar_ds_full(1, 1), number_of_threads=NUM_MMA_THREADS)

    @cute.jit
    def _wait_ds_buffer_free(self, it, wg, s):
        """Before WG wg stores its dS^T rows of tile `it` into buffer s: the
        other WG's dQ^T GEMM of tile it - 2 (for the follower, from tile -1 on)
        has read it."""
        bar_id, threads = bar_ds_free(1 - wg, s), Int32(NUM_MMA_THREADS)
        if it < 2 - wg:
            bar_id, threads = Int32(BAR_ALONE), Int32(WG_THREADS)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)

    @cute.jit
    def _hand_over_ds(self, it, wg, s):
        """After WG wg stored its dS^T rows of tile `it` (buffer s): signal
        them, and wait for the other WG's rows of the tile whose dQ^T half
        this WG computes now. Returns (that tile, its dS buffer)."""
        cute.arch.barrier_arrive(barrier_id=bar_ds_full(wg, s), number_of_threads=NUM_MMA_THREADS)
        dq_tile = it - 1 + wg
        dq_buffer = (s + 1 - wg) % self.stages
        cute.arch.barrier(barrier_id=bar_ds_full(1 - wg, dq_buffer), number_of_threads=NUM_MMA_THREADS)
        return dq_tile, dq_buffer

    @cute.jit
    def _release_ds_buffer(self, dq_tile, dq_buffer, wg, n_iters):
        """WG wg's dQ^T GEMM of dq_tile has read dq_buffer; nobody waits
        for that past the last two tiles."""
        bar_id, threads = bar_ds_free(wg, dq_buffer), Int32(NUM_MMA_THREADS)
        if dq_tile + 2 >= n_iters:
            bar_id, threads = Int32(BAR_ALONE), Int32(WG_THREADS)
        cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=threads)

    @cute.jit
    def _leader_last_dq(self, wg, n_iters, last_buffer, scale, thr_dq, dq_shape, tdQrA, tdQrB, r2s_dq, thr_r2s_dq,
                        tdQsdQ):
        """After the loop, the leader's half of the last tile's dQ^T."""
        if wg == 0 and n_iters > 0:
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C(dq_shape), Float32)
            cute.arch.barrier(barrier_id=bar_ds_full(1, last_buffer), number_of_threads=NUM_MMA_THREADS)
            # A tiled MMA of its own: one whose ACCUMULATE field is set inside
            # a branch must not be used past it.
            MN_MAJOR = warpgroup.OperandMajorMode.MN
            if cutlass.const_expr(self.dq_splits_queries):
                mma_dq = tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, (1, NUM_MMA_WG, 1), self.m_block // NUM_MMA_WG)
            else:
                mma_dq = tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, (NUM_MMA_WG, 1, 1), self.m_block)
            issue_wgmma(mma_dq, acc_dQ, tdQrA[None, None, None, 0], tdQrB[None, None, None, last_buffer], True)
            warpgroup.wait_group(0)
            acc_dQ.store(acc_dQ.load() * scale)
            cute.arch.barrier(barrier_id=bar_dq_empty(wg), number_of_threads=HALF_BAR_THREADS)
            cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQsdQ)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=bar_dq_full(wg), number_of_threads=HALF_BAR_THREADS)

    @cute.jit
    def _write_dq_halves(
        self, tma_dQ, tma_atom_dQ, sdQ, mDqSem, hi, q_len, kv_len, n_block, kv_head, batch, batches, group,
        m_block_min, m_blocks, rotation, rotated_first, rotated_kv_blocks, chains, chain_first, chain_count,
        n_iters, halves: cutlass.Constexpr, tma_dQ_store=None, tma_atom_dQ_store=None,
    ):
        """A dQ writer warp: per query tile, its `halves` of the dQ tile (the
        follower's half 1, then the leader's half 0, which comes a tile
        later; the leader's first store, tile -1, is taken and dropped), each
        added as a box of its own.
        Deterministic (one writer warp per half): each half of a query tile
        has turns of its own, a 16-bit count at bit 16 x half of the tile's
        dq_semaphore entry, so that the leader's late half holds up no other
        CTA's follower half. The first turn of each accumulator stores its
        half instead of adding it (ProducerWarps._write_dq)."""
        D, M = self.head_dim, self.m_block
        half_shape = dq_half_shape(M, D, self.dq_splits_queries)
        lane = cute.arch.lane_idx()
        if n_iters > 0:
            for half in sorted(halves):  # they start empty
                cute.arch.barrier_arrive(barrier_id=bar_dq_empty(half), number_of_threads=HALF_BAR_THREADS)
            if cutlass.const_expr(0 in halves):
                cute.arch.barrier(barrier_id=bar_dq_full(0), number_of_threads=HALF_BAR_THREADS)
                cute.arch.barrier_arrive(barrier_id=bar_dq_empty(0), number_of_threads=HALF_BAR_THREADS)
        for it in cutlass.range(n_iters, unroll=1):
            head, m_block = query_tile_of(it, kv_head, group, m_block_min, m_blocks, self.deterministic, rotation)
            accumulator, turn, k = batch, None, None
            if cutlass.const_expr(self.deterministic):
                chain, turn, k = self._dq_turn(mDqSem, hi, q_len, kv_len, n_block, batch, head, m_block, m_block_min,
                                               m_blocks, rotated_first, rotated_kv_blocks, chains, chain_first,
                                               chain_count)
                accumulator = chain * batches + batch
            gdQ = cute.local_tile(tma_dQ[None, None, head, accumulator], half_shape, (None, None))
            for i in cutlass.range_constexpr(len(halves)):
                half = halves[i]
                coord = (half, 0) if self.dq_splits_queries else (0, half)
                tile = (NUM_MMA_WG * m_block + half, 0) if self.dq_splits_queries else (m_block, half)
                sdQ_half = cute.local_tile(sdQ, half_shape, coord)
                tdQsdQ, tdQgdQ = cpasync.tma_partition(
                    tma_atom_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ_half, 0, 2), cute.group_modes(gdQ, 0, 2)
                )
                cute.arch.barrier(barrier_id=bar_dq_full(half), number_of_threads=HALF_BAR_THREADS)
                if cutlass.const_expr(self.deterministic):
                    if lane == 0:
                        wait_field_at_least(turn, k // chain_count, 16 * half)
                    cute.arch.sync_warp()
                    gdQ_store = cute.local_tile(tma_dQ_store[None, None, head, accumulator], half_shape, (None, None))
                    store_sdQ, store_gdQ = cpasync.tma_partition(
                        tma_atom_dQ_store, 0, cute.make_layout(1), cute.group_modes(sdQ_half, 0, 2),
                        cute.group_modes(gdQ_store, 0, 2)
                    )
                    if k < chain_count:  # the first turn of its accumulator
                        cute.copy(tma_atom_dQ_store, store_sdQ, store_gdQ[None, tile[0], tile[1]])
                    else:
                        cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ[None, tile[0], tile[1]])
                else:
                    cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ[None, tile[0], tile[1]])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                if it + 1 < n_iters:
                    cute.arch.barrier_arrive(barrier_id=bar_dq_empty(half), number_of_threads=HALF_BAR_THREADS)
                if cutlass.const_expr(self.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    if lane == 0:
                        release_add_s32(turn, Int32(1 << (16 * half)))
