"""Who does what in a CTA of the sm90 backward (kernel.py): thread counts,
register budgets and named barriers, and the warps of the producer warpgroup,
which the kernel class inherits (ProducerWarps): the TMA loads of K, V, Q and
dO, and the TMA reduce-add of each query tile's dQ."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .barriers import (  # noqa: F401  (kernel.py imports them from here)
    BAR_EPI, BAR_PDS, BAR_STAGE_READ, BAR_STATS, MAX_DQ_WRITERS, bar_dq_empty, bar_dq_full, bar_stats_of_wg,
)
from .transposed_scores import flag_nonfinite_stats, lse_to_log2
from ..common.dsl_common import (
    last_kv_block_seeing, query_tile_of, release_add_s32, rotated_turn, wait_at_least,
)

WG_THREADS = 128
NUM_MMA_WG = 2
NUM_MMA_THREADS = NUM_MMA_WG * WG_THREADS
NUM_THREADS = WG_THREADS + NUM_MMA_THREADS  # producer WG + 2 consumer WGs
NUM_WARPS = NUM_THREADS // 32
WARP_THREADS = 32
LOAD_WARP = 0  # TMA loads of K, V, Q, dO
# TMA reduce-adds of dQ: warps DQ_WARP .. DQ_WARP + dq_writers - 1 (up to
# the rest of the producer WG); warp DQ_WARP + w takes the query tiles `it`
# with it % dq_writers == w (TileConfig.det_dq_writers says why the
# deterministic variant has more than one).
DQ_WARP = 1
# lse (times log2 e) and delta of each query tile into shared memory, one
# tile ahead; the consumers read them there: loaded by the consumers
# themselves, the loads outlasted the score GEMMs and the exp waited
# (docs/kernel-evidence.md).
STATS_WARP = DQ_WARP + MAX_DQ_WRITERS
# setmaxnreg budgets: 24 + 2 * 240 <= 504 (64K registers / 128 threads of
# each WG, rounded to the granularity of 8). The consumers hold dK and dV
# (2 * n_block * head_dim / 256 floats) plus S, dP and dQ fragments.
PRODUCER_REGS = 24
CONSUMER_REGS = 240
DQ_BAR_THREADS = NUM_MMA_THREADS + WARP_THREADS
# The staggered variant (staggered.py) has one dQ writer (deterministic: one
# per WG), which meets each consumer WG on its own pair of barriers
# (bar_dq_empty / bar_dq_full(wg)), and the stats warp meets each WG on its
# own barrier.
HALF_BAR_THREADS = WG_THREADS + WARP_THREADS


class ProducerWarps:
    """Needs head_dim, head_dim_v, m_block, n_block, stages, deterministic,
    dq_in_stage, dq_in_tiles, dq_writers and staggered (set by
    FlashBwdSm90.__init__)."""

    @cute.jit
    def _dq_chain_count(self, tma_dQ, batches, heads_q, seqlen_q):
        """The dQ accumulators in tma_dQ (kernel_api.h: dq_chains)."""
        if cutlass.const_expr(self.dq_in_tiles):
            return tma_dQ.shape[0] // (batches * heads_q * cute.ceil_div(seqlen_q, self.m_block) * self.m_block)
        return tma_dQ.shape[3] // batches

    @cute.jit
    def _write_dq(
        self, tma_dQ, tma_atom_dQ, sdQ, pipe, mDqSem, hi, q_len, kv_len, n_block, kv_head, batch, batches,
        group, m_block_min, m_blocks, rotation, rotated_first, rotated_kv_blocks, chains, chain_first,
        chain_count, n_iters, writer, heads_q, seqlen_q, tma_dQ_store=None, tma_atom_dQ_store=None,
    ):
        """One warp: per query tile of this writer (see DQ_WARP), wait for
        the consumers' dQ tile, add it to the fp32 accumulator with a TMA
        reduce-add and hand the buffer back as soon as the TMA has read it.
        Deterministic: first wait for the tile's turn, and pass the turn on
        once the addition is complete; turn k of a query tile adds into
        accumulator chain_first + k % chain_count (dQ chains below) and
        waits only on the turns before it there.
        dq_in_stage: the tile lies over the query tile's Q / dO stage, which
        this warp then frees for the producer.
        dq_in_tiles: tma_dQ is (rows, D), query tile m_block of (batch,
        chain, head) at tile ((batch x chains + chain) x heads_q + head) x
        tiles per head + m_block (kernel_api.h: dq_tile_rows).
        Deterministic: the first turn of each accumulator stores its tile
        with tma_atom_dQ_store instead of adding it, so nobody zeroes
        dq_accum; what no turn reaches stays unwritten, and the caller keeps
        only the tiles whose dq_semaphore count is nonzero."""
        D, M = self.head_dim, self.m_block
        lane = cute.arch.lane_idx()
        # dQ chains, the deterministic variant's dQ accumulators (`chains` of them; kernel_api.h:
        # dq_chains), which the caller zeroes and sums in order. In the rotated order (no mask), a group of
        # KV tiles (dsl_common.rotated_order) owns chain_count of them, and turn k of a query tile adds into
        # its accumulator k % chain_count, so it waits on turn k - chain_count instead of k - 1: there a
        # head's CTAs hand each query tile on every iteration, and one hand-over (TMA add, its completion,
        # the release, the next CTA's acquire) outlasted an iteration at 64 x 64 tiles. The turns of
        # dq_semaphore take chains entries per 32 query rows. In the other order (masks, and heads split
        # into more groups than there are accumulators) several chains lost, not understood, so there the
        # first accumulator takes every turn (docs/kernel-evidence.md).
        q_tiles = cute.ceil_div(seqlen_q, M)
        if cutlass.const_expr(not self.dq_in_stage):
            if writer == self.dq_writers - 1 and n_iters > 0:
                # The buffer starts empty: as if this writer had read tile -1.
                cute.arch.barrier_arrive(barrier_id=bar_dq_empty(writer), number_of_threads=DQ_BAR_THREADS)
        for it in cutlass.range(writer, n_iters, self.dq_writers, unroll=1):
            head, m_block = query_tile_of(it, kv_head, group, m_block_min, m_blocks, self.deterministic, rotation)
            chain, turn, k = self._dq_turn(mDqSem, hi, q_len, kv_len, n_block, batch, head, m_block, m_block_min,
                                           m_blocks, rotated_first, rotated_kv_blocks, chains, chain_first, chain_count)
            tile = m_block
            if cutlass.const_expr(self.dq_in_tiles):
                gdQ = cute.local_tile(tma_dQ, (M, D), (None, 0))
                tile = ((batch * chains + chain) * heads_q + head) * q_tiles + m_block
            else:
                gdQ = cute.local_tile(tma_dQ[None, None, head, chain * batches + batch], (M, D), (None, 0))
            tdQsdQ, tdQgdQ = cpasync.tma_partition(
                tma_atom_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
            )
            stage = it % self.stages
            if cutlass.const_expr(self.dq_in_stage):
                tdQsdQ = tdQsdQ[None, stage]
            if cutlass.const_expr(self.deterministic):
                store_sdQ, store_gdQ = self._dq_store_views(
                    tma_atom_dQ_store, tma_dQ_store, sdQ, head, chain * batches + batch, stage
                )
            cute.arch.barrier(barrier_id=bar_dq_full(writer), number_of_threads=DQ_BAR_THREADS)
            if cutlass.const_expr(self.deterministic):
                # Every KV tile before this one in its chain's order has added.
                if lane == 0:
                    wait_at_least(turn, k // chain_count)
                cute.arch.sync_warp()
            if cutlass.const_expr(self.deterministic):
                if k < chain_count:  # the first turn of its accumulator
                    cute.copy(tma_atom_dQ_store, store_sdQ, store_gdQ[None, tile])
                else:
                    cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ[None, tile])
            else:
                cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ[None, tile])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if cutlass.const_expr(self.dq_in_stage):
                pipe.consumer_release(pipeline.PipelineState(self.stages, it, stage, (it // self.stages) % 2))
            elif it + 1 < n_iters:
                cute.arch.barrier_arrive(barrier_id=bar_dq_empty(writer), number_of_threads=DQ_BAR_THREADS)
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                if lane == 0:
                    release_add_s32(turn, Int32(1))

    @cute.jit
    def _dq_turn(self, mDqSem, hi, q_len, kv_len, n_block, batch, head, m_block, m_block_min, m_blocks,
                 rotated_first, rotated_kv_blocks, chains, chain_first, chain_count):
        """(chain, turn, k) of this KV tile at query tile m_block: its turn k
        there, the dQ accumulator it adds into and the dq_semaphore entry that
        counts the turns (deterministic only; else 0, the first entry, 0)."""
        chain, turn, k = Int32(0), mDqSem.iterator, Int32(0)
        if cutlass.const_expr(self.deterministic):
            if rotated_kv_blocks > 0:
                k = rotated_turn(n_block - rotated_first, m_block - m_block_min, rotated_kv_blocks, m_blocks)
            else:
                k = last_kv_block_seeing(m_block, self.m_block, self.n_block, hi, q_len, kv_len) - n_block
            chain = chain_first + k % chain_count
            # dq_semaphore has chains entries per 32 query rows.
            turn = mDqSem.iterator + cute.crd2idx((batch, head, m_block * chains + chain), mDqSem.layout)
        return chain, turn, k

    @cute.jit
    def _dq_store_views(self, tma_atom, tma_dQ, sdQ, head, batch_chain, stage):
        """As _write_dq partitions the dQ tile and dq_accum for its TMA add,
        for the first turn's TMA store: (shared, global)."""
        D, M = self.head_dim, self.m_block
        if cutlass.const_expr(self.dq_in_tiles):
            gdQ = cute.local_tile(tma_dQ, (M, D), (None, 0))
        else:
            gdQ = cute.local_tile(tma_dQ[None, None, head, batch_chain], (M, D), (None, 0))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
        )
        if cutlass.const_expr(self.dq_in_stage):
            tdQsdQ = tdQsdQ[None, stage]
        return tdQsdQ, tdQgdQ

    @cute.jit
    def _load_stats(
        self, mLSE, mDelta, sStats, nan_flags, batch, kv_head, group, m_block_min, m_blocks, rotation, n_iters,
        seqlen_q,
    ):
        """One warp: per query tile `it`, once the consumers have read what
        stage it % stages held before, lse * log2 e (+inf for rows that see no
        key, so that P = 0 there) and delta of its rows into that stage of
        sStats ((rows, 2, stages)), and whether one is not finite into
        nan_flags[stage] (nan_guard.py). Rows past seqlen_q take the last row's values
        (the mask hides them); BAR_STATS hands the stages over."""
        M, st = self.m_block, self.stages
        lane = cute.arch.lane_idx()
        for it in cutlass.range(n_iters, unroll=1):
            head, m_block = query_tile_of(it, kv_head, group, m_block_min, m_blocks, self.deterministic, rotation)
            stage = it % st
            for r in cutlass.range_constexpr(M // WARP_THREADS):
                row = r * WARP_THREADS + lane
                self._stage_query_stats(mLSE, mDelta, sStats, batch, head, m_block, row, stage, seqlen_q)
            if cutlass.const_expr(M % WARP_THREADS != 0):  # 80, 112 rows: 16 lanes do the last 16
                row = M - M % WARP_THREADS + lane
                if row < M:
                    self._stage_query_stats(mLSE, mDelta, sStats, batch, head, m_block, row, stage, seqlen_q)
            flag_nonfinite_stats(sStats, nan_flags, stage, lane)
            if cutlass.const_expr(self.staggered):
                # The follower WG (1) reaches a tile last: past its barrier
                # both are done with the stage that the next tile overwrites.
                for wg in cutlass.range_constexpr(NUM_MMA_WG):
                    cute.arch.barrier(barrier_id=bar_stats_of_wg(wg), number_of_threads=HALF_BAR_THREADS)
            else:
                cute.arch.barrier(barrier_id=BAR_STATS, number_of_threads=DQ_BAR_THREADS)

    @cute.jit
    def _stage_query_stats(self, mLSE, mDelta, sStats, batch, head, m_block, row, stage, seqlen_q):
        """Row `row` of query tile m_block into its stage of sStats."""
        src = cutlass.min(m_block * self.m_block + row, seqlen_q - 1)
        lse_log2 = lse_to_log2(mLSE[batch, head, src])
        sStats[row, 0, stage] = lse_log2
        sStats[row, 1, stage] = mDelta[batch, head, src]

    @cute.jit
    def _produce(
        self, tma_Q, tma_K, tma_V, tma_dO, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO,
        sQ, sK, sV, sdO, pipe, kv_bar, bytes_KV,
        n_block, kv_head, batch, group, m_block_min, m_blocks, rotation, n_iters,
    ):
        D, Dv, M, N = self.head_dim, self.head_dim_v, self.m_block, self.n_block
        if n_iters > 0:
            gK = cute.local_tile(tma_K[None, None, kv_head, batch], (N, D), (None, 0))
            gV = cute.local_tile(tma_V[None, None, kv_head, batch], (N, Dv), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
            )
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
            )
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(kv_bar, bytes_KV)
            cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, 0], tma_bar_ptr=kv_bar)
            cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, 0], tma_bar_ptr=kv_bar)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for it in cutlass.range(n_iters, unroll=1):
            head, m_block = query_tile_of(it, kv_head, group, m_block_min, m_blocks, self.deterministic, rotation)
            gQ = cute.local_tile(tma_Q[None, None, head, batch], (M, D), (None, 0))
            gdO = cute.local_tile(tma_dO[None, None, head, batch], (M, Dv), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_atom_dO, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
            )
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar)
            state.advance()
