"""FlashAttention backward pass for Hopper (sm_90a) in the CuTe Python DSL.

One CTA owns one KV tile (n_block rows) of one (batch, kv head) and keeps that
tile's dK and dV accumulators in registers while it walks every query head of
its GQA group and every query tile that the mask lets see the KV tile.

Warp specialisation: warpgroup 0 is the producer (one warp issues TMA loads of
K and V once, then of Q and dO into a 2-stage mbarrier pipeline) and gives its
registers away; warpgroups 1 and 2 compute with WGMMA:

    S^T  = K Q^T     (each WG: half of the keys, all m_block query rows)
    dP^T = V dO^T    (same split; over head_dim_v, the width of V and dO)
    P^T  = exp2(S^T * scale * log2e - lse * log2e),  dS^T = P^T * (dP^T - delta)
    dV  += P^T dO    (each WG: its keys, all of the head dim; P^T from registers)
    dK  += dS^T Q    (same; times scale at the end)
    dQ   = dS K      (each WG: half of the head dim) -> shared -> TMA add
                     (to dq_accum in query tiles, in fragment order: dq_tile_rows;
                     80 or 112 query rows do not tile WGMMA's M: dQ^T = K^T dS^T,
                     added to dq_accum in q's layout)

Computing the transposed scores puts the keys in the WGMMA M dimension, so
P^T and dS^T come out of the accumulators already in the register layout of
the A operand of dV and dK: P never touches shared memory and the dV GEMM
starts as soon as P^T exists. Only dS^T goes to shared memory (stmatrix, double
buffered): dQ needs every key of a query row (at 80 and 112 query rows each WG
hands the other its dS^T, WG 0's dQ^T a tile late: staggered.py).

Head dims 192 and 256 (TileConfig.split_head_dim) would need 256 floats of
dK and dV per thread at 128 keys: there the CTA owns 64 keys and the two
WGs split the head dim of dK, dV and dQ (and the query rows of S^T, dP^T),
so P^T goes through shared memory like dS^T and every product after the
scores reads both from there, after one barrier. DeepSeek's 192 / 128
(head_dim_v 128: V, dO, dV) splits the same way, dV in 64-column halves.
dQ leaves through shared memory to two writer warps (dq_handoff.py).

The packed-document variant (has_segments) narrows the query tiles to the union
of the KV tile's keys' q_bounds; a thread compares segment ids only on tiles where
its rows and columns carry more than one id (document edges).
"""

from typing import Optional, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common.dsl_common import (
    LOG2E, cap_scores, cap_scores_with_slope, logit_scales, query_tile_of, rotated_order, row_store_tile,
    segment_bounds_union, store_existing_rows, wgmma_acc_as_rows_cols,
)
from ..common.hidden_pairs import zero_where_hidden
from .dq_handoff import DqHandOff
from .nan_guard import (
    check_keys, force_bad_keys, poison_bad_delta_rows, query_rows_flagged, zero_query_stage,
)
from .shared_storage import dq_tma_atoms, load_tma_atoms, shared_storage, shared_tiles
from .staggered import StaggeredConsumers, staggered_dq_layout
from .tile_config import TILE_CONFIGS, TileConfig
from .transposed_scores import (
    QueryStats, load_query_stats, lse_to_log2, own_query_column, probabilities_in_place,
    score_gradients_in_place, stat_pairs, warp_sees_several_ids, zero_hidden_pairs,
)
from .wgmma_views import (
    WGMMA_M, as_operand_a, dq_tile_layout, issue_wgmma, key_rows_mma, smem_tile_layout, stage_accumulator,
    tiled_mma, transposed,
)
from .warp_roles import (
    BAR_EPI, BAR_PDS, BAR_STATS, CONSUMER_REGS, DQ_BAR_THREADS, HALF_BAR_THREADS, DQ_WARP,
    MAX_DQ_WRITERS, STATS_WARP, LOAD_WARP, NUM_MMA_THREADS, NUM_MMA_WG, NUM_THREADS, NUM_WARPS, PRODUCER_REGS,
    WG_THREADS, ProducerWarps, bar_stats_of_wg,
)

SMEM_CAPACITY_SM90 = 227 * 1024


class FlashBwdSm90(ProducerWarps, StaggeredConsumers, DqHandOff):
    """deterministic=True builds the variant that adds dQ in KV-tile order
    (the writer warp waits for each tile's turn). It is a compile-time
    choice, unlike in the sm80 family, so that the plain variant carries no
    turn code. has_softcap=True builds the soft-capped variant (S becomes
    tanh(S * scale / softcap) and dS is multiplied by 1 - tanh^2);
    deterministic or packed-document capped problems run on the sm80
    backward. head_dim_v (default head_dim) is the width of V, dO and dV."""

    def __init__(
        self, dtype: Type[cutlass.Numeric], head_dim: int, deterministic: bool = False,
        has_segments: bool = False, tile: Optional[TileConfig] = None, has_softcap: bool = False,
        head_dim_v: Optional[int] = None,
    ):
        head_dim_v = head_dim_v or head_dim
        if not self.can_implement(dtype, head_dim, tile, head_dim_v):
            raise NotImplementedError(f"no sm90 backward for dtype={dtype}, dims={(head_dim, head_dim_v)}")
        if deterministic and has_segments:
            # The deterministic order needs the geometric query-tile ranges
            # (see the sm80 family); packed documents narrow them.
            raise NotImplementedError("no deterministic packed-document sm90 backward")
        cfg = tile or TILE_CONFIGS[head_dim, head_dim_v]
        if head_dim_v != head_dim and (not cfg.split_head_dim or cfg.dq_in_stage):
            # The fp32 dQ tile fills a Q / dO pair (dq_in_stage) only when V is
            # as wide as Q; no unsplit tile has needed a narrower V so far.
            raise NotImplementedError("a narrower V: only split_head_dim without dq_in_stage")
        if has_softcap and (deterministic or has_segments):
            raise NotImplementedError("softcap: only the plain sm90 backward")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.deterministic = deterministic
        self.has_segments = has_segments
        self.has_softcap = has_softcap
        # 1 - tanh^2 is kept in a fragment next to P where that fits (the
        # split layout), else recovered from P: the fragment spilled in the
        # unsplit layouts, and recovering was slower where it fits
        # (docs/kernel-evidence.md).
        self.slope_from_probability = has_softcap and not cfg.split_head_dim
        self.m_block = cfg.m_block
        self.n_block = cfg.n_block
        self.stages = cfg.stages
        self.split_head_dim = cfg.split_head_dim
        self.dq_in_stage = cfg.dq_in_stage
        self.stats_warp = cfg.det_stats_warp or not deterministic
        # Query rows that do not tile WGMMA's M (80, 112): dQ^T = K^T dS^T instead,
        # the WGs splitting its head dim, or at one WGMMA's M of head dim its
        # query rows.
        self.dq_transposed = cfg.m_block % WGMMA_M != 0
        # dQ in tiles (kernel_api.h: dq_tile_rows): dQ = dS K goes to
        # dq_accum as contiguous query tiles in fragment order
        # (store_dq_fragments), one TMA box per tile.
        self.dq_in_tiles = cfg.dq_tile_rows > 0
        assert self.dq_in_tiles != self.dq_transposed
        self.dq_splits_queries = self.dq_transposed and head_dim == WGMMA_M
        # Where dS meets the mask of hidden pairs (nan_guard.py): in the
        # 16-bit copies, with dq_transposed at fp16 (in fp32 ptxas serialised
        # the WGMMAs of the packed-document variant at hd128; at bf16 the
        # other way round).
        self.zero_ds_in_16_bits = self.dq_transposed and dtype is cutlass.Float16
        # The consumer WGs out of step (staggered.py); deterministic, a dQ
        # writer warp per WG's half.
        self.staggered = self.dq_transposed
        self.dq_writers = 1
        if deterministic:
            self.dq_writers = NUM_MMA_WG if self.staggered else cfg.det_dq_writers
        if self.dq_transposed and (cfg.split_head_dim or cfg.m_block % 16 != 0 or not self.stats_warp
                                   or not (self.dq_splits_queries or head_dim % (WGMMA_M * NUM_MMA_WG) == 0)):
            raise NotImplementedError(f"m_block={cfg.m_block} at head_dim={head_dim}: a multiple of 16, no "
                                      f"split head dim, stats warp, head_dim 64 or a multiple of 128")
        if not 1 <= self.dq_writers <= MAX_DQ_WRITERS:
            raise ValueError(f"det_dq_writers={cfg.det_dq_writers}: 1 to {MAX_DQ_WRITERS}")

    @staticmethod
    def can_implement(dtype, head_dim, tile: Optional[TileConfig] = None, head_dim_v: Optional[int] = None) -> bool:
        """tile: an alternative to the head dims' TILE_CONFIGS entry (for
        timing tile choices; any head dims then)."""
        dims = (head_dim, head_dim_v or head_dim)
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        if tile is None and dims not in TILE_CONFIGS:
            return False
        return (tile or TILE_CONFIGS[dims]).smem_bytes(*dims) <= SMEM_CAPACITY_SM90

    # ------------------------------------------------------------------ host
    def _dO_layout(self):
        """dO's stages, head_dim_v wide. It, the dV MMA and dV's store tile
        are built where they are used, not passed to the kernel: a kernel
        parameter more changes the code of every variant."""
        Dv = self.head_dim_v
        return smem_tile_layout(self.dtype, self.m_block, Dv, self.stages, Dv // NUM_MMA_WG if self.split_head_dim else Dv)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, T, Hq, D]
        mK: cute.Tensor,  # [B, S, Hkv, D]
        mV: cute.Tensor,  # [B, S, Hkv, Dv]
        mdO: cute.Tensor,  # [B, T, Hq, Dv]
        mLSE: cute.Tensor,  # [B, Hq, T] f32
        mDelta: cute.Tensor,  # [B, Hq, T] f32
        mQLens: cute.Tensor,  # [B] i32
        mKVLens: cute.Tensor,  # [B] i32
        mdQ: cute.Tensor,  # [chains x B, T, Hq, D] f32 or in tiles (dq_in_tiles), zeroed by the caller
        mdK: cute.Tensor,  # [B, S, Hkv, D]
        mdV: cute.Tensor,  # [B, S, Hkv, Dv]
        mDqSem: cute.Tensor,  # [B, Hq, chains x ceil(T / 32)] i32, zeroed; deterministic only
        scale: Float32,
        softcap: Float32,
        key_lo: Int32,
        key_hi: Int32,
        deterministic: Int32,
        stream: cuda.CUstream,
        mQSeg: Optional[cute.Tensor] = None,  # [B, T] i32, segment variant only
        mKVSeg: Optional[cute.Tensor] = None,  # [B, S] i32
        mQBounds: Optional[cute.Tensor] = None,  # [B, S, 2] i32
    ):
        """key_lo <= j - i <= key_hi for a visible (query i, key j) pair; the
        launcher clamps both to +-(seqlen_q + seqlen_k + 1). Only the
        has_softcap variant reads softcap (the launcher sends capped problems
        to it alone). deterministic is nonzero in the deterministic variant:
        how many CTAs the launcher lets run at once (kernel() says why)."""
        if cutlass.const_expr(mQ.element_type != self.dtype):
            raise TypeError("q dtype does not match the compiled variant")
        if cutlass.const_expr(self.has_segments != (mQSeg is not None)):
            raise TypeError("segment tensors must be given exactly for the has_segments variant")
        D, Dv, M, N, st = self.head_dim, self.head_dim_v, self.m_block, self.n_block, self.stages
        split = self.split_head_dim
        K_MAJOR, MN_MAJOR = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        # dQ splits the head dim over the two WGs; dK/dV and S^T/dP^T split
        # the keys (split_head_dim: dK/dV the head dim, S^T/dP^T the query
        # rows): these are the per-WG extents each buffer is read with. P^T
        # and dS^T are stored as (keys, query rows).
        sQ_layout = smem_tile_layout(self.dtype, M, D, st, D // NUM_MMA_WG if split else D)
        sdO_layout = self._dO_layout()
        sK_layout = smem_tile_layout(self.dtype, N, D, 1, D // NUM_MMA_WG)
        sV_layout = smem_tile_layout(self.dtype, N, Dv, 1, Dv // NUM_MMA_WG if split else Dv)  # dV staged here
        sdS_layout = smem_tile_layout(self.dtype, N, M, st, M // NUM_MMA_WG if self.dq_splits_queries else M)
        sdQ_layout = dq_tile_layout(M, D, D // NUM_MMA_WG, self.dq_in_tiles)
        if cutlass.const_expr(self.staggered):
            sdQ_layout = staggered_dq_layout(M, D, self.dq_splits_queries)

        # S^T = K Q^T and dP^T = V dO^T (keys as the WGMMA M), so that P^T and
        # dS^T are already the register A operands of dV += P^T dO and
        # dK += dS^T Q; dQ = dS K reads dS from shared memory. Split head
        # dim: every product reads P^T and dS^T from shared memory.
        if cutlass.const_expr(split):
            mma_sdp = tiled_mma(self.dtype, K_MAJOR, K_MAJOR, (1, NUM_MMA_WG, 1), M // NUM_MMA_WG)
        else:
            mma_sdp = tiled_mma(self.dtype, K_MAJOR, K_MAJOR, (NUM_MMA_WG, 1, 1), M)
        mma_dkv = key_rows_mma(self.dtype, D, split)
        if cutlass.const_expr(self.dq_splits_queries):
            mma_dq = tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, (1, NUM_MMA_WG, 1), M // NUM_MMA_WG)
        elif cutlass.const_expr(self.dq_transposed):
            # dQ^T = K^T dS^T: the head dim is the WGMMA M, split over the WGs.
            mma_dq = tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, (NUM_MMA_WG, 1, 1), M)
        else:
            mma_dq = tiled_mma(self.dtype, MN_MAJOR, MN_MAJOR, (1, NUM_MMA_WG, 1), D // NUM_MMA_WG)

        (tma_atom_Q, tma_Q), (tma_atom_dO, tma_dO), (tma_atom_K, tma_K), (tma_atom_V, tma_V) = load_tma_atoms(
            (mQ, mdO, mK, mV), (sQ_layout, sdO_layout, sK_layout, sV_layout), (M, M, N, N), (D, Dv, D, Dv)
        )
        tma_atom_dQ, tma_dQ, tma_atom_dQ_store, tma_dQ_store = dq_tma_atoms(
            mdQ, sdQ_layout, M, D, self.dq_in_tiles, self.staggered, self.deterministic, self.dq_splits_queries
        )

        layouts = dict(sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout, sdS=sdS_layout, sdQ=sdQ_layout)
        SharedStorage = shared_storage(self.dtype, M, st, layouts, self.dq_in_stage, split)

        store_dk = row_store_tile(self.dtype, D, NUM_MMA_THREADS)

        n_blocks, kv_heads = cute.ceil_div(mK.shape[1], N), mK.shape[2]
        # The deterministic variant launches the KV tiles of a head last to
        # first (kernel()), one head after another: with turns from the last
        # KV tile down, launching heads first collapsed
        # (docs/kernel-evidence.md).
        grid = (n_blocks, kv_heads, mK.shape[0])
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_dQ, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO,
            tma_atom_dQ, mLSE, mDelta, mQLens, mKVLens, mdQ, mdK, mdV, mDqSem,
            scale, softcap, key_lo, key_hi, deterministic if self.deterministic else None,
            mQSeg, mKVSeg, mQBounds,
            sQ_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout,
            mma_sdp, mma_dkv, mma_dq, store_dk, SharedStorage, tma_dQ_store, tma_atom_dQ_store,
        ).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            # Tells ptxas the register count at entry (65536 / 384 threads), without
            # which it ignores setmaxnreg and compiles every warp for 168.
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_dO: cute.Tensor,
        tma_dQ: cute.Tensor,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_dO: cute.CopyAtom,
        tma_atom_dQ: cute.CopyAtom, mLSE: cute.Tensor, mDelta: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mDqSem: cute.Tensor,
        scale: Float32, softcap: Float32, lo: Int32, hi: Int32, resident_ctas: Optional[Int32],
        mQSeg: Optional[cute.Tensor], mKVSeg: Optional[cute.Tensor], mQBounds: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
        store_dk: cute.TiledCopy,
        SharedStorage: cutlass.Constexpr,
        tma_dQ_store: Optional[cute.Tensor], tma_atom_dQ_store: Optional[cute.CopyAtom],
    ):
        D, M, N, st = self.head_dim, self.m_block, self.n_block, self.stages
        sdO_layout = self._dO_layout()
        scale_log2, softcap_in = scale * LOG2E, Float32(0.0)
        if cutlass.const_expr(self.has_softcap):
            scale_log2, softcap_in = logit_scales(scale, softcap)
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, kv_head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.deterministic):
            # Last KV tile first: the turns at a query tile go from the last
            # KV tile that sees it down (query_tile_of), so a CTA waits only
            # on CTAs launched before it (or, rotated, on all of its head's).
            n_block = cute.ceil_div(mdK.shape[1], self.n_block) - 1 - n_block
        seqlen_q = mLSE.shape[2]
        seqlen_k = mdK.shape[1]
        group = mLSE.shape[1] // mdK.shape[2]

        # ---- which query tiles see this KV tile: key j is visible from
        # query i iff i < q_len, j < kv_len and lo <= j - i <= hi.
        q_len = cutlass.min(mQLens[batch], seqlen_q)
        kv_len = cutlass.min(mKVLens[batch], seqlen_k)
        n0 = n_block * N
        n_last = cutlass.min(n0 + N, kv_len) - 1
        row_begin = cutlass.max(n0 - hi, 0)
        row_end = cutlass.min(q_len, n_last - lo + 1)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if cutlass.const_expr(self.has_segments):
            # Every warp takes part (before the roles split): the union of the
            # keys' document ranges bounds the query tiles worth visiting.
            seg_begin, seg_end = segment_bounds_union(
                mQBounds, storage.sSegRange.get_tensor(cute.make_layout(2 * NUM_WARPS)),
                batch, n0, n_last, tidx, N, NUM_WARPS,
            )
            row_begin = cutlass.max(row_begin, seg_begin)
            row_end = cutlass.min(row_end, seg_end)
        m_block_min = row_begin // M
        m_blocks = Int32(0)
        if n_last >= n0 and row_end > row_begin:
            m_blocks = (row_end + M - 1) // M - m_block_min
        n_iters = m_blocks * group
        rotation, rotated_first, rotated_kv_blocks = Int32(0), Int32(0), Int32(0)
        chains, chain_first, chain_count = Int32(1), Int32(0), Int32(1)
        if cutlass.const_expr(self.deterministic):
            chains = self._dq_chain_count(tma_dQ, mdK.shape[0], mLSE.shape[1], seqlen_q)
            rotation, rotated_first, rotated_kv_blocks, chain_first, chain_count = rotated_order(
                n_block, m_blocks, kv_len, N, lo, hi, seqlen_q, seqlen_k, resident_ctas, chains
            )

        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dQ):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.deterministic):
                cpasync.prefetch_descriptor(tma_atom_dQ_store)

        kv_bar = storage.kv_bar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(kv_bar, 1)
        bytes_QdO = sum(cute.size_in_bytes(self.dtype, cute.slice_(x, (None, None, 0))) for x in (sQ_layout, sdO_layout))
        bytes_KV = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0))) + cute.size_in_bytes(
            self.dtype, cute.slice_(sV_layout, (None, None, 0))
        )
        # Full barrier: the producer's expect-tx arrive plus the TMA bytes;
        # empty barrier: one arrive per consumer warp. Creation fences the
        # mbarrier inits (kv_bar included) and syncs the CTA.
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipe_bar.data_ptr(),
            num_stages=st,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # dq_in_stage: a dQ writer warp frees a stage once its TMA has
            # read the dQ tile written over it.
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 if self.dq_in_stage else NUM_MMA_THREADS // 32
            ),
            tx_count=bytes_QdO,
        )

        layouts = dict(sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout, sdS=sdS_layout, sdQ=sdQ_layout)
        sQ, sdO, sdQ, sStats, sK, sV, sdS, sP = shared_tiles(
            storage, layouts, self.dtype, M, st, self.dq_in_stage, self.dq_in_tiles, self.split_head_dim
        )
        nan_flags = storage.nan_flags.get_tensor(cute.make_layout(st))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == LOAD_WARP:
                self._produce(
                    tma_Q, tma_K, tma_V, tma_dO, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO,
                    sQ, sK, sV, sdO, pipe, kv_bar, bytes_KV,
                    n_block, kv_head, batch, group, m_block_min, m_blocks, rotation, n_iters,
                )
            if warp_idx == STATS_WARP and cutlass.const_expr(self.stats_warp):
                self._load_stats(
                    mLSE, mDelta, sStats, nan_flags, batch, kv_head, group, m_block_min, m_blocks, rotation, n_iters,
                    seqlen_q,
                )
            if cutlass.const_expr(self.staggered):
                dq_args = (tma_dQ, tma_atom_dQ, sdQ, mDqSem, hi, q_len, kv_len, n_block, kv_head, batch,
                           mdK.shape[0], group, m_block_min, m_blocks, rotation, rotated_first, rotated_kv_blocks,
                           chains, chain_first, chain_count, n_iters)
                if warp_idx == DQ_WARP:
                    self._write_dq_halves(*dq_args, (1, 0) if self.dq_writers == 1 else (1,),
                                          tma_dQ_store, tma_atom_dQ_store)
                if cutlass.const_expr(self.dq_writers == NUM_MMA_WG):
                    if warp_idx == DQ_WARP + 1:
                        self._write_dq_halves(*dq_args, (0,), tma_dQ_store, tma_atom_dQ_store)
            elif warp_idx >= DQ_WARP and warp_idx < DQ_WARP + self.dq_writers:
                self._write_dq(
                    tma_dQ, tma_atom_dQ, sdQ, pipe, mDqSem, hi, q_len, kv_len, n_block, kv_head, batch,
                    mdK.shape[0], group, m_block_min, m_blocks, rotation, rotated_first, rotated_kv_blocks,
                    chains, chain_first, chain_count, n_iters, warp_idx - DQ_WARP, mLSE.shape[1], seqlen_q,
                    tma_dQ_store, tma_atom_dQ_store,
                )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(
                mLSE, mDelta, sStats, nan_flags, mdQ, mdK, mdV, sQ, sK, sV, sdO, sdS, sP, sdQ, pipe, kv_bar,
                mma_sdp, mma_dkv, mma_dq, store_dk,
                scale, scale_log2, softcap_in, lo, hi, n_block, kv_head, batch, group,
                m_block_min, m_blocks, rotation, n_iters, q_len, kv_len, seqlen_q, seqlen_k, mQSeg, mKVSeg,
            )

    @cute.jit
    def _consume(
        self, mLSE, mDelta, sStats, nan_flags, mdQ, mdK, mdV, sQ, sK, sV, sdO, sdS, sP, sdQ, pipe, kv_bar,
        mma_sdp, mma_dkv, mma_dq, store_dk,
        scale, scale_log2, softcap_in, lo, hi, n_block, kv_head, batch, group,
        m_block_min, m_blocks, rotation, n_iters, q_len, kv_len, seqlen_q, seqlen_k, mQSeg, mKVSeg,
    ):
        D, Dv, M, N = self.head_dim, self.head_dim_v, self.m_block, self.n_block
        split = self.split_head_dim
        inv_scale_log2 = Float32(0.0)
        if cutlass.const_expr(self.slope_from_probability):
            inv_scale_log2 = Float32(1.0) / scale_log2
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - WG_THREADS
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        lane = cute.arch.lane_idx()
        # First query row (within the tile) of this WG's S^T / dP^T columns.
        wg_row0 = wg * (M // NUM_MMA_WG) if split else 0

        # Transposed views (same bytes) for the MN-major operands.
        sQt = transposed(sQ)
        sdOt = transposed(sdO)
        sKt = transposed(sK)
        sdS_rows = transposed(sdS)  # (query rows, keys): an operand of dQ

        # Shared-memory operands are partitioned per warpgroup (descriptors),
        # accumulators per thread.
        wg_sdp = mma_sdp.get_slice(wg * WG_THREADS)
        wg_dkv = mma_dkv.get_slice(wg * WG_THREADS)
        mma_dv = key_rows_mma(self.dtype, Dv, split)
        wg_dv = mma_dv.get_slice(wg * WG_THREADS)
        wg_dq = mma_dq.get_slice(wg * WG_THREADS)
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(sdOt))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt))
        # dQ = dS K, or dQ^T = K^T dS^T (dq_transposed).
        dq_a, dq_b = (sKt, sdS_rows) if self.dq_transposed else (sdS_rows, sKt)
        dq_shape = (D, M) if self.dq_transposed else (M, D)
        tdQrA = wg_dq.make_fragment_A(wg_dq.partition_A(dq_a))
        tdQrB = wg_dq.make_fragment_B(wg_dq.partition_B(dq_b))
        if cutlass.const_expr(split):
            tdVrP = wg_dv.make_fragment_A(wg_dv.partition_A(sP))
            tdKrdS = wg_dkv.make_fragment_A(wg_dkv.partition_A(sdS))

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((N, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((N, Dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # dS^T: registers -> shared with stmatrix (four 8x8 tiles per
        # instruction, few address registers).
        stsm_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        r2s_sdp = cute.make_tiled_copy_C(stsm_atom, mma_sdp)
        thr_r2s = r2s_sdp.get_slice(tidx)
        tdSsdS = thr_r2s.partition_D(sdS)
        if cutlass.const_expr(split):
            tPsP = thr_r2s.partition_D(sP)
        # dQ^T: registers -> the swizzled fp32 tile, one element per store into
        # the transposed view: the four rows of sdQ one store instruction
        # writes fall in distinct banks (swizzle). dQ in tiles:
        # store_dq_fragments.
        r2s_dq, thr_r2s_dq, tdQsdQ = None, None, None
        if cutlass.const_expr(self.dq_transposed):
            r2s_dq = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=32), mma_dq
            )
            thr_r2s_dq = r2s_dq.get_slice(tidx)
            tdQsdQ = thr_r2s_dq.partition_D(transposed(sdQ))  # dq_in_stage: with a stage mode
        dq_warp = cute.arch.make_warp_uniform((tidx % WG_THREADS) // 32)

        # S^T and dP^T tiles: (key, query row) of every accumulator element.
        tScS = wgmma_acc_as_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((N, M))))
        n_keys = cute.size(tScS, mode=[0])
        n0 = n_block * N
        # Segment ids of this thread's keys (fixed for the CTA); positions
        # past the sequence read a clamped id and are masked anyway.
        key_seg = cute.make_rmem_tensor(n_keys, Int32)
        if cutlass.const_expr(self.has_segments):
            for r in cutlass.range_constexpr(n_keys):
                key_seg[r] = mKVSeg[batch, cutlass.min(n0 + tScS[r, 0][0], seqlen_k - 1)]

        # K is loaded once: its NaN and Inf are dealt with once (nan_guard.py).
        # Nonzero where it held one: then every tile counts as partial.
        bad_keys = Int32(0)
        if n_iters > 0:
            cute.arch.mbarrier_wait(kv_bar, 0)
            bad_keys = check_keys(sK, tScS, n0, kv_len, tidx, BAR_EPI, NUM_MMA_THREADS, self.dtype)
        if cutlass.const_expr(self.staggered):
            self._announce_virtual_tile(wg, n_iters)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # Each query tile is found an iteration ahead: its divisions, at the
        # top of the loop, held back the first GEMMs (docs/history.md).
        head, m_block = query_tile_of(Int32(0), kv_head, group, m_block_min, m_blocks, self.deterministic, rotation)
        # Statistics of the query rows (see transposed_scores): the columns of
        # this thread repeat in every quad of its warp, so each lane takes the
        # pair its quad index selects and the others come by shuffles. With
        # dq_transposed each thread reads its own columns from sStats: the
        # shuffles' source lanes took registers that 80 query rows lack.
        if cutlass.const_expr(self.stats_warp):
            # The first of this lane's two rows in sStats. With split_head_dim
            # a WG has M / 2 query columns, and the lanes past them (whose
            # values no thread takes) read the last rows, not the next stage.
            stat_row = cutlass.min(wg_row0 + own_query_column(lane, 0), M - 2)
        else:
            # Loaded from global memory one query tile ahead (issued with the
            # S^T / dP^T GEMMs, the loads outlasted them).
            lse_q = cute.make_rmem_tensor(2, Float32)
            delta_q = cute.make_rmem_tensor(2, Float32)
            if n_iters > 0:
                load_query_stats(lse_q, delta_q, mLSE, mDelta, batch, head, m_block * M + wg_row0, lane, seqlen_q)
        for it in cutlass.range(n_iters, unroll=1):
            m0 = m_block * M
            s = state.index

            pipe.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((N, M)), Float32)
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((N, M)), Float32)
            issue_wgmma(mma_sdp, acc_S, tSrK[None, None, None, 0], tSrQ[None, None, None, s], True)
            issue_wgmma(mma_sdp, acc_dP, tdPrV[None, None, None, 0], tdPrdO[None, None, None, s], True)

            lse_log2_pair = cute.make_rmem_tensor(2, Float32)
            delta_pair = cute.make_rmem_tensor(2, Float32)
            if cutlass.const_expr(self.stats_warp):
                stats_stage = it % self.stages
                if cutlass.const_expr(self.staggered):
                    cute.arch.barrier(barrier_id=bar_stats_of_wg(wg), number_of_threads=HALF_BAR_THREADS)
                else:
                    cute.arch.barrier(barrier_id=BAR_STATS, number_of_threads=DQ_BAR_THREADS)
                if cutlass.const_expr(not self.dq_transposed):
                    for b in cutlass.range_constexpr(2):
                        lse_log2_pair[b] = sStats[stat_row + b, 0, stats_stage]
                        delta_pair[b] = sStats[stat_row + b, 1, stats_stage]
            else:
                for b in cutlass.range_constexpr(2):
                    lse_log2_pair[b] = lse_to_log2(lse_q[b])
                    delta_pair[b] = delta_q[b]
            smem_stats = None
            if cutlass.const_expr(self.dq_transposed):
                smem_stats = (sStats, stats_stage, tScS)
            stats = QueryStats(lse_log2_pair, delta_pair, lane, smem_stats)

            n_seg = 2 * stat_pairs(M // NUM_MMA_WG if split else M)
            seg_pair = cute.make_rmem_tensor(n_seg, Int32)
            tile_differs = False
            if cutlass.const_expr(self.has_segments):
                for i in cutlass.range_constexpr(n_seg):
                    row = m0 + wg_row0 + own_query_column(lane, i % 2, i // 2)
                    seg_pair[i] = mQSeg[batch, cutlass.min(row, seqlen_q - 1)]
                tile_differs = warp_sees_several_ids(key_seg, seg_pair)

            warpgroup.wait_group(1)
            if cutlass.const_expr(self.slope_from_probability):
                cap_scores(acc_S, softcap_in)
            elif cutlass.const_expr(self.has_softcap):
                acc_slope = cute.make_fragment_like(acc_S)
                cap_scores_with_slope(acc_S, acc_slope, softcap_in)
            acc_S_mn = wgmma_acc_as_rows_cols(acc_S)
            # With dq_transposed lse comes from sStats here: read before the
            # S^T wait instead, it spilled more and ran no faster
            # (docs/kernel-evidence.md).
            probabilities_in_place(acc_S_mn, stats, scale_log2)
            full_tile = (
                m0 + M <= q_len
                and n0 + N <= kv_len
                and bad_keys == 0
                and n0 - (m0 + M - 1) >= lo
                and (n0 + N - 1) - m0 <= hi
            )
            # NaN and Inf (nan_guard.py): on a partial tile (with documents,
            # on every tile), before the dV / dK GEMMs.
            masked = not full_tile
            if cutlass.const_expr(self.has_segments):
                masked = tile_differs or not full_tile
            # (Packed documents with dq_transposed: on every tile, which
            # keeps ptxas from spilling more at hd128 than without the guard.)
            guard = True if self.has_segments and self.dq_transposed else masked
            if guard:
                force_bad_keys(acc_S_mn, bad_keys)
                pairs = None if self.stats_warp else (lse_log2_pair, delta_pair)
                if query_rows_flagged(pairs, nan_flags, stats_stage if self.stats_warp else 0):
                    zero_query_stage(sQ, sdO, s, lane, self.dtype)
                    poison_bad_delta_rows(acc_S_mn, stats)
            if cutlass.const_expr(self.has_segments):
                if tile_differs:
                    zero_hidden_pairs(acc_S_mn, tScS, m0, n0, q_len, kv_len, lo, hi, key_seg, seg_pair, lane)
                elif not full_tile:
                    zero_hidden_pairs(acc_S_mn, tScS, m0, n0, q_len, kv_len, lo, hi)
            elif not full_tile:
                zero_hidden_pairs(acc_S_mn, tScS, m0, n0, q_len, kv_len, lo, hi)
            rPt = cute.make_fragment_like(acc_S, self.dtype)
            if cutlass.const_expr(split):
                rPt.store(acc_S.load().to(self.dtype))
                # dV needs every query row of P^T: the other WG's half too.
                cute.copy(r2s_sdp, thr_r2s.retile(rPt), tPsP[None, None, None, s])
                warpgroup.wait_group(0)
            elif cutlass.const_expr(self.dq_transposed):
                # 16-bit P^T next to the fp32 S^T, dP^T, dK and dV: more than
                # 240 registers (ptxas serialised every WGMMA), so P^T is
                # converted once dS^T has read the fp32 one, and dV issued
                # after the dS^T stores (issued before them, it serialised too).
                warpgroup.wait_group(0)
            else:
                rPt.store(acc_S.load().to(self.dtype))
                # P^T stays in registers as the A operand of dV += P^T dO,
                # which only needs this warpgroup's keys: no barrier before it.
                issue_wgmma(mma_dv, acc_dV, as_operand_a(rPt), tdVrdOt[None, None, None, s], False)
                warpgroup.wait_group(1)
            score_gradients_in_place(wgmma_acc_as_rows_cols(acc_dP), acc_S_mn, stats, self.slope_from_probability,
                                     inv_scale_log2)
            if cutlass.const_expr(self.has_softcap and not self.slope_from_probability):
                acc_dP.store(acc_dP.load() * acc_slope.load())
            # dS = 0 where P is hidden: delta or dP may be NaN there. With
            # dq_transposed on the 16-bit copies, made first (the fp32 ones
            # beside everything else serialised the WGMMAs at fp16 hd128).
            if cutlass.const_expr(not self.zero_ds_in_16_bits):
                if masked:
                    zero_where_hidden(acc_dP, acc_S)
            if cutlass.const_expr(self.dq_transposed):
                rPt.store(acc_S.load().to(self.dtype))
            rdSt = cute.make_fragment_like(acc_dP, self.dtype)
            rdSt.store(acc_dP.load().to(self.dtype))
            if cutlass.const_expr(self.zero_ds_in_16_bits):
                if masked:
                    zero_where_hidden(rdSt, rPt)
            if cutlass.const_expr(self.staggered):
                self._wait_ds_buffer_free(it, wg, s)
            cute.copy(r2s_sdp, thr_r2s.retile(rdSt), tdSsdS[None, None, None, s])
            if cutlass.const_expr(self.dq_transposed):
                issue_wgmma(mma_dv, acc_dV, as_operand_a(rPt), tdVrdOt[None, None, None, s], False)

            # Generic-proxy stores must be visible to WGMMA (async proxy),
            # and dQ reads the other WG's keys of dS.
            cute.arch.fence_view_async_shared()
            dq_tile, dq_buffer = it, s
            if cutlass.const_expr(self.staggered):
                dq_tile, dq_buffer = self._hand_over_ds(it, wg, s)
            else:
                cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=NUM_MMA_THREADS)
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C(dq_shape), Float32)
            a_stage, b_stage = (0, dq_buffer) if self.dq_transposed else (s, 0)  # K has one stage
            issue_wgmma(mma_dq, acc_dQ, tdQrA[None, None, None, a_stage], tdQrB[None, None, None, b_stage], True)
            if cutlass.const_expr(split):
                issue_wgmma(mma_dv, acc_dV, tdVrP[None, None, None, s], tdVrdOt[None, None, None, s], False)
                issue_wgmma(mma_dkv, acc_dK, tdKrdS[None, None, None, s], tdKrQt[None, None, None, s], False)
            else:
                issue_wgmma(mma_dkv, acc_dK, as_operand_a(rdSt), tdKrQt[None, None, None, s], False)

            # dQ leaves while the dK (and dV) GEMMs are still in flight.
            warpgroup.wait_group(2 if split else 1)
            if cutlass.const_expr(self.staggered):
                self._release_ds_buffer(dq_tile, dq_buffer, wg, n_iters)
            acc_dQ.store(acc_dQ.load() * scale)
            self._hand_dq_to_writer(acc_dQ, it, s, wg, dq_warp, lane, sdQ, r2s_dq, thr_r2s_dq, tdQsdQ)
            head, m_block = query_tile_of(
                cutlass.min(it + 1, n_iters - 1), kv_head, group, m_block_min, m_blocks, self.deterministic, rotation
            )
            if cutlass.const_expr(not self.stats_warp):
                # After the dQ hand-off, whose shared-memory fence would wait
                # for these loads too.
                load_query_stats(lse_q, delta_q, mLSE, mDelta, batch, head, m_block * M + wg_row0, lane, seqlen_q)
            warpgroup.wait_group(0)
            if cutlass.const_expr(not self.dq_in_stage):
                pipe.consumer_release(state)
            state.advance()

        if cutlass.const_expr(self.staggered):
            self._leader_last_dq(wg, n_iters, (state.index + self.stages - 1) % self.stages, scale, thr_dq, dq_shape,
                                 tdQrA, tdQrB, r2s_dq, thr_r2s_dq, tdQsdQ)

        # ---- epilogue: dK, dV staged through sK / sV (no GEMM reads them now).
        cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=NUM_MMA_THREADS)
        stage_accumulator(acc_dK, stsm_atom, mma_dkv, sK, tidx, self.dtype, scale)
        stage_accumulator(acc_dV, stsm_atom, mma_dv, sV, tidx, self.dtype)
        cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=NUM_MMA_THREADS)
        store_existing_rows(store_dk, sK[None, None, 0], mdK[batch, None, kv_head, None], n_block, seqlen_k, tidx, N, D, self.dtype)
        store_dv = row_store_tile(self.dtype, Dv, NUM_MMA_THREADS)
        store_existing_rows(store_dv, sV[None, None, 0], mdV[batch, None, kv_head, None], n_block, seqlen_k, tidx, N, Dv, self.dtype)
