"""FlashAttention-2 style backward pass for SM80+ in the CuTe Python DSL.

One CTA owns one KV tile of one (batch, kv head). It keeps that tile's K and V
in shared memory and its dK/dV accumulators in registers, and walks every
query head of its GQA group and every query tile that the mask lets see the
KV tile. Per query tile (all tensor-core work is mma.sync m16n8k16, fp32
accumulation):

    S  = Q K^T                         P  = exp2(S * scale * log2e - lse * log2e)
    dP = dO V^T                        dS = P * (dP - delta)
    dV += P^T dO                       dK += dS^T Q       (times scale at the end)
    dQ += scale * dS K                 (fp32 atomics into the global accumulator)

Q, dO, lse and delta are double buffered: the cp.async loads of the next query
tile are in flight while the current one is computed.

The packed-document variant (has_segments) also requires equal segment ids:
each CTA narrows its query range to the union of its keys' q_bounds and
compares ids on every visited tile (the bounds only say where visible
queries can be, not that every query inside them is visible).

NaN and Inf: sm80_nan_guard.py (a tile whose pairs are all visible runs the code
it ran before).
"""

from dataclasses import dataclass
from typing import Optional, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from ..common.dsl_common import (
    LOG2E,
    WARP_SIZE,
    cap_scores_with_slope,
    first_kv_block_seeing,
    logit_scales,
    query_tile_of,
    release_add_s32,
    wait_at_least,
    m16n8_acc_as_rows_cols,
    red_add_v2_f32,
    segment_bounds_union,
    store_existing_rows,
    zero_outside_key_window,
)
from ..common.hidden_pairs import HIDDEN, zero_where_hidden
from ..common.segment_tiles import MIXED, segment_key
from .sm80_nan_guard import check_keys, poison_rows, zero_flagged_stage

NUM_THREADS = 256  # 8 warps
SMEM_CAPACITY_SM80 = 163 * 1024


@dataclass(frozen=True)
class TileConfig:
    m_block: int  # query rows per inner iteration
    n_block: int  # keys per CTA


# Frozen per head dim. Shared memory holds 2 stages of Q and dO, one K and V
# tile and the P/dS tiles; it must stay under the 163 KiB of an A100 so the
# sm_80 objects run on every 8.x part of that class. Registers hold dK and dV
# (n_block * head_dim * 2 / 256 floats per thread), which caps n_block at 64
# for the two large head dims. hd256 drops to 32 query rows because two
# 64-row stages of Q and dO alone would be 128 KiB.
# Measured on H100 (bf16, batch 2, 16 heads, seq 8192, backward TFLOPS,
# non-causal / causal; torch's FA2 in the same process in brackets):
# hd64 ~222 / 217 (278 / 253), hd128 290 / 276 (307 / 292),
# hd256 ~184 / 184 (263 / 250).
TILE_CONFIGS = {
    64: TileConfig(m_block=64, n_block=128),  # 97 KiB smem
    96: TileConfig(m_block=64, n_block=128),  # 129 KiB
    128: TileConfig(m_block=64, n_block=128),  # 161 KiB
    192: TileConfig(m_block=64, n_block=64),  # 161 KiB
    256: TileConfig(m_block=32, n_block=64),  # 137 KiB
}


class FlashBwdSm80:
    def __init__(
        self, dtype: Type[cutlass.Numeric], head_dim: int, arch: str = "sm_80", has_segments: bool = False
    ):
        if not self.can_implement(dtype, head_dim):
            raise NotImplementedError(f"no sm80 backward for dtype={dtype}, head_dim={head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.has_segments = has_segments
        cfg = TILE_CONFIGS[head_dim]
        self.m_block = cfg.m_block
        self.n_block = cfg.n_block
        self.num_stages = 2
        # Hopper has 2-wide fp32 reductions: half as many dQ atomics, which
        # took hd128 from 232 to 285 TFLOPS on H100.
        self.dq_atomic_width = 2 if arch.startswith("sm_9") else 1
        # Warp grids (rows, cols) of the three MMA shapes. Each warp's
        # column extent is a multiple of 16 so B fragments load with ldmatrix.x4.
        self.atoms_sdp = (2, 4)  # S, dP: m_block x n_block
        self.atoms_dkv = (4, 2)  # dK, dV: n_block x head_dim
        # dQ: 32x32 warp tiles read the least shared memory (+2% at hd128
        # over 16x64 ones); 96 columns do not split into 4 warps x 16, so
        # hd96 (and the 32-row hd256 tile) use 16-row warp tiles.
        if self.m_block == 64 and head_dim % 64 == 0:
            self.atoms_dq = (2, 4)
        else:
            self.atoms_dq = (self.m_block // 16, 8 // (self.m_block // 16))

    @staticmethod
    def can_implement(dtype, head_dim) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16) or head_dim not in TILE_CONFIGS:
            return False
        return FlashBwdSm80.smem_bytes(head_dim) <= SMEM_CAPACITY_SM80

    @staticmethod
    def smem_bytes(head_dim: int) -> int:
        cfg = TILE_CONFIGS[head_dim]
        q_do = 2 * 2 * cfg.m_block * head_dim * 2
        k_v = 2 * cfg.n_block * head_dim * 2
        p_ds = 2 * cfg.m_block * cfg.n_block * 2
        stats = 2 * 2 * cfg.m_block * 4
        return q_do + k_v + p_ds + stats

    # ------------------------------------------------------------------ host
    def _smem_layout(self, rows: int, cols: int, stages: int = 0):
        # 128-byte rows of a swizzled atom make ldmatrix conflict free; 96 is
        # not a multiple of 64 elements, so it takes the 64-byte atom.
        atom_cols = 64 if cols % 64 == 0 else 32
        atom = cute.make_composed_layout(
            cute.make_swizzle(3 if atom_cols == 64 else 2, 3, 3),
            0,
            cute.make_layout((8, atom_cols), stride=(atom_cols, 1)),
        )
        if stages:
            return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    def _tiled_mma(self, atoms):
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (atoms[0], atoms[1], 1),
            permutation_mnk=(atoms[0] * 16, atoms[1] * 16, 16),
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, T, Hq, D]
        mK: cute.Tensor,  # [B, S, Hkv, D]
        mV: cute.Tensor,  # [B, S, Hkv, D]
        mdO: cute.Tensor,  # [B, T, Hq, D]
        mLSE: cute.Tensor,  # [B, Hq, T] f32
        mDelta: cute.Tensor,  # [B, Hq, T] f32
        mQLens: cute.Tensor,  # [B] i32
        mKVLens: cute.Tensor,  # [B] i32
        mdQ: cute.Tensor,  # [B, T, Hq, D] f32, zeroed by the caller
        mdK: cute.Tensor,  # [B, S, Hkv, D]
        mdV: cute.Tensor,  # [B, S, Hkv, D]
        mDqSem: cute.Tensor,  # [B, Hq, ceil(T / 32)] i32, zeroed; deterministic only
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
        """key_lo/key_hi bound j - i for a visible (query i, key j) pair. The
        launcher derives them from diag_offset and the window and clamps them
        to +-(seqlen_q + seqlen_k + 1) when a side is unbounded, so the int32
        arithmetic below cannot overflow."""
        if cutlass.const_expr(mQ.element_type != self.dtype):
            raise TypeError("q dtype does not match the compiled variant")
        if cutlass.const_expr(self.has_segments != (mQSeg is not None)):
            raise TypeError("segment tensors must be given exactly for the has_segments variant")
        D, M, N = self.head_dim, self.m_block, self.n_block
        sQ_layout = self._smem_layout(M, D, self.num_stages)
        sKV_layout = self._smem_layout(N, D)
        sPdS_layout = self._smem_layout(M, N)
        sStat_layout = cute.make_layout((M, self.num_stages), stride=(1, M))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128]
            # Per-warp partial (min first, max last) of the keys' q_bounds.
            sSegRange: cute.struct.MemRange[Int32, 2 * (NUM_THREADS // WARP_SIZE)]

        # 16-byte cp.async rows for Q/K/V/dO, 4-byte ones for lse/delta.
        vec = 128 // self.dtype.width
        atom_cols = 64 if D % 64 == 0 else 32
        thr_cols = atom_cols // vec
        thr_layout = cute.make_ordered_layout((NUM_THREADS // thr_cols, thr_cols), order=(1, 0))
        g2s_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128
        )
        gmem_copy_tile = cute.make_tiled_copy_tv(g2s_atom, thr_layout, cute.make_layout((1, vec)))
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        gmem_store_tile = cute.make_tiled_copy_tv(store_atom, thr_layout, cute.make_layout((1, vec)))
        stat_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        gmem_copy_stat = cute.make_tiled_copy_tv(stat_atom, cute.make_layout(M), cute.make_layout(1))

        grid = (cute.ceil_div(mK.shape[1], N), mK.shape[2], mK.shape[0])
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mDelta, mQLens, mKVLens, mdQ, mdK, mdV, mDqSem,
            scale, softcap, key_lo, key_hi, deterministic, mQSeg, mKVSeg, mQBounds,
            sQ_layout, sKV_layout, sPdS_layout, sStat_layout,
            gmem_copy_tile, gmem_store_tile, gmem_copy_stat,
            self._tiled_mma(self.atoms_sdp), self._tiled_mma(self.atoms_dkv), self._tiled_mma(self.atoms_dq),
            SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE: cute.Tensor, mDelta: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mDqSem: cute.Tensor,
        scale: Float32, softcap: Float32, lo: Int32, hi: Int32, deterministic: Int32,
        mQSeg: Optional[cute.Tensor], mKVSeg: Optional[cute.Tensor], mQBounds: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout, sStat_layout: cute.Layout,
        gmem_copy_tile: cute.TiledCopy, gmem_store_tile: cute.TiledCopy, gmem_copy_stat: cute.TiledCopy,
        mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        D, M, N = self.head_dim, self.m_block, self.n_block
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = cute.arch.block_idx()
        scale_log2, softcap_in = logit_scales(scale, softcap)
        seqlen_q = mQ.shape[1]
        seqlen_k = mK.shape[1]
        group = mQ.shape[2] // mK.shape[2]

        # ---- mask geometry: key j is visible from query i iff
        # i < q_len, j < kv_len and lo <= j - i <= hi.
        q_len = cutlass.min(mQLens[batch], seqlen_q)
        kv_len = cutlass.min(mKVLens[batch], seqlen_k)
        n0 = n_block * N
        n_last = cutlass.min(n0 + N, kv_len) - 1
        # Rows [row_begin, row_end) see at least one key of this tile.
        row_begin = cutlass.max(n0 - hi, 0)
        row_end = cutlass.min(q_len, n_last - lo + 1)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if cutlass.const_expr(self.has_segments):
            seg_begin, seg_end = segment_bounds_union(
                mQBounds, storage.sSegRange.get_tensor(cute.make_layout(2 * (NUM_THREADS // WARP_SIZE))),
                batch, n0, n_last, tidx, self.n_block, NUM_THREADS // WARP_SIZE,
            )
            # The deterministic order needs the CTAs that visit a query tile
            # to be consecutive, which the mask geometry guarantees and the
            # documents' bounds do not: it visits every geometric tile.
            if deterministic == 0:
                row_begin = cutlass.max(row_begin, seg_begin)
                row_end = cutlass.min(row_end, seg_end)
        m_block_min = row_begin // M
        m_blocks = Int32(0)
        if n_last >= n0 and row_end > row_begin:
            m_blocks = (row_end + M - 1) // M - m_block_min
        n_iters = m_blocks * group

        # ---- shared memory
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sP = storage.sP.get_tensor(sPdS_layout)
        sdS = storage.sdS.get_tensor(sPdS_layout)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sDelta = storage.sDelta.get_tensor(sStat_layout)
        # Transposed views (column-major reinterpretation of the same bytes).
        stages = self.num_stages
        sQt = cute.composition(sQ, cute.make_layout((D, M, stages), stride=(M, 1, M * D)))
        sdOt = cute.composition(sdO, cute.make_layout((D, M, stages), stride=(M, 1, M * D)))
        sKt = cute.composition(sK, cute.make_layout((D, N), stride=(N, 1)))
        sPt = cute.composition(sP, cute.make_layout((N, M), stride=(M, 1)))
        sdSt = cute.composition(sdS, cute.make_layout((N, M), stride=(M, 1)))

        # ---- MMA partitions
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ[None, None, 0]))
        tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        tdPrdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO[None, None, 0]))
        tdPrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
        tdVrPt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt))
        tdVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt[None, None, 0]))
        tdKrdSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt))
        tdKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt[None, None, 0]))
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt))

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((N, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((N, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # ---- shared -> register copies (ldmatrix; .trans for transposed views)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_sdp_A = cute.make_tiled_copy_A(ldsm, mma_sdp)
        s2r_sdp_B = cute.make_tiled_copy_B(ldsm, mma_sdp)
        s2r_dkv_A = cute.make_tiled_copy_A(ldsm_t, mma_dkv)
        s2r_dkv_B = cute.make_tiled_copy_B(ldsm_t, mma_dkv)
        s2r_dq_A = cute.make_tiled_copy_A(ldsm, mma_dq)
        s2r_dq_B = cute.make_tiled_copy_B(ldsm_t, mma_dq)
        tSsQ = s2r_sdp_A.get_slice(tidx).partition_S(sQ)
        tSsK = s2r_sdp_B.get_slice(tidx).partition_S(sK)
        tdPsdO = s2r_sdp_A.get_slice(tidx).partition_S(sdO)
        tdPsV = s2r_sdp_B.get_slice(tidx).partition_S(sV)
        tdVsPt = s2r_dkv_A.get_slice(tidx).partition_S(sPt)
        tdVsdOt = s2r_dkv_B.get_slice(tidx).partition_S(sdOt)
        tdKsdSt = s2r_dkv_A.get_slice(tidx).partition_S(sdSt)
        tdKsQt = s2r_dkv_B.get_slice(tidx).partition_S(sQt)
        tdQsdS = s2r_dq_A.get_slice(tidx).partition_S(sdS)
        tdQsKt = s2r_dq_B.get_slice(tidx).partition_S(sKt)

        # register -> shared for P and dS (2 elements per store)
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width)
        r2s_PdS = cute.make_tiled_copy_C(r2s_atom, mma_sdp)
        tPsP = r2s_PdS.get_slice(tidx).partition_D(sP)
        tdSsdS = r2s_PdS.get_slice(tidx).partition_D(sdS)

        # Coordinates of this thread's S/dP and dQ accumulator elements.
        tScS = m16n8_acc_as_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((M, N))))
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((M, D)))
        # Segment ids of this thread's S columns (fixed for the CTA) and rows.
        num_rows = cute.size(tScS, mode=[0])
        num_cols = cute.size(tScS, mode=[1])
        row_seg = cute.make_rmem_tensor(num_rows, Int32)
        col_seg = cute.make_rmem_tensor(num_cols, Int32)
        if cutlass.const_expr(self.has_segments):
            for c in cutlass.range_constexpr(num_cols):
                col_seg[c] = mKVSeg[batch, cutlass.min(n0 + tScS[0, c][1], seqlen_k - 1)]

        gmem_thr = gmem_copy_tile.get_slice(tidx)
        cTile = cute.make_identity_tensor((M, D))
        tQcQ = gmem_thr.partition_S(cTile)
        tQsQ = gmem_thr.partition_D(sQ)
        tdOsdO = gmem_thr.partition_D(sdO)

        if n_iters > 0:
            # Zeros past kv_len (sm80_nan_guard.py); K and V in a group of their own.
            self._load_rows(gmem_copy_tile, gmem_thr, mK[batch, None, kv_head, None], sK, n_block, kv_len, N)
            self._load_rows(gmem_copy_tile, gmem_thr, mV[batch, None, kv_head, None], sV, n_block, kv_len, N)
            cute.arch.cp_async_commit_group()
            self._load_q_tile(
                0, m_blocks, m_block_min, deterministic, kv_head, group, batch, 0, mQ, mdO, mLSE, mDelta, sLSE, sDelta,
                gmem_copy_tile, gmem_thr, gmem_copy_stat, tQcQ, tQsQ, tdOsdO, seqlen_q, tidx,
            )
        cute.arch.cp_async_commit_group()
        # K's NaN and Inf, once (sm80_nan_guard.py); nonzero: every tile partial.
        # With packed documents, the id of the CTA's keys (MIXED: several).
        bad_keys = Int32(0)
        keys_id = Int32(0)
        if n_iters > 0:
            cute.arch.cp_async_wait_group(1)
            bad_keys = check_keys(sK, gmem_copy_tile, tScS, tidx, NUM_THREADS, self.dtype)
            if cutlass.const_expr(self.has_segments):
                keys_id = segment_key(mKVSeg, batch, n0, N)

        for it in cutlass.range(n_iters, unroll=1):
            stage = it % 2
            if it + 1 < n_iters:
                self._load_q_tile(
                    it + 1, m_blocks, m_block_min, deterministic, kv_head, group, batch, 1 - stage, mQ, mdO, mLSE, mDelta,
                    sLSE, sDelta, gmem_copy_tile, gmem_thr, gmem_copy_stat, tQcQ, tQsQ, tdOsdO, seqlen_q, tidx,
                )
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()

            head, m_block = query_tile_of(it, kv_head, group, m_block_min, m_blocks, deterministic)
            m0 = m_block * M

            # S = Q K^T, then P in place.
            if cutlass.const_expr(self.has_segments):
                # Loaded ahead of the MMAs to hide their latency; rows past
                # seqlen_q read a clamped id and are masked by q_len anyway.
                for r in cutlass.range_constexpr(num_rows):
                    row_seg[r] = mQSeg[batch, cutlass.min(m0 + tScS[r, 0][0], seqlen_q - 1)]
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((M, N)), Float32)
            acc_S.fill(0.0)
            self._gemm(mma_sdp, acc_S, tSrQ, tSrK, tSsQ[None, None, None, stage], tSsK, s2r_sdp_A, s2r_sdp_B, tidx)
            acc_slope = cute.make_fragment_like(acc_S)
            cap_scores_with_slope(acc_S, acc_slope, softcap_in)
            acc_S_mn = m16n8_acc_as_rows_cols(acc_S)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                row = tScS[r, 0][0]
                lse = sLSE[row, stage]
                lse_log2 = lse * LOG2E
                if lse == -Float32.inf:
                    # A row that sees no key: force P to 0 rather than inf.
                    lse_log2 = Float32.inf
                acc_S_mn[r, None].store(
                    cute.math.exp2(acc_S_mn[r, None].load() * scale_log2 - lse_log2, fastmath=True)
                )
            full_tile = (
                m0 + M <= q_len
                and n0 + N <= kv_len
                and bad_keys == 0
                and n0 - (m0 + M - 1) >= lo
                and (n0 + N - 1) - m0 <= hi
            )
            # NaN and Inf (sm80_nan_guard.py) on a partial tile, with documents
            # also on one whose rows or keys carry another id or several (the
            # same answer in every warp: votes; said so, see check_keys). The
            # rows' ids read here rather than with row_seg: less spill.
            partial = not full_tile
            if cutlass.const_expr(self.has_segments):
                mixed = keys_id == MIXED or segment_key(mQSeg, batch, m0, M) != keys_id
                partial = partial or cute.arch.make_warp_uniform(Int32(mixed)) != 0
            rows_flagged = Int32(0)
            if partial:
                rows_flagged = poison_rows(acc_S_mn, tScS, sLSE, sDelta, stage, bad_keys)
            if cutlass.const_expr(self.has_segments):
                zero_outside_key_window(acc_S_mn, tScS, m0, n0, q_len, kv_len, lo, hi, row_seg, col_seg, HIDDEN)
            elif not full_tile:
                zero_outside_key_window(acc_S_mn, tScS, m0, n0, q_len, kv_len, lo, hi, value=HIDDEN)

            # dP = dO V^T, then dS = P * (dP - delta) in place.
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((M, N)), Float32)
            acc_dP.fill(0.0)
            self._gemm(mma_sdp, acc_dP, tdPrdO, tdPrV, tdPsdO[None, None, None, stage], tdPsV, s2r_sdp_A, s2r_sdp_B, tidx)
            acc_dP_mn = m16n8_acc_as_rows_cols(acc_dP)
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                delta = sDelta[tScS[r, 0][0], stage]
                acc_dP_mn[r, None].store(acc_S_mn[r, None].load() * (acc_dP_mn[r, None].load() - delta))
            if softcap_in > Float32(0.0):
                acc_dP.store(acc_dP.load() * acc_slope.load())

            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            rdS = cute.make_fragment_like(acc_dP, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))
            if partial:
                # On the 16-bit copies: the fp32 dS beside P spilled more.
                zero_where_hidden(rdS, rP)
            cute.copy(r2s_PdS, r2s_PdS.get_slice(tidx).retile(rP), tPsP)
            cute.copy(r2s_PdS, r2s_PdS.get_slice(tidx).retile(rdS), tdSsdS)
            if partial:
                zero_flagged_stage(rows_flagged, sQ[None, None, stage], sdO[None, None, stage], gmem_copy_tile, tidx,
                                   NUM_THREADS, self.dtype)
            else:
                cute.arch.barrier()

            self._gemm(mma_dkv, acc_dV, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt[None, None, None, stage], s2r_dkv_A, s2r_dkv_B, tidx)
            self._gemm(mma_dkv, acc_dK, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt[None, None, None, stage], s2r_dkv_A, s2r_dkv_B, tidx)

            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((M, D)), Float32)
            acc_dQ.fill(0.0)
            self._gemm(mma_dq, acc_dQ, tdQrdS, tdQrKt, tdQsdS, tdQsKt, s2r_dq_A, s2r_dq_B, tidx)
            gdQ = cute.local_tile(mdQ[batch, None, head, None], (M, D), (m_block, 0))
            tdQgdQ = thr_dq.partition_C(gdQ)
            rows_left = seqlen_q - m0
            turn = mDqSem.iterator + cute.crd2idx((batch, head, m_block), mDqSem.layout)
            if deterministic != 0:
                # Wait until the KV tiles before this one have added their dQ.
                if tidx == 0:
                    wait_at_least(turn, n_block - first_kv_block_seeing(m_block, M, N, lo))
                cute.arch.barrier()
            # Accumulator elements 2k and 2k+1 are adjacent columns of one row.
            width = self.dq_atomic_width
            for i in cutlass.range_constexpr(0, cute.size(acc_dQ), width):
                if tdQcdQ[i][0] < rows_left:
                    ptr = tdQgdQ.iterator + cute.crd2idx(i, tdQgdQ.layout)
                    if cutlass.const_expr(width == 2):
                        red_add_v2_f32(ptr, acc_dQ[i] * scale, acc_dQ[i + 1] * scale)
                    else:
                        cute.arch.atomic_add(ptr, acc_dQ[i] * scale)
            # Next iteration overwrites sP/sdS and the stage read here.
            cute.arch.barrier()
            if deterministic != 0 and tidx == 0:
                release_add_s32(turn, Int32(1))

        # ---- epilogue: dK, dV through the (now free) K and V buffers.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        r2s_dkv = cute.make_tiled_copy_C(r2s_atom, mma_dkv)
        acc_dK.store(acc_dK.load() * scale)
        self._acc_to_smem(acc_dK, sK, r2s_dkv, tidx)
        self._acc_to_smem(acc_dV, sV, r2s_dkv, tidx)
        cute.arch.barrier()
        store_existing_rows(gmem_store_tile, sK, mdK[batch, None, kv_head, None], n_block, seqlen_k, tidx, N, D, self.dtype)
        store_existing_rows(gmem_store_tile, sV, mdV[batch, None, kv_head, None], n_block, seqlen_k, tidx, N, D, self.dtype)

    # -------------------------------------------------------------- helpers
    @cute.jit
    def _acc_to_smem(self, acc, sX, r2s, tidx):
        r_out = cute.make_fragment_like(acc, self.dtype)
        r_out.store(acc.load().to(self.dtype))
        cute.copy(r2s, r2s.get_slice(tidx).retile(r_out), r2s.get_slice(tidx).partition_D(sX))

    @cute.jit
    def _gemm(self, tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, s2r_A, s2r_B, tidx):
        """acc += A B from shared memory, ldmatrix of k-block k+1 overlapping MMA k."""
        tCrA_v = s2r_A.get_slice(tidx).retile(tCrA)
        tCrB_v = s2r_B.get_slice(tidx).retile(tCrB)
        num_k = cute.size(tCsA.shape[2])
        cute.copy(s2r_A, tCsA[None, None, 0], tCrA_v[None, None, 0])
        cute.copy(s2r_B, tCsB[None, None, 0], tCrB_v[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(s2r_A, tCsA[None, None, k + 1], tCrA_v[None, None, k + 1])
                cute.copy(s2r_B, tCsB[None, None, k + 1], tCrB_v[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    @cute.jit
    def _load_rows(self, tiled_copy, thr_copy, mX, sX, block, seqlen, rows: cutlass.Constexpr):
        """cp.async a (rows, D) tile of a [seqlen, D] tensor; rows from seqlen on become zeros."""
        gX = cute.local_tile(mX, (rows, self.head_dim), (block, 0))
        tXgX = thr_copy.partition_S(gX)
        tXsX = thr_copy.partition_D(sX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((rows, self.head_dim)))
        rows_left = seqlen - block * rows
        for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            if tXcX[0, m, 0][0] < rows_left:
                cute.copy(tiled_copy, tXgX[None, m, None], tXsX[None, m, None])
            else:
                tXsX[None, m, None].fill(0)

    @cute.jit
    def _load_q_tile(
        self, it, m_blocks, m_block_min, deterministic, kv_head, group, batch, stage, mQ, mdO, mLSE, mDelta, sLSE, sDelta,
        gmem_copy_tile, gmem_thr, gmem_copy_stat, tQcQ, tQsQ, tdOsdO, seqlen_q, tidx,
    ):
        """Issue the cp.async loads of Q, dO, lse and delta for iteration `it` into `stage`."""
        M = self.m_block
        head, m_block = query_tile_of(it, kv_head, group, m_block_min, m_blocks, deterministic)
        rows_left = seqlen_q - m_block * M
        gQ = cute.local_tile(mQ[batch, None, head, None], (M, self.head_dim), (m_block, 0))
        gdO = cute.local_tile(mdO[batch, None, head, None], (M, self.head_dim), (m_block, 0))
        tQgQ = gmem_thr.partition_S(gQ)
        tdOgdO = gmem_thr.partition_S(gdO)
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, m, 0][0] < rows_left:
                cute.copy(gmem_copy_tile, tQgQ[None, m, None], tQsQ[None, m, None, stage])
                cute.copy(gmem_copy_tile, tdOgdO[None, m, None], tdOsdO[None, m, None, stage])
            else:
                tQsQ[None, m, None, stage].fill(0)
                tdOsdO[None, m, None, stage].fill(0)
        if tidx < M:
            # Rows past the end: lse = +inf gives P = 0, delta = 0 keeps dS finite.
            if tidx < rows_left:
                stat_thr = gmem_copy_stat.get_slice(tidx)
                gLSE = cute.local_tile(mLSE[batch, head, None], (M,), (m_block,))
                gDelta = cute.local_tile(mDelta[batch, head, None], (M,), (m_block,))
                cute.copy(gmem_copy_stat, stat_thr.partition_S(gLSE), stat_thr.partition_D(sLSE[None, stage]))
                cute.copy(gmem_copy_stat, stat_thr.partition_S(gDelta), stat_thr.partition_D(sDelta[None, stage]))
            else:
                sLSE[tidx, stage] = Float32.inf
                sDelta[tidx, stage] = Float32(0.0)


