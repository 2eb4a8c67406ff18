"""FlashAttention-2 style forward kernel for SM80+ written in the CuTe DSL.

One CTA computes one (query tile, query head, batch) triple. Q stays in shared
memory for the whole CTA; K and V tiles stream through their own shared buffers
with cp.async so that the load of V(n) overlaps the S = Q K(n)^T MMAs and the
load of K(n-1) overlaps the softmax and the O += P V(n) MMAs. KV tiles are
walked from the last one the mask lets this query tile see down to the first,
and tiles that the mask excludes entirely are never touched.

Mask (kernel_api.h): row i sees column j iff i < q_len, j < kv_len,
j >= i + diag_offset - window_left (window_left >= 0) and
j <= i + diag_offset + window_right (window_right >= 0).

The packed-document variant (has_segments) also requires equal segment ids.
It narrows each query tile's KV range to the union of its rows' kv_bounds and
compares ids on every visited tile, since the bounds only say where visible
keys can be, not that every key inside them is visible.

The paged variant (paged_kv, call_paged) reads K / V from a paged cache
(paged_loads.py): one CTA per (query tile, query head, sequence and split),
the keys numbered from the split's first, each copy row of a K / V tile
from the page the table names; rows past the split's keys load as zeros.

NaN and Inf (docs/numerics.md): the PV MMA multiplies a masked zero
probability with whatever V holds, and 0 x NaN is NaN. V rows past the key
length are zeroed at the load; on a tile the mask cuts (_check_values) each
thread checks the V vectors its own cp.async wrote, the barrier that makes V
visible ORs the answers, and only where one is NaN or Inf the rows that see
it get NaN in that output column and the tile's non-finite values are
zeroed. A tile every row sees runs the code it ran before.
"""

import math
from typing import Optional, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from ..common.dsl_common import (
    cap_scores,
    logit_scales,
    m16n8_acc_as_rows_cols,
    segment_bounds_union,
)
from ..common.nonfinite import any_nonfinite, barrier_any, zero_nonfinite
from ..common.seen_values import RowMask, poison_seen_columns
from ..common.segment_tiles import MIXED, segment_key
from .paged_loads import PagedSplit, load_paged_tile, zero_row_stride_view

LN2 = math.log(2.0)
COPY_BITS = 128  # one cp.async / one vector store moves 16 bytes per thread
# (tile_m, tile_n, warps) per head dim. All warps split the query rows, so a
# warp owns tile_m / warps rows of S and O.
#  64: S is small next to the memory traffic, so a wide 128x128 tile halves
#      the number of KV iterations per row; 4 warps keep 255 registers enough.
#  96, 128: 128x64 with 4 warps keeps the fp32 O accumulator (up to 128 regs
#      per thread) plus a 64-wide S fragment under the register limit, which
#      is the FlashAttention-2 choice that measured best on A100/H100.
#  192, 256: O alone would need 192/256 registers per thread with 4 warps,
#      so 8 warps share the 128 rows; Q+K+V take 96/128 KiB of shared memory,
#      which still fits one CTA per SM on A100 (164 KiB) and H100 (227 KiB).
# Measured on H100 (bf16, B=2, H=16, S=8192, non-causal; torch's FA2 in the
# same process in brackets): hd64 312 (304), hd96 359 (346), hd128 368 (360),
# hd192 322 (329), hd256 337 (329) TFLOPS. No alternative tiles were timed.
TILE_CONFIG = {
    64: (128, 128, 4),
    96: (128, 64, 4),
    128: (128, 64, 4),
    192: (128, 64, 8),
    256: (128, 64, 8),
}


class FlashFwdSm80:
    """Forward attention for one dtype and head dim (head_dim_v == head_dim)."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, has_segments: bool = False,
                 paged_kv: bool = False):
        if not self.can_implement(dtype, head_dim) or (paged_kv and has_segments):
            raise ValueError(
                f"FlashFwdSm80: unsupported dtype={dtype} head_dim={head_dim}; "
                f"paged_kv={paged_kv} has_segments={has_segments}; expected Float16/BFloat16, "
                f"head_dim in {sorted(TILE_CONFIG)} and not both paged_kv and has_segments"
            )
        self.dtype = dtype
        self.head_dim = head_dim
        self.has_segments = has_segments
        # K / V from a page table (paged_loads.py): the call_paged entry point.
        self.paged_kv = paged_kv
        self.tile_m, self.tile_n, self.num_warps = TILE_CONFIG[head_dim]
        self.num_threads = self.num_warps * 32
        # Shared-memory rows are split in 64-element (128 B) chunks where the
        # head dim allows, else 32; the swizzle spreads the 8 rows an ldmatrix
        # touches over all banks.
        self.smem_k_block = 64 if head_dim % 64 == 0 else 32
        self.swizzle_bits = 3 if self.smem_k_block == 64 else 2

    @staticmethod
    def can_implement(dtype: Type[cutlass.Numeric], head_dim: int) -> bool:
        return dtype in (cutlass.Float16, cutlass.BFloat16) and head_dim in TILE_CONFIG

    def _smem_layout(self, rows: int):
        atom = cute.make_composed_layout(
            cute.make_swizzle(self.swizzle_bits, 3, 3),
            0,
            cute.make_layout((8, self.smem_k_block), stride=(self.smem_k_block, 1)),
        )
        return cute.tile_to_shape(atom, (rows, self.head_dim), (0, 1))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, T, Nq, H]
        mK: cute.Tensor,  # [B, S, Nkv, H]
        mV: cute.Tensor,  # [B, S, Nkv, H]
        mO: cute.Tensor,  # [B, T, Nq, H]
        mLSE: cute.Tensor,  # [B, Nq, T] float32
        mQLens: cute.Tensor,  # [B] int32
        mKVLens: cute.Tensor,  # [B] int32
        scale: cutlass.Float32,
        softcap: cutlass.Float32,
        diag_offset: cutlass.Int32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        stream: cuda.CUstream,
        mQSeg: Optional[cute.Tensor] = None,  # [B, T] int32, segment variant only
        mKVSeg: Optional[cute.Tensor] = None,  # [B, S] int32
        mKVBounds: Optional[cute.Tensor] = None,  # [B, T, 2] int32
    ):
        self._launch(mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
                     window_left, window_right, stream, mQSeg, mKVSeg, mKVBounds)

    @cute.jit
    def call_paged(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
        mLSE: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        scale: cutlass.Float32, softcap: cutlass.Float32, diag_offset: cutlass.Int32,
        window_left: cutlass.Int32, window_right: cutlass.Int32, stream: cuda.CUstream,
        mPageTable: cute.Tensor,  # [B, splits * split_pages] int32
        split_pages: cutlass.Int32,
    ):
        """Entry point of the paged variant (paged_loads.py): mK / mV are
        [num_pages, page_size, Nkv, H] pages, mKVLens the cache lengths, mO /
        mLSE hold one partial result per (sequence, split): [B * splits, ...].
        The mask's diagonal is diag_offset from each sequence's bottom right."""
        self._launch(mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
                     window_left, window_right, stream, None, None, None, mPageTable, split_pages)

    @cute.jit
    def _launch(
        self, mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
        window_left, window_right, stream, mQSeg, mKVSeg, mKVBounds, mPageTable=None,
        split_pages=None,
    ):
        if cutlass.const_expr(self.has_segments != (mQSeg is not None)):
            raise TypeError("segment tensors must be given exactly for the has_segments variant")
        if cutlass.const_expr(self.paged_kv != (mPageTable is not None)):
            raise TypeError("a page table must be given exactly for the paged_kv variant")
        sQ_layout = self._smem_layout(self.tile_m)
        sKV_layout = self._smem_layout(self.tile_n)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024
            ]
            # Per-warp partial (min first, max last) of the rows' kv_bounds.
            sSegRange: cute.struct.MemRange[cutlass.Int32, 2 * self.num_warps]

        elems_per_copy = COPY_BITS // self.dtype.width
        threads_per_row = self.smem_k_block // elems_per_copy
        thr_layout = cute.make_layout(
            (self.num_threads // threads_per_row, threads_per_row),
            stride=(threads_per_row, 1),
        )
        val_layout = cute.make_layout((1, elems_per_copy))
        gmem_tiled_copy_load = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                self.dtype,
                num_bits_per_copy=COPY_BITS,
            ),
            thr_layout,
            val_layout,
        )
        gmem_tiled_copy_store = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=COPY_BITS
            ),
            thr_layout,
            val_layout,
        )
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (self.num_warps, 1, 1),
            permutation_mnk=(self.num_warps * 16, 16, 16),
        )
        grid = (
            cute.ceil_div(mQ.shape[1], self.tile_m),
            cute.size(mQ.shape[2]),
            cute.size(mO.shape[0]),  # paged: a CTA per (sequence, split)
        )
        self.kernel(
            mQ,
            mK,
            mV,
            mO,
            mLSE,
            mQLens,
            mKVLens,
            scale,
            softcap,
            diag_offset,
            window_left,
            window_right,
            mQSeg,
            mKVSeg,
            mKVBounds,
            mPageTable,
            split_pages,
            sQ_layout,
            sKV_layout,
            gmem_tiled_copy_load,
            gmem_tiled_copy_store,
            tiled_mma,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mQLens: cute.Tensor,
        mKVLens: cute.Tensor,
        scale: cutlass.Float32,
        softcap: cutlass.Float32,
        diag_offset: cutlass.Int32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        mQSeg: Optional[cute.Tensor],
        mKVSeg: Optional[cute.Tensor],
        mKVBounds: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        split_pages: Optional[cutlass.Int32],
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        gmem_tiled_copy_load: cute.TiledCopy,
        gmem_tiled_copy_store: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block_rev, head_q, batch = cute.arch.block_idx()
        scale_log2, softcap_in = logit_scales(scale, softcap)
        tile_m, tile_n, head_dim = self.tile_m, self.tile_n, self.head_dim
        seqlen_q = mQ.shape[1]
        seqlen_k = mK.shape[1]
        # Largest query tiles first: under a causal mask they carry the most
        # KV tiles, and starting them early shortens the tail of the grid.
        m_block = cute.ceil_div(seqlen_q, tile_m) - 1 - m_block_rev
        head_kv = head_q // (mQ.shape[2] // mK.shape[2])
        m_start = m_block * tile_m

        # batch is the grid's entry, whose O / LSE the CTA writes; paged, a
        # (sequence, split) pair, and q_batch the sequence of its Q rows.
        q_batch = batch
        k_rows_end = seqlen_k  # K rows past it load as zeros
        paged = None
        if cutlass.const_expr(self.paged_kv):
            split = PagedSplit(batch, mQLens, mKVLens, mPageTable, split_pages, mK.shape[1],
                               seqlen_q, diag_offset)
            q_batch, diag_offset = split.sequence, split.diag_offset
            q_len, kv_len = split.q_len, split.kv_len
            k_rows_end = kv_len
            paged = (mPageTable, split.sequence, split.first_page)
        else:
            q_len = cutlass.max(cutlass.min(mQLens[batch], seqlen_q), 0)
            kv_len = cutlass.max(cutlass.min(mKVLens[batch], seqlen_k), 0)

        # ---- KV tile range this query tile can see -------------------------
        last_row = cutlass.min(m_start + tile_m, q_len) - 1
        col_begin = cutlass.Int32(0)
        if window_left >= 0:
            col_begin = cutlass.max(m_start + diag_offset - window_left, 0)
        col_end = kv_len
        if window_right >= 0:
            col_end = cutlass.min(last_row + diag_offset + window_right + 1, kv_len)
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        if cutlass.const_expr(self.has_segments):
            seg_begin, seg_end = segment_bounds_union(
                mKVBounds, storage.sSegRange.get_tensor(cute.make_layout(2 * self.num_warps)),
                batch, m_start, last_row, tidx, self.tile_m, self.num_warps,
            )
            col_begin = cutlass.max(col_begin, seg_begin)
            col_end = cutlass.min(col_end, seg_end)
        n_block_min = col_begin // tile_n
        n_block_max = cute.ceil_div(cutlass.max(col_end, 0), tile_n)
        num_n_blocks = cutlass.Int32(0)
        if last_row >= m_start:
            num_n_blocks = cutlass.max(n_block_max - n_block_min, 0)
        # Tiles n in [full_lo, full_hi) are visible to every row of this query
        # tile and skip the mask; the rest (kv_len edge, diagonal band) apply it.
        full_hi = kv_len // tile_n
        if window_right >= 0:
            full_hi = cutlass.min(
                full_hi, cutlass.max(m_start + diag_offset + window_right + 1, 0) // tile_n
            )
        full_lo = cutlass.Int32(0)
        if window_left >= 0:
            full_lo = cute.ceil_div(
                cutlass.max(m_start + tile_m - 1 + diag_offset - window_left, 0), tile_n
            )

        # ---- global / shared tensors --------------------------------------
        gQ = cute.local_tile(mQ[q_batch, None, head_q, None], (tile_m, head_dim), (m_block, 0))
        if cutlass.const_expr(self.paged_kv):
            # Each copy row's columns; load_paged_tile adds its page row.
            gK = zero_row_stride_view(mK, head_kv, tile_n, head_dim)
            gV = zero_row_stride_view(mV, head_kv, tile_n, head_dim)
        else:
            gK = cute.local_tile(mK[batch, None, head_kv, None], (tile_n, head_dim), (None, 0))
            gV = cute.local_tile(mV[batch, None, head_kv, None], (tile_n, head_dim), (None, 0))

        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        # V^T view (head_dim, tile_n) so that P V is a plain A x B^T MMA.
        sVt = cute.composition(
            sV, cute.make_layout((head_dim, tile_n), stride=(tile_n, 1))
        )

        gmem_thr_load = gmem_tiled_copy_load.get_slice(tidx)
        tQgQ = gmem_thr_load.partition_S(gQ)
        tQsQ = gmem_thr_load.partition_D(sQ)
        tKgK = gmem_thr_load.partition_S(gK)
        tKsK = gmem_thr_load.partition_D(sK)
        tVgV = gmem_thr_load.partition_S(gV)
        tVsV = gmem_thr_load.partition_D(sV)
        # Row coordinate of every copy row, relative to its tile.
        tQcQ = gmem_thr_load.partition_S(cute.make_identity_tensor((tile_m, head_dim)))
        tKVcKV = gmem_thr_load.partition_S(cute.make_identity_tensor((tile_n, head_dim)))

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((tile_m, head_dim)), cutlass.Float32
        )
        acc_O.fill(0.0)

        smem_tiled_copy_Q = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype), tiled_mma
        )
        smem_tiled_copy_K = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype), tiled_mma
        )
        smem_tiled_copy_V = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), self.dtype), tiled_mma
        )
        smem_thr_copy_Q = smem_tiled_copy_Q.get_slice(tidx)
        smem_thr_copy_K = smem_tiled_copy_K.get_slice(tidx)
        smem_thr_copy_V = smem_tiled_copy_V.get_slice(tidx)
        tSsQ = smem_thr_copy_Q.partition_S(sQ)
        tSrQ_view = smem_thr_copy_Q.retile(tSrQ)
        tSsK = smem_thr_copy_K.partition_S(sK)
        tSrK_view = smem_thr_copy_K.retile(tSrK)
        tOsVt = smem_thr_copy_V.partition_S(sVt)
        tOrVt_view = smem_thr_copy_V.retile(tOrVt)

        # (row, col) of each S accumulator element inside its (tile_m, tile_n) tile.
        tScS = m16n8_acc_as_rows_cols(
            thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        )
        num_rows = cute.size(tScS, mode=[0])
        row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        num_cols = cute.size(tScS, mode=[1])
        row_seg = cute.make_rmem_tensor(num_rows, cutlass.Int32)
        col_seg = cute.make_rmem_tensor(num_cols, cutlass.Int32)
        if cutlass.const_expr(self.has_segments):
            for r in cutlass.range_constexpr(num_rows):
                row_seg[r] = mQSeg[batch, cutlass.min(m_start + tScS[r, 0][0], seqlen_q - 1)]
        # What _check_values needs: which keys each output row sees, and with
        # packed documents the id of the CTA's rows (MIXED: several), against
        # which a KV tile whose keys carry another, or several, counts as cut.
        tOcO = m16n8_acc_as_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((tile_m, head_dim))))
        seen_mask = RowMask(m_start, q_len, kv_len, diag_offset, window_left, window_right)
        rows_key = cutlass.Int32(0)
        if cutlass.const_expr(self.has_segments):
            seen_mask = RowMask(m_start, q_len, kv_len, diag_offset, window_left, window_right,
                                row_seg, mKVSeg, batch)
            rows_key = segment_key(mQSeg, batch, m_start, tile_m)

        # ---- prologue: Q and the first K tile -----------------------------
        if num_n_blocks > 0:
            for r in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                if m_start + tQcQ[0, r, 0][0] < seqlen_q:
                    cute.copy(gmem_tiled_copy_load, tQgQ[None, r, None], tQsQ[None, r, None])
                else:
                    tQsQ[None, r, None].fill(0)
            self._load_kv(
                gmem_tiled_copy_load, tKgK, tKsK, tKVcKV, n_block_max - 1, k_rows_end, mK, paged
            )
            cute.arch.cp_async_commit_group()

        # ---- main loop over KV tiles, last to first -----------------------
        for n_iter in cutlass.range(num_n_blocks, unroll=1):
            n_block = n_block_max - 1 - n_iter
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            # V: zeros past kv_len (a masked probability meets them).
            self._load_kv(gmem_tiled_copy_load, tVgV, tVsV, tKVcKV, n_block, kv_len, mV, paged)
            cute.arch.cp_async_commit_group()

            acc_S = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((tile_m, tile_n)), cutlass.Float32
            )
            acc_S.fill(0.0)
            if cutlass.const_expr(self.has_segments):
                # Issued before the MMAs so their latency hides behind them;
                # columns past seqlen_k read a clamped id and are masked anyway.
                for c in cutlass.range_constexpr(num_cols):
                    col = cutlass.min(n_block * tile_n + tScS[0, c][1], seqlen_k - 1)
                    col_seg[c] = mKVSeg[batch, col]
            self._gemm_smem(
                tiled_mma, acc_S, tSrQ, tSrK,
                smem_tiled_copy_Q, tSsQ, tSrQ_view,
                smem_tiled_copy_K, tSsK, tSrK_view,
            )
            cap_scores(acc_S, softcap_in)
            acc_S_mn = m16n8_acc_as_rows_cols(acc_S)
            if cutlass.const_expr(self.has_segments):
                self._apply_mask(
                    acc_S_mn, tScS, m_start, n_block * tile_n, kv_len,
                    diag_offset, window_left, window_right, row_seg, col_seg,
                )
            elif n_block < full_lo or n_block >= full_hi:
                self._apply_mask(
                    acc_S_mn, tScS, m_start, n_block * tile_n, kv_len,
                    diag_offset, window_left, window_right,
                )

            cute.arch.cp_async_wait_group(0)
            partial = n_block < full_lo or n_block >= full_hi
            if cutlass.const_expr(self.has_segments):
                # The same in every warp (votes), said so (see _check_values).
                # Its ids were just read for col_seg; loaded at the top of
                # the iteration instead, ptxas spilled more at hd64.
                mixed = rows_key == MIXED or segment_key(mKVSeg, batch, n_block * tile_n, tile_n) != rows_key
                partial = partial or cute.arch.make_warp_uniform(cutlass.Int32(mixed)) != 0
            if partial:
                self._check_values(sV, sVt, gmem_tiled_copy_load, tidx, acc_O, tOcO, n_block, kv_len, seen_mask)
            else:
                cute.arch.barrier()
            if n_iter + 1 < num_n_blocks:
                self._load_kv(
                    gmem_tiled_copy_load, tKgK, tKsK, tKVcKV, n_block - 1, k_rows_end, mK, paged
                )
                cute.arch.cp_async_commit_group()

            self._online_softmax(acc_S_mn, m16n8_acc_as_rows_cols(acc_O), row_max, row_sum, scale_log2)

            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            tOrP = cute.make_tensor(rP.iterator, self._acc_as_operand_a(rP.layout))
            self._gemm_rP(tiled_mma, acc_O, tOrP, tOrVt, smem_tiled_copy_V, tOsVt, tOrVt_view)

        # ---- epilogue: normalise, write LSE and O --------------------------
        acc_O_mn = m16n8_acc_as_rows_cols(acc_O)
        lane = tidx % 32
        for r in cutlass.range_constexpr(num_rows):
            total = self._quad_allreduce(row_sum[r], lambda a, b: a + b)
            row = m_start + tScS[r, 0][0]
            # A row saw a key iff its sum is not zero (NaN is not: its lse is
            # NaN). The others, and rows past q_len, store exact zeros.
            seen = total != 0.0 and row < q_len
            inv = cute.arch.rcp_approx(total)
            lse = -cutlass.Float32.inf
            if seen:
                lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * inv if seen else cutlass.Float32(0.0)
            if lane % 4 == 0 and row < seqlen_q:
                mLSE[batch, head_q, row] = lse

        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # Stage O through the Q buffer (each warp only ever read its own Q rows,
        # and the barrier below orders the writes before the cross-warp reads).
        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        smem_tiled_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma
        )
        smem_thr_copy_O = smem_tiled_copy_O.get_slice(tidx)
        cute.arch.barrier()
        cute.copy(smem_tiled_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))
        cute.arch.barrier()

        gO = cute.local_tile(mO[batch, None, head_q, None], (tile_m, head_dim), (m_block, 0))
        gmem_thr_store = gmem_tiled_copy_store.get_slice(tidx)
        tOsO = gmem_thr_store.partition_S(sO)
        tOgO = gmem_thr_store.partition_D(gO)
        tOrO = cute.make_fragment_like(tOgO, self.dtype)
        cute.copy(gmem_tiled_copy_store, tOsO, tOrO)
        for r in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if m_start + tQcQ[0, r, 0][0] < seqlen_q:
                cute.copy(gmem_tiled_copy_store, tOrO[None, r, None], tOgO[None, r, None])

    # ------------------------------------------------------------------------
    @cute.jit
    def _load_kv(
        self,
        tiled_copy: cute.TiledCopy,
        tXgX: cute.Tensor,
        tXsX: cute.Tensor,
        tXcX: cute.Tensor,
        n_block: cutlass.Int32,
        rows_end: cutlass.Int32,
        mX: cute.Tensor,
        paged,
    ):
        """cp.async one K or V tile; rows from rows_end on (at most seqlen_k)
        become zeros in smem. paged: (page table, sequence, split's first
        page) of the paged variant, whose tXgX holds each copy row's columns
        (paged_loads.py); None otherwise."""
        if cutlass.const_expr(paged is not None):
            mPageTable, sequence, first_page = paged
            load_paged_tile(tiled_copy, mX, tXgX, tXsX, tXcX, mPageTable, sequence, first_page,
                            n_block * self.tile_n, rows_end)
        elif (n_block + 1) * self.tile_n <= rows_end:
            cute.copy(tiled_copy, tXgX[None, None, None, n_block], tXsX)
        else:
            for r in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
                if n_block * self.tile_n + tXcX[0, r, 0][0] < rows_end:
                    cute.copy(tiled_copy, tXgX[None, r, None, n_block], tXsX[None, r, None])
                else:
                    tXsX[None, r, None].fill(0)

    @cute.jit
    def _check_values(self, sV, sVt, tiled_copy, tidx, acc_O, tOcO, n_block, kv_len, seen_mask: RowMask):
        """In place of the barrier after V's load, on a KV tile the mask cuts:
        each thread checks the V vectors its own cp.async wrote (complete
        after its wait), and the barrier ORs the answers. Where V holds a NaN
        or Inf, the output columns of the rows that see one turn NaN (acc_O,
        before the tile's rescale) and the tile's non-finite values are zeroed
        before the PV MMAs read them. (Reading V's NaN and Inf as zeros in a
        copy of the PV MMAs instead made ptxas recompute the ldmatrix
        addresses in every iteration.)"""
        found = any_nonfinite(sV, tiled_copy, tidx, self.tile_n, self.dtype, row_mode=0)
        # The same in every thread (a barrier's OR), said so: ptxas would
        # otherwise take the barriers below for divergent code and guard
        # every later shuffle of the loop with a branch.
        if cute.arch.make_warp_uniform(barrier_any(found, 0, self.num_threads)) != 0:
            n_start = n_block * self.tile_n
            rows_valid = cutlass.max(cutlass.min(kv_len - n_start, self.tile_n), 0)
            poison_seen_columns(m16n8_acc_as_rows_cols(acc_O), tOcO, sVt, n_start, rows_valid, seen_mask)
            # Every thread read V before any zeroes it.
            cute.arch.barrier()
            zero_nonfinite(sV, tiled_copy, tidx, self.tile_n, self.dtype, row_mode=0)
            cute.arch.barrier()

    @cute.jit
    def _gemm_smem(
        self, tiled_mma, acc, tCrA, tCrB,
        copy_A, tCsA, tCrA_view, copy_B, tCsB, tCrB_view,
    ):
        """acc += A B^T with both operands in smem; ldmatrix of k-block k+1
        is issued before the MMAs of k-block k so the two overlap."""
        num_k = cute.size(tCsA.shape[2])
        cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
        cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if k + 1 < num_k:
                cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
                cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    @cute.jit
    def _gemm_rP(self, tiled_mma, acc, tCrA, tCrB, copy_B, tCsB, tCrB_view):
        """acc += A B^T with A already in registers (P) and B in smem (V^T)."""
        num_k = cute.size(tCrA.shape[2])
        cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if k + 1 < num_k:
                cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    @cute.jit
    def _apply_mask(
        self, acc_S_mn, tScS, m_start, n_start, kv_len,
        diag_offset, window_left, window_right, row_seg=None, col_seg=None,
    ):
        """Set S to -inf where row i may not see column j (kernel_api.h)."""
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            row = m_start + tScS[r, 0][0]
            col_lo = cutlass.Int32(0)
            if window_left >= 0:
                col_lo = row + diag_offset - window_left
            col_hi = kv_len
            if window_right >= 0:
                col_hi = cutlass.min(row + diag_offset + window_right + 1, kv_len)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = n_start + tScS[0, c][1]
                if cutlass.const_expr(row_seg is not None):
                    if col < col_lo or col >= col_hi or row_seg[r] != col_seg[c]:
                        acc_S_mn[r, c] = -cutlass.Float32.inf
                elif col < col_lo or col >= col_hi:
                    acc_S_mn[r, c] = -cutlass.Float32.inf

    @cute.jit
    def _online_softmax(self, acc_S_mn, acc_O_mn, row_max, row_sum, scale_log2):
        """Turn S into unnormalised P = exp2(S*scale_log2 - m) and rescale the
        running O and row sums to the new row max m (fp32 throughout)."""
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            tile_max = acc_S_mn[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(acc_S_mn, mode=[1])):
                tile_max = cute.arch.fmax(tile_max, acc_S_mn[r, c])
            tile_max = self._quad_allreduce(tile_max, cute.arch.fmax)
            prev_max = row_max[r]
            new_max = cute.arch.fmax(prev_max, tile_max)
            # A row that has seen only masked keys keeps max -inf; subtracting
            # 0 instead keeps every exp2 at exactly 0 rather than NaN.
            max_scaled = (
                cutlass.Float32(0.0)
                if new_max == -cutlass.Float32.inf
                else new_max * scale_log2
            )
            correction = cute.math.exp2(prev_max * scale_log2 - max_scaled, fastmath=True)
            row_max[r] = new_max
            tile_sum = cutlass.Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                p = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - max_scaled, fastmath=True)
                acc_S_mn[r, c] = p
                tile_sum = tile_sum + p
            row_sum[r] = row_sum[r] * correction + tile_sum
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * correction

    @staticmethod
    def _quad_allreduce(value, op):
        """Reduce over the 4 lanes that share an accumulator row."""
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=2))
        return op(value, cute.arch.shuffle_sync_bfly(value, offset=1))

    @staticmethod
    def _acc_as_operand_a(layout):
        """Reinterpret two neighbouring n8 accumulator tiles as one k16 A operand:
        ((2, 2), M, N) -> ((2, 2, 2), M, N / 2)."""
        split = cute.logical_divide(layout, (None, None, 2))
        return cute.make_layout(
            ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
            stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
        )
