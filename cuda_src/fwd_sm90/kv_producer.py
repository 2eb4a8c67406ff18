"""The producer warp of the Hopper forward (FlashFwdSm90): Q once, then the
K / V tiles of the CTA's key range with TMA into the multi-stage buffers.
The paged variant's producer is paged_kv.produce_paged."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

WG_ROWS = 64  # rows of one WGMMA accumulator (m64nNk16)


class KVProducer:
    """FlashFwdSm90's producer methods (they read its tile attributes)."""

    @cute.jit
    def _produce(
        self, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
        pipe_q, pipe_k, pipe_v,
        head_q, head_kv, batch, wg_tile0, n_block_max, num_n_blocks,
    ):
        """One warp: each consumer's Q once, then K(n) and V(n) for n =
        n_block_max-1 down."""
        hd, hd_v, tile_n = self.head_dim, self.head_dim_v, self.tile_n
        gQ = cute.local_tile(mQ[None, None, head_q, batch], (WG_ROWS, hd), (None, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (tile_n, hd), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (hd_v, tile_n), (0, None))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        # With a cluster each CTA loads its slice of every K / V tile into
        # the buffers of all CTAs of the cluster.
        cluster = cute.make_layout(self.cluster_size)
        rank = 0
        if cutlass.const_expr(self.cluster_size > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, rank, cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, rank, cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        # Q first and whatever the KV range: its rows do not depend on the
        # sequence lengths, whose loads would otherwise delay it.
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.consumers)
        for w in cutlass.range_constexpr(self.consumers):
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[None, cutlass.max(wg_tile0 + w, 0)], tQsQ[None, w],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        if num_n_blocks > 0:
            kv_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.kv_stages
            )
            n_block = n_block_max - 1
            pipe_k.producer_acquire(kv_state)
            self._load_kv(tma_k, tKgK[None, n_block], tKsK[None, kv_state.index], pipe_k.producer_get_barrier(kv_state))
            pipe_v.producer_acquire(kv_state)
            self._load_kv(tma_v, tVgV[None, n_block], tVsV[None, kv_state.index], pipe_v.producer_get_barrier(kv_state))
            kv_state.advance()
            for i in cutlass.range(1, num_n_blocks, unroll=1):
                n_block = n_block_max - 1 - i
                pipe_k.producer_acquire(kv_state)
                self._load_kv(tma_k, tKgK[None, n_block], tKsK[None, kv_state.index], pipe_k.producer_get_barrier(kv_state))
                pipe_v.producer_acquire(kv_state)
                self._load_kv(tma_v, tVgV[None, n_block], tVsV[None, kv_state.index], pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()

    @cute.jit
    def _load_kv(self, tma, src, dst, barrier):
        """One K or V tile (this CTA's slice of it, into every CTA of the
        cluster)."""
        if cutlass.const_expr(self.cluster_size > 1):
            cute.copy(tma, src, dst, tma_bar_ptr=barrier, mcast_mask=cutlass.Int16((1 << self.cluster_size) - 1))
        else:
            cute.copy(tma, src, dst, tma_bar_ptr=barrier)
