"""FlashAttention forward kernel for Hopper (sm_90a) written in the CuTe DSL.

One CTA computes one (query tile, query head, batch) triple with a producer warpgroup and
one to three consumer warpgroups (tile_config.py), 64 query rows each. Warpgroup 0 is the
producer: after giving most of its registers away (setmaxnreg) one of its warps streams Q
once (each consumer's rows on a barrier of their own) and then K/V tiles with TMA into
multi-stage shared buffers guarded by mbarrier pipelines. Each consumer computes S = Q K^T
and O += P V for its rows with asynchronous WGMMA and keeps P in registers as the A operand
of the PV GEMM (at some head dims Q too, for the S GEMM: tile_config.Q_IN_REGISTERS). Within
a consumer the softmax of tile j runs while the tensor cores work on P(j-1) V(j-1)
(intra-warpgroup overlap), and O is rescaled for tile j while S(j+1) is computed; optionally
a ring of named barriers makes the consumers take turns issuing GEMMs so that one
warpgroup's softmax hides under the others' MMAs (pingpong).

KV tiles are walked from the last visible one down to the first; tiles the mask excludes are
never loaded, and only tiles that straddle a mask edge pay for the per-element mask. Under a
causal-like mask query tiles are launched longest first within sections of heads
(launch_order.py), which shortens the tail of the grid. Without a window, neighbouring query
tiles may pair up in a cluster whose CTAs each load half of every K / V tile into both
(kv_multicast).

Mask (kernel_api.h): row i sees column j iff i < q_len, j < kv_len, j >= i + diag_offset -
window_left (window_left >= 0) and j <= i + diag_offset + window_right (window_right >= 0).

NaN and Inf (docs/numerics.md): a partial tile's V is checked before the PV GEMM can
multiply a masked zero with a NaN (value_check.py); a row saw a key iff its sum is not zero
(output_tile.py).

The packed-document variant (has_segments) also requires equal segment ids. It narrows the
CTA's KV range to the union of its rows' kv_bounds (which only say where visible keys can
be, not that every key inside is visible). A KV tile whose keys all carry one id (a warp
vote) only masks the rows of other documents; ids are compared per score on the other tiles.
"""

from typing import Optional, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.dsl_common import (
    cap_scores, logit_scales, wgmma_acc_as_operand_a, wgmma_acc_as_rows_cols,
)
from ..common.seen_values import RowMask
from .consumer_turns import BAR_PINGPONG, WG_THREADS, ConsumerTurns
from .launch_order import tile_of_cta
from .kv_producer import WG_ROWS, KVProducer
from .online_softmax import online_softmax, rescale_rows
from .output_tile import store_output_tile
from .paged_kv import LARGE_BOX, PAGE_BOX, PagedCall, PagedProblem, large_box_atoms, produce_paged, slab_layouts
from .paged_fp8 import CONVERT_WARPGROUPS, CONVERT_WARPS, PRODUCER_REGS as CONVERTER_REGS, Fp8Cache
from .score_mask import mask_tile, unseen_leading_tiles
from .segment_ids import warp_bounds_union
from .fp8_operands import FP8, p_fragments
from .fp8_variant import Fp8Variant
from .tile_config import FP8_CACHE_TILE_CONFIG, FP8_TILE_CONFIG, Q_IN_REGISTERS, REDUCTION_PARTIALS, TILE_CONFIG
from .value_check import ValueChecks

# setmaxnreg only moves registers inside the CTA's launch allocation (64K registers shared by all threads;
# consumer_registers): 2 consumers 128 * 24 + 256 * 240 == 168 * 384, 3: 128 * 24 + 384 * 160 <= 128 * 512;
# one consumer at 2 / 3 CTAs per SM 128 * 24 + 128 * 232 == 128 * 256, 128 * 24 + 128 * 136 == 80 * 256.
# Asking for more makes the consumers' increase wait forever.
PRODUCER_REGS = 24
SMEM_PER_SM = 228 * 1024  # of which each resident CTA reserves 1 KiB

class FlashFwdSm90(KVProducer, ConsumerTurns, ValueChecks, Fp8Variant, PagedCall, Fp8Cache):
    """Forward attention for one dtype (FP8: fp8_variant.py) and (head_dim, head_dim_v) pair."""

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int = None,
        conditional_rescale: bool = True,
        pingpong: bool = True,
        tile_n: int = None,
        kv_stages: int = None,
        has_segments: bool = False,
        consumers: int = None,
        ctas_per_sm: int = 1,
        kv_multicast: bool = False,
        q_in_registers: bool = None,
        reduction_partials: int = None,
        paged_kv: bool = False,
        out_dtype: Type[cutlass.Numeric] = None,
        fp8_cache: bool = False,
    ):
        head_dim_v = head_dim_v or head_dim
        if not self.can_implement(dtype, head_dim, head_dim_v):
            raise ValueError(
                f"FlashFwdSm90: unsupported dtype={dtype} (head_dim, head_dim_v)="
                f"{(head_dim, head_dim_v)}; expected Float16/BFloat16 and one of {sorted(TILE_CONFIG)}"
                f", or Float8E4M3FN and one of {sorted(FP8_TILE_CONFIG)}"
            )
        self.dtype = dtype
        self.fp8, self.out_dtype = self._output_type(
            dtype, out_dtype, plain=not (has_segments or kv_multicast or paged_kv or ctas_per_sm != 1))
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        # An FP8 paged cache (paged_fp8.py): 16-bit consumers, FP8 stages of its own.
        if fp8_cache and (not paged_kv or self.fp8 or (head_dim, head_dim_v) not in FP8_CACHE_TILE_CONFIG):
            raise ValueError(f"FlashFwdSm90: fp8_cache needs paged_kv, 16-bit q and one of "
                             f"{sorted(FP8_CACHE_TILE_CONFIG)}")
        self.fp8_cache = fp8_cache
        tiles = FP8_CACHE_TILE_CONFIG if fp8_cache else FP8_TILE_CONFIG if self.fp8 else TILE_CONFIG
        default_n, default_stages, default_consumers, *fp8_stages = tiles[head_dim, head_dim_v]
        self.fp8_stages = fp8_stages[0] if fp8_cache else 0
        self.producer_regs = CONVERTER_REGS if fp8_cache else PRODUCER_REGS
        self.producers = CONVERT_WARPGROUPS if fp8_cache else 1  # warpgroups before the consumers
        self.tile_n = tile_n or default_n
        self.kv_stages = kv_stages or default_stages
        self.conditional_rescale = conditional_rescale
        self.has_segments = has_segments
        # The packed-document variants keep two consumers: at three, 160 registers spill 348 bytes (hd64).
        self.consumers = consumers or (2 if has_segments else default_consumers)
        self.pingpong = pingpong and self.consumers > 1
        if self.consumers > 1 and not self.pingpong:
            # The V checks (value_check.py) rely on the consumers' turns.
            raise ValueError("FlashFwdSm90: several consumer warpgroups need pingpong=True")
        # More than one CTA per SM splits the registers and shared memory, and lets one
        # CTA's prologue and epilogue overlap another's GEMMs.
        self.ctas_per_sm = ctas_per_sm
        # Two CTAs of neighbouring query tiles form a cluster and each loads half of every K / V tile into
        # both (TMA multicast), which halves the K / V traffic out of L2. Both must walk the same KV tiles, so
        # the launcher runs this variant only without a window or segments.
        if kv_multicast and has_segments:
            raise ValueError("FlashFwdSm90: kv_multicast needs has_segments=False")
        self.cluster_size = 2 if kv_multicast else 1
        # K / V from a page table (paged_kv.py): the call_paged entry point.
        if paged_kv and (kv_multicast or has_segments or self.tile_n % PAGE_BOX):
            raise ValueError("FlashFwdSm90: paged_kv needs no multicast, no segments and "
                             f"tile_n a multiple of {PAGE_BOX}")
        self.paged_kv = paged_kv
        # Q as the register (A) operand of the S GEMM, loaded once per CTA: the GEMM then
        # reads only K from shared memory (Q_IN_REGISTERS). Not with segments: their ids
        # take the registers (hd128: 152 bytes spilled).
        if q_in_registers is None:
            q_in_registers = ((head_dim, head_dim_v) in Q_IN_REGISTERS and not has_segments
                              and not self.fp8 and not fp8_cache)
        self.q_in_registers = q_in_registers
        self.reduction_partials = reduction_partials or REDUCTION_PARTIALS.get(
            (head_dim, head_dim_v), 1)
        self.tile_m = WG_ROWS * self.consumers
        self.bar_epilogue = BAR_PINGPONG + self.consumers
        elem = dtype.width // 8
        kv_stage = self.tile_n * (head_dim + head_dim_v)
        smem = (self.tile_m * head_dim + self.kv_stages * kv_stage) * elem + 1024
        if self.fp8:  # O in its own buffer: Q's holds half its bytes
            smem += self.tile_m * head_dim_v * self.out_dtype.width // 8
        smem += self._fp8_smem_bytes() if fp8_cache else 0
        budget = SMEM_PER_SM // ctas_per_sm - 1024
        if smem > budget:
            raise ValueError(
                f"FlashFwdSm90: tile_n={self.tile_n} x {self.kv_stages} stages needs "
                f"{smem} bytes of shared memory, more than {budget} ({ctas_per_sm} CTAs per SM)"
            )

    def consumer_registers(self) -> int:
        """The consumers' setmaxnreg share of 64K registers (multiple of 8).
        A CTA's launch allocation is a multiple of 8 registers per thread
        (80, not 85, at three CTAs of two warpgroups per SM)."""
        per_thread = 65536 // self.ctas_per_sm // (WG_THREADS * (self.producers + self.consumers)) // 8 * 8
        spare = (per_thread - self.producer_regs) * self.producers + per_thread * self.consumers
        return min(240, spare // self.consumers // 8 * 8)

    @staticmethod
    def can_implement(dtype: Type[cutlass.Numeric], head_dim: int, head_dim_v: int) -> bool:
        if dtype is FP8:
            return (head_dim, head_dim_v) in FP8_TILE_CONFIG
        return dtype in (cutlass.Float16, cutlass.BFloat16) and (head_dim, head_dim_v) in TILE_CONFIG

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, T, Nq, H]
        mK: cute.Tensor,  # [B, S, Nkv, H]
        mV: cute.Tensor,  # [B, S, Nkv, Hv]
        mO: cute.Tensor,  # [B, T, Nq, Hv]
        mLSE: cute.Tensor,  # [B, Nq, T] float32
        mQLens: cute.Tensor,  # [B] int32
        mKVLens: cute.Tensor,  # [B] int32
        scale: cutlass.Float32,
        softcap: cutlass.Float32,
        diag_offset: cutlass.Int32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        stream: cuda.CUstream,
        mSinks: cute.Tensor,  # [B, Nq, 1] float32, or [B, Nq, 0]: no sinks
    ):
        """Entry point of the plain variant. The exported object records this
        signature, so the segment tensors get their own entry point below.
        mSinks: attention sinks (output_tile.py), read only where its last
        mode is 1."""
        self._launch(mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
                     window_left, window_right, stream, mSinks, None, None, None)

    @cute.jit
    def call_with_segments(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
        mLSE: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        scale: cutlass.Float32, softcap: cutlass.Float32, diag_offset: cutlass.Int32,
        window_left: cutlass.Int32, window_right: cutlass.Int32, stream: cuda.CUstream,
        mSinks: cute.Tensor,  # as in __call__
        mQSeg: cute.Tensor,  # [B, T] int32
        mKVSeg: cute.Tensor,  # [B, S] int32
        mKVBounds: cute.Tensor,  # [B, T, 2] int32
    ):
        """Entry point of the packed-document variant (has_segments)."""
        self._launch(mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
                     window_left, window_right, stream, mSinks, mQSeg, mKVSeg, mKVBounds)

    @cute.jit
    def _launch(
        self, mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
        window_left, window_right, stream, mSinks, mQSeg, mKVSeg, mKVBounds, mPageTable=None,
        split_pages=None, descales=(None, None, None), scales=None,
    ):
        if cutlass.const_expr(self.has_segments != (mQSeg is not None)):
            raise TypeError("segment tensors must be given exactly for the has_segments variant")
        if cutlass.const_expr(self.paged_kv != (mPageTable is not None)):
            raise TypeError("a page table must be given exactly for the paged_kv variant")
        hd, hd_v, tile_n = self.head_dim, self.head_dim_v, self.tile_n
        # TMA views with the contiguous head dim first: Q/K/O as (seq, hd, heads, batch) and V transposed as
        # (hd, seq, heads, batch), the N-major B operand of O = P V.
        mQt = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mKt = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        if cutlass.const_expr(self.fp8):  # already [B, Nkv, Hv, S] (fp8_operands.py)
            mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))
        mOt = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype,
            warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (WG_ROWS, tile_n),
            warpgroup.OperandSource.RMEM if self.q_in_registers else warpgroup.OperandSource.SMEM,
        )
        # FP8 WGMMA reads V K-major only: the keys contiguous (fp8_operands.py).
        v_major = warpgroup.OperandMajorMode.K if self.fp8 else warpgroup.OperandMajorMode.MN
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype,
            warpgroup.OperandMajorMode.K, v_major,
            cutlass.Float32, (1, 1, 1), (WG_ROWS, hd_v),
            warpgroup.OperandSource.RMEM,
        )
        # One Q stage per consumer warpgroup; its O goes out through the same
        # memory (sO_layout: O's narrower rows when head_dim_v < head_dim).
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, hd), self.dtype, self.consumers
        )
        sO_layout = sQ_layout
        if cutlass.const_expr(hd_v != hd or self.fp8):
            sO_layout = sm90_utils.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, hd_v), self.out_dtype, self.consumers
            )
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, tile_n, hd), self.dtype, self.kv_stages
        )
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR if self.fp8 else LayoutEnum.COL_MAJOR, (WG_ROWS, hd_v, tile_n),
            self.dtype, self.kv_stages
        )
        sQ_stage = cute.slice_(sQ_layout, (None, None, 0))
        sK_stage = cute.slice_(sK_layout, (None, None, 0))
        sV_stage = cute.slice_(sV_layout, (None, None, 0))
        sO_stage = cute.slice_(sO_layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        g2s_kv = g2s if cutlass.const_expr(self.cluster_size == 1) else cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQt, sQ_stage, (WG_ROWS, hd))
        # A paged K / V tile arrives in PAGE_BOX-key boxes, each from its page.
        sK_box, sV_box, box_n = sK_stage, sV_stage, tile_n
        if cutlass.const_expr(self.paged_kv):
            (sK_box, sV_box), box_n = slab_layouts(sK_stage, sV_stage, hd, hd_v), PAGE_BOX
        # A second K / V atom pair: the FP8 cache's scales (paged_fp8.py), or LARGE_BOX-key page boxes.
        second_atoms = (None,) * 4
        if cutlass.const_expr(self.fp8_cache):
            tma_k, mK_tma, tma_v, mV_tma, *second_atoms = self._fp8_cache_atoms(mK, mV, scales)
        else:
            if cutlass.const_expr(self.paged_kv and tile_n % LARGE_BOX == 0):
                second_atoms = large_box_atoms(g2s, mKt, mVt, sK_stage, sV_stage, hd, hd_v)
            multicast = self.cluster_size
            tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s_kv, mKt, sK_box, (box_n, hd), num_multicast=multicast)
            tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s_kv, mVt, sV_box, (hd_v, box_n), num_multicast=multicast)
        tma_o, mO_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mOt, sO_stage, (WG_ROWS, hd_v))

        SharedStorage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout)

        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_stage)
        self.k_bytes = cute.size_in_bytes(self.dtype, sK_stage)
        self.v_bytes = cute.size_in_bytes(self.dtype, sV_stage)
        grid = (
            cute.round_up(cute.ceil_div(mQ.shape[1], self.tile_m), self.cluster_size),
            cute.size(mQ.shape[2]),
            cute.size(mO.shape[0]),  # paged: a CTA per (sequence, split)
        )
        self.kernel(
            tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, tma_o, mO_tma,
            mLSE, mQLens, mKVLens,
            scale, softcap, diag_offset, window_left, window_right,
            mSinks, mQSeg, mKVSeg, mKVBounds, mPageTable, split_pages, *descales, *second_atoms,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, SharedStorage,
        ).launch(
            grid=grid,
            block=[WG_THREADS * (self.producers + self.consumers), 1, 1],
            stream=stream,
            cluster=[self.cluster_size, 1, 1] if self.cluster_size > 1 else None,
            min_blocks_per_mp=self.ctas_per_sm,
            # All of the unified L1 as shared memory; spares the DSL a device query (no GPU compiles this).
            preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None,
        )

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mQLens: cute.Tensor,
        mKVLens: cute.Tensor,
        scale: cutlass.Float32,
        softcap: cutlass.Float32,
        diag_offset: cutlass.Int32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        mSinks: Optional[cute.Tensor],
        mQSeg: Optional[cute.Tensor],
        mKVSeg: Optional[cute.Tensor],
        mKVBounds: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        split_pages: Optional[cutlass.Int32],
        mQDescale: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        tma_k2: Optional[cute.CopyAtom],
        mK2: Optional[cute.Tensor],
        tma_v2: Optional[cute.CopyAtom],
        mV2: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o, tma_k2, tma_v2):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        tile_n = self.tile_n
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        if cutlass.const_expr(self.paged_kv):
            seqlen_k = split_pages * mK.shape[0]  # the keys of one split
        m_blocks = cute.round_up(cute.ceil_div(seqlen_q, self.tile_m), self.cluster_size)
        # Causal-like: longest query tiles first (launch_order.py). Clusters
        # pair the tiles of problems without a window, all equally long.
        m_block_rev, head_q, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.cluster_size == 1):
            # The grid's batch entries: paged, one per (sequence, split).
            batches = mLSE.shape[0] if cutlass.const_expr(self.paged_kv) else mQ.shape[3]
            m_block_rev, head_q, batch = tile_of_cta(
                m_blocks, seqlen_q, window_right, mQ.shape[2], mK.shape[2], batches, seqlen_k,
                (self.head_dim + self.head_dim_v) * self.dtype.width // 8,
            )
        m_block = m_blocks - 1 - m_block_rev
        head_kv = head_q // (mQ.shape[2] // mK.shape[2])
        paged = None
        if cutlass.const_expr(self.paged_kv):
            paged = PagedProblem(batch, mQLens, mKVLens, mPageTable, split_pages, mK.shape[0],
                                 seqlen_q, diag_offset)
            seqlen_k, diag_offset = paged.split_keys, paged.diag_offset
        # The grid's rows beyond seqlen_q (a partial tile, a cluster's rounding) go before row 0, in whole
        # 64-row warpgroup tiles: there every mask leaves the fewest keys, whereas past the end a causal mask
        # would leave the most (hd64's 192-row tiles at seq 4096 would spend 6% of the causal work on 128 rows
        # that do not exist). Warpgroup tiles before row 0 load a clamped Q tile and store nothing.
        lead_tiles = m_blocks * self.consumers - cute.ceil_div(seqlen_q, WG_ROWS)
        wg_tile0 = m_block * self.consumers - lead_tiles
        m_start = wg_tile0 * WG_ROWS
        if cutlass.const_expr(self.paged_kv):
            q_len, kv_len = paged.q_len, paged.kv_len
        else:
            q_len = cutlass.max(cutlass.min(mQLens[batch], seqlen_q), 0)
            kv_len = cutlass.max(cutlass.min(mKVLens[batch], seqlen_k), 0)

        # ---- KV tile range of the whole CTA (of the cluster) -----------------
        # The CTAs of a cluster walk the same KV tiles: all their rows' range (each row's without a window).
        cluster_start = m_start - m_block % self.cluster_size * self.tile_m
        first_row = cutlass.max(cluster_start, 0)
        last_row = cutlass.min(cluster_start + self.cluster_size * self.tile_m, q_len) - 1
        col_begin = cutlass.Int32(0)
        if window_left >= 0:
            col_begin = cutlass.max(first_row + diag_offset - window_left, 0)
        col_end = kv_len
        if window_right >= 0:
            col_end = cutlass.min(last_row + diag_offset + window_right + 1, kv_len)
        if cutlass.const_expr(self.has_segments):
            seg_begin, seg_end = warp_bounds_union(mKVBounds, batch, first_row, last_row, self.tile_m)
            col_begin = cutlass.max(col_begin, seg_begin)
            col_end = cutlass.min(col_end, seg_end)
        n_block_min = col_begin // tile_n
        n_block_max = cute.ceil_div(cutlass.max(col_end, 0), tile_n)
        num_n_blocks = cutlass.Int32(0)
        if last_row >= first_row:
            num_n_blocks = cutlass.max(n_block_max - n_block_min, 0)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if cutlass.const_expr(self.fp8):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # With an FP8 cache each producer warp fills a share of a K / V stage and arrives once.
        kv_producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERT_WARPS if self.fp8_cache else 1)
        # Consumers release a stage with one arrive per warp, and a K / V stage with one per warp of every CTA
        # of the cluster (each CTA's producer writes into all of them).
        kv_consumer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, 4 * self.consumers * self.cluster_size
        )
        cluster_layout = cute.make_layout((1, self.cluster_size, 1, 1))
        # One Q stage per consumer warpgroup: each starts once its own rows land.
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.consumers,
            producer_group=producer_group,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=self.q_bytes, defer_sync=True,
        )
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.kv_stages,
            producer_group=kv_producers, consumer_group=kv_consumer_group,
            tx_count=self.k_bytes, cta_layout_vmnk=cluster_layout, defer_sync=True,
        )
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.kv_stages,
            producer_group=kv_producers, consumer_group=kv_consumer_group,
            tx_count=self.v_bytes, cta_layout_vmnk=cluster_layout, defer_sync=True,
        )
        pipe8 = self._fp8_pipeline(storage, producer_group) if cutlass.const_expr(self.fp8_cache) else None
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cluster_size > 1):
            # The peer arrives on and writes into this CTA's barriers and
            # buffers: both must be initialised first.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        if wg_idx < self.producers:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if cutlass.const_expr(self.fp8_cache):
                self._produce_fp8_cache(tma_q, mQ, sQ, pipe_q, (tma_k, mK, tma_v, mV, tma_k2, mK2, tma_v2, mV2),
                                        storage, sK_layout, sV_layout, pipe_k, pipe_v, pipe8, mPageTable, paged,
                                        head_q, head_kv, wg_tile0, n_block_max, num_n_blocks, tidx)
            elif warp_idx == 0:
                if cutlass.const_expr(self.paged_kv):
                    produce_paged(
                        tma_q, mQ, (tma_k, mK, tma_v, mV), (tma_k2, mK2, tma_v2, mV2), sQ, sK, sV, pipe_q,
                        pipe_k, pipe_v, mPageTable, paged, head_q, head_kv, wg_tile0, n_block_max, num_n_blocks,
                        self.consumers, self.kv_stages, tile_n, WG_ROWS,
                    )
                else:
                    self._produce(
                        tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
                        pipe_q, pipe_k, pipe_v,
                        head_q, head_kv, batch, wg_tile0, n_block_max, num_n_blocks,
                    )
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers())
            out_scale = None
            if cutlass.const_expr(self.fp8):
                scale, out_scale = self._descaled(scale, mQDescale, mKDescale, mVDescale, batch,
                                                  head_q, head_kv)
            scale_log2, softcap_in = logit_scales(scale, softcap)
            # The sink of this (batch, query head); -inf, which adds nothing, without one.
            sink = -cutlass.Float32.inf
            if cutlass.const_expr(mSinks is not None):
                if mSinks.shape[2] > 0:
                    sink = mSinks[batch, head_q, 0]
            self._consume(
                tidx % WG_THREADS, wg_idx - self.producers, tma_o, mO, mLSE, sQ, sK, sV, sO,
                pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                scale_log2, softcap_in, diag_offset, window_left, window_right,
                head_q, batch, wg_tile0, q_len, kv_len, n_block_min, n_block_max,
                num_n_blocks, mQSeg, mKVSeg, sink, out_scale,
            )
        if cutlass.const_expr(self.cluster_size > 1):
            # No CTA may exit while its peer can still arrive on its barriers.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    # ------------------------------------------------------------------------
    @cute.jit
    def _consume(
        self, tidx, wg, tma_o, mO, mLSE, sQ, sK, sV, sO,
        pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
        scale_log2, softcap_in, diag_offset, window_left, window_right,
        head_q, batch, wg_tile0, q_len, kv_len, n_block_min, n_block_max, num_n_blocks,
        mQSeg, mKVSeg, sink, out_scale,
    ):
        tile_n = self.tile_n
        row_start = (wg_tile0 + wg) * WG_ROWS
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        sQ_wg = sQ[None, None, wg]
        tSsQ = thr_qk.partition_A(sQ_wg)
        # Q's shared memory tile, or its register copy (q_in_registers).
        tSrQ = thr_qk.make_fragment_A(tSsQ)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((WG_ROWS, self.head_dim_v)))
        acc_O.fill(0.0)
        # Partitioned before any GEMM: the ACCUMULATE flag set on the tiled MMAs inside the loops must not
        # leak into later uses.
        sO_wg = sO[None, None, wg]
        tOsO = thr_pv.partition_C(sO_wg)
        # O starts at zero and every PV GEMM accumulates; set once, outside all staged control flow.
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        acc_S_shape = thr_qk.partition_shape_C((WG_ROWS, tile_n))
        acc_O_mn = wgmma_acc_as_rows_cols(acc_O)
        # (row, column) of every O element, for the V checks.
        tOcO = wgmma_acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((WG_ROWS, self.head_dim_v))))
        # (row, col) of every S element inside its (64, tile_n) tile.
        tScS = wgmma_acc_as_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((WG_ROWS, tile_n))))
        num_rows = cute.size(tScS, mode=[0])
        row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # What O must be scaled by before the next PV GEMM: the online softmax of tile j sets it, iteration j
        # + 1 applies it (while its S GEMM runs).
        factor = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_seg = None
        if cutlass.const_expr(self.has_segments):
            # Rows outside the sequence read a clamped id; their results are
            # masked (past q_len) or never stored (before row 0).
            row_seg = cute.make_rmem_tensor(num_rows, cutlass.Int32)
            for r in cutlass.range_constexpr(num_rows):
                row = cutlass.max(cutlass.min(row_start + tScS[r, 0][0], mQSeg.shape[1] - 1), 0)
                row_seg[r] = mQSeg[batch, row]
        rows_mask = RowMask(row_start, q_len, kv_len, diag_offset, window_left, window_right, row_seg,
                            mKVSeg, batch)
        # P lives in one register fragment across iterations: written after
        # softmax(j), read by the PV GEMM issued in iteration j + 1.
        if cutlass.const_expr(self.fp8):
            rP, tOrP = p_fragments(acc_S_shape, tile_n)
        else:
            rP = cute.make_rmem_tensor(acc_S_shape, self.dtype)
            tOrP = cute.make_tensor(rP.iterator, wgmma_acc_as_operand_a(rP.layout))

        # Tiles n in [full_lo, full_hi) are visible to every row of the CTA and
        # skip the mask; the others (kv_len edge, diagonal, window) apply it.
        m_start = wg_tile0 * WG_ROWS
        full_hi = kv_len // tile_n
        if window_right >= 0:
            full_hi = cutlass.min(
                full_hi, cutlass.max(m_start + diag_offset + window_right + 1, 0) // tile_n
            )
        full_lo = cutlass.Int32(0)
        if window_left >= 0:
            full_lo = cute.ceil_div(
                cutlass.max(m_start + self.tile_m - 1 + diag_offset - window_left, 0), tile_n
            )
        full_lo = self._full_tiles_from(full_lo, mQSeg, batch, m_start)

        if self.pingpong:
            # Warpgroup 0 goes first: pre-arrive on its own turn barrier.
            if wg == 0:
                cute.arch.barrier_arrive(
                    barrier_id=BAR_PINGPONG, number_of_threads=2 * WG_THREADS
                )

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        q_state = pipeline.PipelineState(self.consumers, cutlass.Int32(0), cutlass.Int32(wg), cutlass.Int32(0))
        # Q is always loaded, and must have landed before the CTA may exit.
        pipe_q.consumer_wait(q_state)
        if cutlass.const_expr(self.q_in_registers):
            cute.autovec_copy(tSsQ, tSrQ)
        # The CTA's first KV tiles may lie right of what this warpgroup's rows see (the
        # causal diagonal of a tile taller than its KV tiles), or its rows may lie outside
        # the sequence: it passes those on without GEMMs. It waits for each stage before
        # releasing it, so that it never runs a phase ahead of the other consumers.
        skipped = unseen_leading_tiles(row_start, WG_ROWS, tile_n, q_len, kv_len, diag_offset,
                                       window_right, n_block_max, num_n_blocks)
        for _ in cutlass.range(skipped, unroll=1):
            pipe_k.consumer_wait(kv_state)
            self._turn_wait(wg)
            self._turn_pass(wg)
            pipe_k.consumer_release(kv_state)
            pipe_v.consumer_wait(kv_state)
            pipe_v.consumer_release(kv_state)
            kv_state.advance()

        # Whether the PV GEMM of the tile before must zero V first (value_check.py).
        clean = cutlass.Int32(0)
        if num_n_blocks > skipped:
            # First tile: S, softmax, P; its PV GEMM is issued next iteration.
            n_block = n_block_max - 1 - skipped
            # Segment ids of a KV tile are loaded one tile ahead: the V check
            # at the top of its iteration needs them.
            tile_seg = self._tile_segment(mKVSeg, batch, n_block * tile_n)
            clean = self._check_values(
                sV, pipe_v, kv_state, n_block, self._partial_tile(n_block, full_lo, full_hi, tile_seg, row_seg),
                kv_len, tidx, wg, acc_O_mn, tOcO, rows_mask)
            pipe_k.consumer_wait(kv_state)
            self._turn_wait(wg)
            acc_S = self._gemm_qk(tiled_mma_qk, acc_S_shape, tSrQ, tSrK, kv_state.index)
            self._turn_pass(wg)
            next_seg = self._tile_segment(mKVSeg, batch, cutlass.max(n_block - 1, 0) * tile_n)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(kv_state)
            cap_scores(acc_S, softcap_in)
            acc_S_mn = wgmma_acc_as_rows_cols(acc_S)
            mask_tile(acc_S_mn, tScS, row_start, n_block, tile_n, full_lo, full_hi, q_len,
                      kv_len, diag_offset, window_left, window_right, row_seg, tile_seg,
                      mKVSeg, batch)
            online_softmax(acc_S_mn, row_max, row_sum, factor, scale_log2, self.conditional_rescale,
                           self.reduction_partials)
            self._store_p(acc_S, rP)

            for i in cutlass.range(skipped + 1, num_n_blocks, unroll=1):
                n_block = n_block_max - 1 - i
                v_state = kv_state.clone()
                kv_state.advance()
                tile_seg = next_seg
                # Before the turn (value_check.py).
                clean_next = self._check_values(
                    sV, pipe_v, kv_state, n_block,
                    self._partial_tile(n_block, full_lo, full_hi, tile_seg, row_seg), kv_len, tidx, wg,
                    acc_O_mn, tOcO, rows_mask)
                pipe_k.consumer_wait(kv_state)
                self._turn_wait(wg)
                # In the turn, before the S GEMM, whose accumulator would sit
                # beside its registers.
                self._clean_values(sV, pipe_v, v_state, clean, n_block + 1, kv_len, tidx, wg)
                clean = clean_next
                acc_S = self._gemm_qk(tiled_mma_qk, acc_S_shape, tSrQ, tSrK, kv_state.index)
                rescale_rows(acc_O_mn, factor, self.conditional_rescale)
                pipe_v.consumer_wait(v_state)
                self._gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrV, v_state.index)
                self._turn_pass(wg)
                # Issued while the GEMMs run, so that their latency hides.
                next_seg = self._tile_segment(mKVSeg, batch, cutlass.max(n_block - 1, 0) * tile_n)
                warpgroup.wait_group(1)
                cap_scores(acc_S, softcap_in)
                acc_S_mn = wgmma_acc_as_rows_cols(acc_S)
                mask_tile(acc_S_mn, tScS, row_start, n_block, tile_n, full_lo, full_hi, q_len,
                          kv_len, diag_offset, window_left, window_right, row_seg, tile_seg,
                          mKVSeg, batch)
                online_softmax(acc_S_mn, row_max, row_sum, factor, scale_log2, self.conditional_rescale,
                               self.reduction_partials)
                # ptxas schedules the wait for the PV GEMM as early as its dependencies
                # allow, i.e. above the softmax, which then no longer overlaps that GEMM.
                # A memory operation that depends on the softmax anchors it: K is released
                # under a predicate on the row sums (never false: they are >= 0, or NaN).
                if row_sum[0] + row_sum[num_rows - 1] != -1.0:
                    pipe_k.consumer_release(kv_state)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
                self._store_p(acc_S, rP)

            rescale_rows(acc_O_mn, factor, self.conditional_rescale)
            pipe_v.consumer_wait(kv_state)
        # The last PV GEMM takes a turn too, so that the other warpgroups have
        # checked its V before this one zeroes it (value_check.py).
        # (The GEMM and its wait in one branch, or ptxas serialises every WGMMA.)
        self._turn_wait(wg)
        if num_n_blocks > skipped:
            self._clean_values(sV, pipe_v, kv_state, clean, n_block_max - num_n_blocks, kv_len, tidx, wg)
            self._gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrV, kv_state.index)
            self._turn_pass(wg)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(kv_state)
        else:
            self._turn_pass(wg)

        store_output_tile(tidx, self.bar_epilogue + wg, tOsO, acc_O, acc_O_mn, tScS, row_max,
                          row_sum, scale_log2, sink, sO_wg, tma_o, mO, mLSE, head_q, batch,
                          wg_tile0 + wg, row_start, q_len, self.out_dtype, (WG_ROWS, self.head_dim_v),
                          WG_THREADS, out_scale)
