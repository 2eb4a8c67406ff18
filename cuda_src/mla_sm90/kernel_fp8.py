"""MLA decoding against the FP8 latent cache (SnapMLA's RoPE-aware per-token
scheme, docs/mla.md "The FP8 cache") for Hopper (sm_90a), in the CuTe DSL.

The cache is three arrays: latent codes [num_pages, 64, 512] float8_e4m3fn,
their per-token scales [num_pages, 64] float32 and the RoPE columns
[num_pages, 64, 64] bfloat16. The queries come quantised the same way (per
token and head, by jax_flash._mla_fp8.quantize_rows before the call, so
their codes are those of the XLA reference bit for bit): codes [B, R, 512],
scales [B, R], RoPE [B, R, 64]. The CTA layout is kernel.py's: a CTA serves
64 packed query rows (s_q x heads) of one sequence and one split of its
keys, the producer warpgroup loads, two consumer warpgroups compute in
kernel.py's seesaw over pairs of pages: each computes S of one page of the
pair (all 64 keys), requantises that page's P and hands the codes to the
other with its rows' running state (maximum, O's unit, largest unit), and
each multiplies both pages' P codes by its half of V. The P codes have a
tile per page of a pair, released by the receiving consumer once its
product has read them.

Per page (64 keys), with sq the rows' scales and sk the keys':

  S   = sq * sk * (Q codes . latent codes)      FP8 WGMMA, scales in registers
      + Q RoPE . page RoPE                      bfloat16 WGMMA, same accumulator
  P   = exp(S * scale - running max)            the online softmax of fwd_sm90
  Pk  = P * sk, requantised per row over the page's 64 keys: codes
        e4m3(Pk / sp), sp = amax(Pk) / 448
  O  += sp * (P codes . latent codes)           FP8 WGMMA

FP8 WGMMA reads both operands K-major, so for P V the page's latent codes
(keys x 512, columns contiguous) must become a V tile with the keys
contiguous: three warps of the producer warpgroup transpose each page once
in shared memory (fp8_ops.transpose_page) while the consumers compute.

O's accumulator is kept in units of the current page's P scale: when a
page's scale differs from the previous one (and when the running maximum
moves), O is multiplied by factor * unit_old / unit_new before the next
FP8 product, and the epilogue multiplies by the last unit / l. The unit is
sp except where sp lies more than 2^64 below the largest unit the row has
used (in the current maximum's terms): there the unit stays at that floor
and the page's codes round to zero, so that a page whose probabilities
underflow relative to the others (its contribution below float32 rounding
of the result) cannot blow the accumulator up by 1 / sp.

NaN semantics as kernel.py's: a non-finite S (a NaN code or scale, an Inf
in a RoPE column, a non-finite query) is made NaN before the mask, so that
it reaches exactly the rows that see its key; in a page with keys that not
every row sees, the transposition zeroes the codes past the cache length
and the NaN codes of those keys (fp8_ops.transpose_page), so that P = 0
times them reaches no other row.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.dsl_common import LOG2E, wgmma_acc_as_rows_cols
from ..common.nonfinite import is_nonfinite
from ..fwd_sm90.online_softmax import quad_allreduce, tile_row_max, update_row
from .fp8_ops import PAGE_LAYOUT, STAGE_BYTES, V_LAYOUT, rcp_rn, transpose_page
from .kernel import (CONSUMERS, KV_STAGES, LATENT, PAGE, ROWS, V_COLS, WG_THREADS,
                     MlaDecodeSm90, SplitProblem, hand_over_pipelines, issue_product,
                     mask_unseen_keys, seesaw_states)

ROPE = 64  # RoPE columns
FP8_MAX = 448.0
# Warps 1-3 of the producer warpgroup transpose the pages (warp 0 loads).
TRANSPOSER_WARPS = 3
TRANSPOSERS = TRANSPOSER_WARPS * 32
# setmaxnreg: 128 * 40 + 256 * 232 <= 65536 registers of the CTA; the
# transposition needs more than kernel.py's 24 of the producer.
PRODUCER_REGS = 40
CONSUMER_REGS = 232
# A page's P unit never falls below this fraction of the largest the row has
# used, nor below the smallest normal float32 (see the module docstring).
UNIT_FLOOR = 2.0 ** -64
MIN_NORMAL = 2.0 ** -126
# Columns of the per-row shared storage: the row sums exchanged at the end,
# and what one consumer hands the other with a page's P (running maximum,
# O's unit, largest unit used).
SUMS, HAND_MAX, HAND_UNIT, HAND_LARGEST = range(4)


class MlaDecodeFp8Sm90(MlaDecodeSm90):
    """MLA decode against the FP8 cache; bfloat16 queries' RoPE and output."""

    def __init__(self):
        self.dtype = cutlass.BFloat16

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, R, 512] float8_e4m3fn codes, R = s_q * heads rows, token-major
        mQScales: cute.Tensor,  # [B, R] float32
        mQRope: cute.Tensor,  # [B, R, 64] bfloat16
        mLatent: cute.Tensor,  # [num_pages, 64, 512] float8_e4m3fn
        mScales: cute.Tensor,  # [num_pages, 64] float32
        mRope: cute.Tensor,  # [num_pages, 64, 64] bfloat16
        mO: cute.Tensor,  # [B * splits, R, 512] bfloat16
        mLSE: cute.Tensor,  # [B * splits, R] float32
        mPageTable: cute.Tensor,  # [B, splits * split_pages] int32
        mQLens: cute.Tensor,  # [B] int32
        mKVLens: cute.Tensor,  # [B] int32
        scale: cutlass.Float32,
        heads: cutlass.Int32,
        split_pages: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        fp8, bf16 = cutlass.Float8E4M3FN, cutlass.BFloat16
        # TMA views with the contiguous columns first.
        rows_first = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 2, 0]))
        mScalest = cute.make_tensor(mScales.iterator, cute.select(mScales.layout, mode=[1, 0]))
        k_major = warpgroup.OperandMajorMode.K
        mma = lambda dt, n: sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, cutlass.Float32, (1, 1, 1), (ROWS, n),
            warpgroup.OperandSource.SMEM)
        tiled_mma_lat, tiled_mma_rope, tiled_mma_pv = mma(fp8, PAGE), mma(bf16, PAGE), mma(
            fp8, V_COLS)
        row_major = LayoutEnum.ROW_MAJOR
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS, PAGE, LATENT), fp8, 1)
        sQR_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS, PAGE, ROPE), bf16, 1)
        sL_layout = sm90_utils.make_smem_layout_b(row_major, (ROWS, PAGE, LATENT), fp8, KV_STAGES)
        sR_layout = sm90_utils.make_smem_layout_b(row_major, (ROWS, PAGE, ROPE), bf16, KV_STAGES)
        sV_layout = sm90_utils.make_smem_layout_b(row_major, (ROWS, LATENT, PAGE), fp8, KV_STAGES)
        # One P tile per page of a pair (the seesaw's hand-overs).
        sP_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS, V_COLS, PAGE), fp8, 2)
        # O leaves through the V tiles' memory (64 KiB), each consumer's half as one stage.
        sO_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS, PAGE, V_COLS), bf16, CONSUMERS)
        sS_layout = cute.make_layout((PAGE, KV_STAGES))
        # fp8_ops computes the transposition's addresses from these two.
        if cutlass.const_expr(str(sL_layout) != PAGE_LAYOUT or str(sV_layout) != V_LAYOUT):
            raise ValueError(f"MlaDecodeFp8Sm90: shared layouts {sL_layout} / {sV_layout} are not "
                             f"fp8_ops' {PAGE_LAYOUT} / {V_LAYOUT}")
        stage = lambda layout: cute.slice_(layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, rows_first(mQ), stage(sQ_layout),
                                                    (ROWS, LATENT))
        tma_qr, mQR_tma = cpasync.make_tiled_tma_atom(g2s, rows_first(mQRope), stage(sQR_layout),
                                                      (ROWS, ROPE))
        tma_l, mL_tma = cpasync.make_tiled_tma_atom(g2s, rows_first(mLatent), stage(sL_layout),
                                                    (PAGE, LATENT))
        tma_r, mR_tma = cpasync.make_tiled_tma_atom(g2s, rows_first(mRope), stage(sR_layout),
                                                    (PAGE, ROPE))
        tma_s, mS_tma = cpasync.make_tiled_tma_atom(g2s, mScalest, cute.make_layout(PAGE), (PAGE,))
        tma_o, mO_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), rows_first(mO), stage(sO_layout), (ROWS, V_COLS))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            # The seesaw's hand-overs of a pair's first and second page.
            mbar_hand: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sQ_layout)], 1024]
            sQR: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQR_layout)], 1024]
            sL: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sL_layout)], 1024]
            sR: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sR_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sP_layout)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, PAGE * KV_STAGES], 128]
            # Per row and consumer (SUMS) or page of a pair (HAND_*).
            sRow: cute.struct.MemRange[cutlass.Float32, 4 * CONSUMERS * ROWS]

        self.q_bytes = (cute.size_in_bytes(fp8, stage(sQ_layout))
                        + cute.size_in_bytes(bf16, stage(sQR_layout)))
        self.k_bytes = (cute.size_in_bytes(fp8, stage(sL_layout))
                        + cute.size_in_bytes(bf16, stage(sR_layout)) + PAGE * 4)
        rows = mQ.shape[1]
        grid = (cute.ceil_div(rows, ROWS), cute.size(mO.shape[0]), 1)
        self.kernel_fp8(
            tma_q, mQ_tma, tma_qr, mQR_tma, tma_l, mL_tma, tma_r, mR_tma, tma_s, mS_tma,
            tma_o, mO_tma, mQScales, mLSE, mPageTable, mQLens, mKVLens, scale, heads,
            split_pages, rows, sQ_layout, sQR_layout, sL_layout, sR_layout, sV_layout, sP_layout,
            sO_layout, sS_layout, tiled_mma_lat, tiled_mma_rope, tiled_mma_pv, SharedStorage,
        ).launch(grid=grid, block=[WG_THREADS * (1 + CONSUMERS), 1, 1], stream=stream)

    @cute.kernel
    def kernel_fp8(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_qr: cute.CopyAtom,
        mQR: cute.Tensor,
        tma_l: cute.CopyAtom,
        mL: cute.Tensor,
        tma_r: cute.CopyAtom,
        mR: cute.Tensor,
        tma_s: cute.CopyAtom,
        mS: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mQScales: cute.Tensor,
        mLSE: cute.Tensor,
        mPageTable: cute.Tensor,
        mQLens: cute.Tensor,
        mKVLens: cute.Tensor,
        scale: cutlass.Float32,
        heads: cutlass.Int32,
        split_pages: cutlass.Int32,
        rows: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sQR_layout: cute.ComposedLayout,
        sL_layout: cute.ComposedLayout,
        sR_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sS_layout: cute.Layout,
        tiled_mma_lat: cute.TiledMma,
        tiled_mma_rope: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        layouts = (sQ_layout, sQR_layout, sL_layout, sR_layout, sV_layout, sP_layout, sO_layout,
                   sS_layout)
        q_loads = (tma_q, mQ, tma_qr, mQR)
        page_loads = (tma_l, mL, tma_r, mR, tma_s, mS)
        mmas = (tiled_mma_lat, tiled_mma_rope, tiled_mma_pv)
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        if warp_idx == 0:
            for atom in (tma_q, tma_qr, tma_l, tma_r, tma_s, tma_o):
                cpasync.prefetch_descriptor(atom)
        row_tile, out_idx, _ = cute.arch.block_idx()
        split = SplitProblem(out_idx, mPageTable, mQLens, mKVLens, split_pages, rows // heads)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        smem = SmemTiles(storage, layouts)

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * CONSUMERS)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer_group,
            consumer_group=consumer_warps, tx_count=self.q_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        # A page stage is released with one arrive per consumer warp, once
        # the S products and the transposition have read it (_consume_fp8).
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=KV_STAGES,
            producer_group=producer_group, consumer_group=consumer_warps, tx_count=self.k_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        # The V tiles: filled by the transposing threads, read by every consumer thread.
        pipe_v = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=KV_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, TRANSPOSERS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     CONSUMERS * WG_THREADS),
            defer_sync=True)
        # One consumer's P and running state to the other.
        hands = hand_over_pipelines(storage.mbar_hand.data_ptr())
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self._produce_fp8(q_loads, page_loads, smem, pipe_q, pipe_k, mPageTable, split,
                                  row_tile)
            else:
                self._transpose_pages(warp_idx - 1, tidx % 32, smem, pipe_k, pipe_v, split)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume_fp8(tidx % WG_THREADS, wg_idx - 1, smem, pipe_q, pipe_k, pipe_v, hands,
                              mmas, tma_o, mO, mQScales, mLSE, split, scale * LOG2E, heads, rows,
                              row_tile, out_idx)

    @cute.jit
    def _produce_fp8(self, q_loads, page_loads, smem, pipe_q, pipe_k, mPageTable, split,
                     row_tile):
        """One warp: the Q tile (codes and RoPE), then the split's pages in
        order, each page's codes, RoPE and scales on one barrier."""
        tma_q, mQ, tma_qr, mQR = q_loads
        tma_l, mL, tma_r, mR, tma_s, mS = page_loads
        whole = lambda t: cute.group_modes(t, 0, 2)
        partition = lambda atom, s, g: cpasync.tma_partition(atom, 0, cute.make_layout(1), s, g)
        sequence = split.sequence
        tQsQ, tQgQ = partition(tma_q, whole(smem.q), whole(cute.local_tile(
            mQ[None, None, sequence], (ROWS, LATENT), (None, 0))))
        tRsQ, tRgQ = partition(tma_qr, whole(smem.q_rope), whole(cute.local_tile(
            mQR[None, None, sequence], (ROWS, ROPE), (None, 0))))
        tLsL, tLgL = partition(tma_l, whole(smem.latent), whole(mL))
        tRsR, tRgR = partition(tma_r, whole(smem.rope), whole(mR))
        tSsS, tSgS = partition(tma_s, cute.group_modes(smem.scales, 0, 1),
                               cute.group_modes(mS, 0, 1))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        q_bar = pipe_q.producer_get_barrier(q_state)
        cute.copy(tma_q, tQgQ[None, row_tile], tQsQ[None, 0], tma_bar_ptr=q_bar)
        cute.copy(tma_qr, tRgQ[None, row_tile], tRsQ[None, 0], tma_bar_ptr=q_bar)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        for j in cutlass.range(split.tiles, unroll=1):
            # A page id outside the pool is a TMA box out of bounds: zeros.
            page = mPageTable[sequence, split.first_page + j]
            pipe_k.producer_acquire(kv_state)
            bar = pipe_k.producer_get_barrier(kv_state)
            stage = kv_state.index
            cute.copy(tma_l, tLgL[None, page], tLsL[None, stage], tma_bar_ptr=bar)
            cute.copy(tma_r, tRgR[None, page], tRsR[None, stage], tma_bar_ptr=bar)
            cute.copy(tma_s, tSgS[None, page], tSsS[None, stage], tma_bar_ptr=bar)
            kv_state.advance()

    @cute.jit
    def _transpose_pages(self, warp, lane, smem, pipe_k, pipe_v, split):
        """Warps 1-3: each landed page's codes into the V tile of its stage."""
        shared_keys = cutlass.min(split.diagonal, split.kv_len - 1)
        page_base = smem.latent_base.toint()
        v_base = smem.v_base.toint()
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        for j in cutlass.range(split.tiles, unroll=1):
            pipe_k.consumer_wait(kv_state)
            pipe_v.producer_acquire(v_state)
            transpose_page(page_base + kv_state.index * STAGE_BYTES,
                           v_base + v_state.index * STAGE_BYTES, warp, lane, TRANSPOSER_WARPS,
                           j * PAGE, shared_keys, split.kv_len)
            # The generic-proxy writes must be visible to the WGMMA (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            pipe_v.producer_commit(v_state)
            kv_state.advance()
            v_state.advance()

    @cute.jit
    def _consume_fp8(self, tid, wg, smem, pipe_q, pipe_k, pipe_v, hands, mmas, tma_o, mO,
                     mQScales, mLSE, split, scale_log2, heads, rows, row_tile, out_idx):
        """kernel.py's seesaw over pairs of pages (a, b): consumer 0 computes
        S of a, consumer 1 S of b (each the whole page), each requantises its
        page's P with the page's own scale and hands the codes over with its
        running state; each multiplies both pages' P codes by its half of
        V, rescaling O in between (to the new maximum and the new unit)."""
        tiled_mma_lat, tiled_mma_rope, tiled_mma_pv = mmas
        thr_lat = tiled_mma_lat.get_slice(tid)
        thr_rope = tiled_mma_rope.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        tSrQ = thr_lat.make_fragment_A(thr_lat.partition_A(smem.q[None, None, 0]))
        tSrL = thr_lat.make_fragment_B(thr_lat.partition_B(smem.latent))
        tSrQR = thr_rope.make_fragment_A(thr_rope.partition_A(smem.q_rope[None, None, 0]))
        tSrR = thr_rope.make_fragment_B(thr_rope.partition_B(smem.rope))
        # This warpgroup's 256 V columns: (256, 64 keys, stage).
        sV_wg = cute.flat_divide(smem.v, (V_COLS, PAGE))[None, None, wg, 0, None]
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV_wg))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(smem.p))
        tPsP = thr_lat.partition_C(smem.p)
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((ROWS, V_COLS)))
        acc_O.fill(0.0)
        sO_wg = smem.o[None, None, wg]
        tOsO = thr_pv.partition_C(sO_wg)
        # Set once, outside control flow: S starts from a zero fill.
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_lat.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_rope.set(warpgroup.Field.ACCUMULATE, True)
        acc_S = thr_lat.make_fragment_C(thr_lat.partition_shape_C((ROWS, PAGE)))
        acc_O_mn = wgmma_acc_as_rows_cols(acc_O)
        acc_S_mn = wgmma_acc_as_rows_cols(acc_S)
        tScS = wgmma_acc_as_rows_cols(thr_lat.partition_C(cute.make_identity_tensor((ROWS, PAGE))))
        num_rows = cute.size(tScS, mode=[0])
        num_cols = cute.size(tScS, mode=[1])
        state = RowState(num_rows)
        key_scale = cute.make_rmem_tensor(num_cols, cutlass.Float32)
        tile_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        # The last split-local key each of this thread's rows sees, and its query scale.
        last_key = cute.make_rmem_tensor(num_rows, cutlass.Int32)
        row_scale = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = row_tile * ROWS + tScS[r, 0][0]
            last_key[r] = cutlass.min(split.diagonal + row // heads, split.kv_len - 1)
            row_scale[r] = cutlass.Float32(0.0)
            if row < rows:
                row_scale[r] = mQScales[split.sequence, row]
        # Keys up to this one are seen by every query row.
        shared_keys = cutlass.min(split.diagonal, split.kv_len - 1)
        rP = cute.make_rmem_tensor(acc_S.layout, cutlass.Float8E4M3FN)
        scores = (tiled_mma_lat, tiled_mma_rope, tSrQ, tSrL, tSrQR, tSrR, acc_S, acc_S_mn, tScS,
                  row_scale, key_scale, tile_max, smem.scales)
        products = (tiled_mma_pv, acc_O, acc_O_mn, tOrP, tOrV)
        sHand = smem.row

        pipe_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        # The pages' V tiles move through pipe_v's stages in the same steps.
        page_a, page_b, give, take = seesaw_states()
        hand_a, hand_b = hands
        for i in cutlass.range(cute.ceil_div(split.tiles, 2), unroll=1):
            first_a = 2 * i * PAGE
            first_b = first_a + PAGE
            has_b = first_b < split.kv_len
            if wg == 0:
                pipe_k.consumer_wait(page_a)
                self._scores_fp8(scores, 0, first_a, first_a + PAGE - 1 > shared_keys, last_key)
                self._requantize_p(acc_S_mn, tile_max, key_scale, state, scale_log2)
                self._publish_fp8(acc_S, rP, tPsP, 0, state, sHand, tScS, tid, hand_a, give)
                pipe_v.consumer_wait(page_a)
                # Page a's stage is done with: its S product has completed,
                # its key scales are read, and the transposition has read
                # the codes (V tile full), so the next load may start.
                pipe_k.consumer_release(page_a)
                self._product_fp8(products, state.rescale, 0)
                if has_b:
                    self._adopt(sHand, 1, tScS, state, scale_log2, hand_b, take)
            else:
                if has_b:
                    pipe_k.consumer_wait(page_b)
                    self._scores_fp8(scores, 1, first_b, first_b + PAGE - 1 > shared_keys,
                                     last_key)
                self._adopt(sHand, 0, tScS, state, scale_log2, hand_a, take)
                pipe_v.consumer_wait(page_a)
                pipe_k.consumer_release(page_a)
                self._product_fp8(products, state.rescale, 0)
                if has_b:
                    self._requantize_p(acc_S_mn, tile_max, key_scale, state, scale_log2)
                    self._publish_fp8(acc_S, rP, tPsP, 1, state, sHand, tScS, tid, hand_b, give)
            # Both consumers: page a's product done (its P tile free for the
            # next pair once the receiving consumer says so), then page b's.
            warpgroup.wait_group(0)
            pipe_v.consumer_release(page_a)
            if wg == 1:
                hand_a.consumer_release(take)
            if has_b:
                pipe_v.consumer_wait(page_b)
                pipe_k.consumer_release(page_b)
                self._product_fp8(products, state.rescale, 1)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(page_b)
                if wg == 0:
                    hand_b.consumer_release(take)
            page_a.advance(KV_STAGES)
            page_b.advance(KV_STAGES)
            give.advance()
            take.advance()

        self._store(tid, wg, acc_O, acc_O_mn, tOsO, tScS, state.max, state.sum, scale_log2, sO_wg,
                    sHand[None, SUMS], tma_o, mO, mLSE, split, heads, rows, row_tile, out_idx,
                    unit=state.unit)

    @cute.jit
    def _scores_fp8(self, scores, stage, first, partial, last_key):
        """S = sq * sk * (Q codes . latent codes) + Q RoPE . page RoPE of the
        page in `stage` (its first split-local key `first`): a non-finite
        logit made NaN, then the keys a row does not see masked to -inf.
        Leaves the page's key scales in key_scale, its row maxima in tile_max."""
        (tiled_mma_lat, tiled_mma_rope, tSrQ, tSrL, tSrQR, tSrR, acc_S, acc_S_mn, tScS, row_scale,
         key_scale, tile_max, sScales) = scores
        num_rows = cute.size(acc_S_mn, mode=[0])
        num_cols = cute.size(acc_S_mn, mode=[1])
        acc_S.fill(0.0)
        issue_product(tiled_mma_lat, acc_S, tSrQ, tSrL[None, None, None, stage])
        warpgroup.wait_group(0)
        for c in cutlass.range_constexpr(num_cols):
            key_scale[c] = sScales[tScS[0, c][1], stage]
        for r in cutlass.range_constexpr(num_rows):
            for c in cutlass.range_constexpr(num_cols):
                acc_S_mn[r, c] = acc_S_mn[r, c] * row_scale[r] * key_scale[c]
        # The RoPE product joins the scaled latent one in the accumulator.
        issue_product(tiled_mma_rope, acc_S, tSrQR, tSrR[None, None, None, stage])
        warpgroup.wait_group(0)
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            if is_nonfinite(acc_S[i]):
                acc_S[i] = cutlass.Float32(math.nan)
        if partial:
            mask_unseen_keys(acc_S_mn, tScS, first, last_key)
        for r in cutlass.range_constexpr(num_rows):
            tile_max[r] = tile_row_max(acc_S_mn, r, 1)

    @cute.jit
    def _requantize_p(self, acc_S_mn, tile_max, key_scale, state, scale_log2):
        """The online softmax step over the page (fwd_sm90's, conditional
        rescaling included), then P <- the codes' values of P * sk in units
        of the page's P scale (amax over its 64 keys / 448): state.rescale
        takes O from the previous unit (and maximum) to this one."""
        num_rows = cute.size(acc_S_mn, mode=[0])
        num_cols = cute.size(acc_S_mn, mode=[1])
        for r in cutlass.range_constexpr(num_rows):
            update_row(acc_S_mn, r, tile_max[r], state.max, state.sum, state.factor, scale_log2,
                       True, 1)
            amax = cutlass.Float32(0.0)
            for c in cutlass.range_constexpr(num_cols):
                p = acc_S_mn[r, c]
                # A key no row sees has P = 0 and maybe a NaN scale.
                pk = cutlass.Float32(0.0) if p == 0.0 else p * key_scale[c]
                acc_S_mn[r, c] = pk
                amax = cute.arch.fmax(amax, cute.arch.fmax(pk, -pk))
            p_scale = quad_allreduce(amax, cute.arch.fmax) * cutlass.Float32(1.0 / FP8_MAX)
            state.largest[r] = cute.arch.fmax(state.largest[r] * state.factor[r], p_scale)
            new_unit = cute.arch.fmax(cute.arch.fmax(p_scale, state.largest[r] * UNIT_FLOOR),
                                      MIN_NORMAL)
            inverse = state.move_unit(r, new_unit)
            for c in cutlass.range_constexpr(num_cols):
                acc_S_mn[r, c] = acc_S_mn[r, c] * inverse

    @cute.jit
    def _publish_fp8(self, acc_S, rP, tPsP, stage, state, sHand, tScS, tid, hand, give):
        """The page's P codes (P tile `stage`) and the rows' running state
        to the other consumer, visible to its WGMMA."""
        hand.producer_acquire(give)
        rP.store(acc_S.load().to(cutlass.Float8E4M3FN))
        cute.autovec_copy(rP, tPsP[None, None, None, stage])
        for r in cutlass.range_constexpr(cute.size(state.max)):
            if tid % 4 == 0:
                row = stage * ROWS + tScS[r, 0][0]
                sHand[row, HAND_MAX] = state.max[r]
                sHand[row, HAND_UNIT] = state.unit[r]
                sHand[row, HAND_LARGEST] = state.largest[r]
        cute.arch.fence_proxy("async.shared", space="cta")
        hand.producer_commit(give)

    @cute.jit
    def _adopt(self, sHand, stage, tScS, state, scale_log2, hand, take):
        """Waits for the other consumer's page in `stage` and takes its rows'
        running state: state.rescale is what O is multiplied by before that
        page's product (the same bits as the other consumer's). The P tile
        is released after the product (by the caller)."""
        hand.consumer_wait(take)
        row_max, factor = state.max, state.factor
        for r in cutlass.range_constexpr(cute.size(row_max)):
            row = stage * ROWS + tScS[r, 0][0]
            new_max = sHand[row, HAND_MAX]
            factor[r] = cutlass.Float32(1.0)
            if new_max != -cutlass.Float32.inf:
                factor[r] = cute.arch.exp2((row_max[r] - new_max) * scale_log2)
            state.sum[r] = state.sum[r] * factor[r]
            row_max[r] = new_max
            state.largest[r] = sHand[row, HAND_LARGEST]
            state.move_unit(r, sHand[row, HAND_UNIT])

    @cute.jit
    def _product_fp8(self, products, rescale, stage):
        """O rescaled row by row, then O += P codes . V codes of the page in
        `stage` (this consumer's columns; issued, not waited for)."""
        tiled_mma_pv, acc_O, acc_O_mn, tOrP, tOrV = products
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * rescale[r]
        issue_product(tiled_mma_pv, acc_O, tOrP[None, None, None, stage],
                      tOrV[None, None, None, stage])


class RowState:
    """Per row of a thread: the online softmax's running maximum, sum of
    this consumer's P and last factor; O's unit (the current page's P scale)
    and the largest unit used, in the current maximum's terms; and what O
    is multiplied by before the next product."""

    def __init__(self, num_rows):
        make = lambda: cute.make_rmem_tensor(num_rows, cutlass.Float32)
        self.max, self.sum, self.factor = make(), make(), make()
        self.unit, self.largest, self.rescale = make(), make(), make()
        self.max.fill(-cutlass.Float32.inf)
        self.sum.fill(0.0)
        self.unit.fill(1.0)
        self.largest.fill(0.0)

    def move_unit(self, r, new_unit):
        """O's unit of row r becomes new_unit: rescale[r] = factor * old
        unit / new unit. Returns 1 / new_unit."""
        inverse = rcp_rn(new_unit)
        # In this order the product stays within 2^64 (new_unit is at least
        # 2^-64 of factor * the old unit), and a factor of 0 gives 0.
        self.rescale[r] = (self.factor[r] * self.unit[r]) * inverse
        self.unit[r] = new_unit
        return inverse


class SmemTiles:
    """The shared-memory tensors of one CTA."""

    def __init__(self, storage, layouts):
        sQ, sQR, sL, sR, sV, sP, sO, sS = layouts
        self.q = storage.sQ.get_tensor(sQ.outer, swizzle=sQ.inner)
        self.q_rope = storage.sQR.get_tensor(sQR.outer, swizzle=sQR.inner)
        self.latent = storage.sL.get_tensor(sL.outer, swizzle=sL.inner)
        self.rope = storage.sR.get_tensor(sR.outer, swizzle=sR.inner)
        self.v = storage.sV.get_tensor(sV.outer, swizzle=sV.inner)
        self.p = storage.sP.get_tensor(sP.outer, swizzle=sP.inner)
        self.o = storage.sV.get_tensor(sO.outer, swizzle=sO.inner, dtype=cutlass.BFloat16)
        self.scales = storage.sS.get_tensor(sS)
        # Byte addresses for the transposition (fp8_ops computes the swizzle).
        self.latent_base = storage.sL.data_ptr()
        self.v_base = storage.sV.data_ptr()
        self.row = storage.sRow.get_tensor(cute.make_layout((CONSUMERS * ROWS, 4)))
