"""MLA decoding (DeepSeek multi-head latent attention) against a paged
bfloat16 / float16 latent cache, for Hopper (sm_90a), in the CuTe DSL.

The cache holds one 576-wide row per token ([num_pages, 64, 576]): 512
latent columns then 64 RoPE columns. Every query head reads the same rows,
so a sequence's s_q x heads query rows (row r: token r // heads, head r %
heads) are packed into tiles of 64, and one CTA serves one (row tile,
sequence, split) triple: it reads each of the split's pages once for all 64
rows. The keys of a sequence are cut into splits of split_pages pages (a
fixed number of keys: batch invariant, docs/paged.md); the caller merges
the partial results.

Warpgroup 0 is the producer: one of its warps loads the Q tile once and
then, for each page of the split in order, looks the page up in the page
table and loads it whole (64 x 576) with TMA into a two-stage ring. The
page is the K tile of S = Q K^T and, through a transposed view of the same
shared memory, its first 512 columns are the V tile of O = P V.

Warpgroups 1 and 2 are the consumers, each owning half of O's 512 columns
(a 64 x 256 float32 accumulator), scheduled as a seesaw over pairs of pages
(a, b): consumer 0 computes S = Q K^T of page a and consumer 1 that of page
b, each over the whole page (64 x 64); consumer 0 takes its softmax step,
writes P = exp(S - max) into a's RoPE columns (which only its own S read)
and hands it over with its running maxima; consumer 1 continues the online
softmax from those maxima over page b and hands over b's P the same way; each
multiplies both pages' P by its half of V, rescaling O in between. So one
consumer's softmax runs under the other's products, both end each pair with
the same running maximum, bit for bit, and each page's S is one product of
full width. A pair's last page may be missing (an odd number of pages);
the row sums are exchanged once, at the end.

Visibility: query token t of a sequence with q_len new tokens and `total`
cached ones sees keys up to total - q_len + t. Only the split's last tiles
can hold keys that some rows do not see (the causal band of s_q - 1 keys,
and slots past the cache length); there S is masked per element, and,
since P = 0 times a non-finite V would still poison the output, the V
values of those keys are checked and zeroed in shared memory after the
page's S has read them as K (each consumer its own columns): a non-finite
value makes the output column NaN exactly for the rows that see its key
(docs/numerics.md).
"""

import math
import operator

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.dsl_common import LOG2E, wgmma_acc_as_rows_cols
from ..common.nonfinite import is_nonfinite
from ..fwd_sm90.online_softmax import (
    quad_allreduce, rescale_rows, store_converted, tile_row_max, update_row)

ROWS = 64  # query rows of a tile: one WGMMA accumulator's
PAGE = 64  # tokens per page: one K / V tile
HEAD_DIM = 576  # latent + RoPE columns
LATENT = 512  # the V columns
CONSUMERS = 2
V_COLS = LATENT // CONSUMERS  # O columns per consumer warpgroup
WG_THREADS = 128
KV_STAGES = 2  # Q (72 KiB) + 2 pages (144 KiB) fill the 227 KiB of shared memory
# setmaxnreg: 128 * 24 + 256 * 240 <= 65536 registers of the CTA.
PRODUCER_REGS = 24
CONSUMER_REGS = 240
# Named barriers (0 is __syncthreads): both consumers, then one per consumer.
BAR_CONSUMERS = 1
BAR_OWN = 2
LN2 = math.log(2.0)
# A page stage (keys x columns, column blocks of 64 outermost, so the RoPE
# columns are its last 64 x 64 block at element LATENT * PAGE) and the P tile,
# as cute prints them.
K_LAYOUT = "S<3,4,3> o 0 o ((8,8),(64,9),(1,2)):((64,512),(1,4096),(0,36864))"
P_LAYOUT = "S<3,4,3> o 0 o ((8,8),(64,1),(1,1)):((64,512),(1,0),(0,0))"


class MlaDecodeSm90:
    """MLA decode for one 16-bit dtype."""

    def __init__(self, dtype):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise ValueError(f"MlaDecodeSm90: dtype must be BFloat16 or Float16, got {dtype}")
        self.dtype = dtype

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, R, 576]: R = s_q * heads rows, token-major
        mCache: cute.Tensor,  # [num_pages, 64, 576]
        mO: cute.Tensor,  # [B * splits, R, 512]
        mLSE: cute.Tensor,  # [B * splits, R] float32
        mPageTable: cute.Tensor,  # [B, splits * split_pages] int32
        mQLens: cute.Tensor,  # [B] int32
        mKVLens: cute.Tensor,  # [B] int32
        scale: cutlass.Float32,
        heads: cutlass.Int32,
        split_pages: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        # TMA views with the contiguous columns first: (rows, columns, batch).
        mQt = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mKt = cute.make_tensor(mCache.iterator, cute.select(mCache.layout, mode=[1, 2, 0]))
        mOt = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 2, 0]))
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (ROWS, PAGE), warpgroup.OperandSource.SMEM)
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (ROWS, V_COLS), warpgroup.OperandSource.SMEM)
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (ROWS, PAGE, HEAD_DIM), dtype, 1)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (ROWS, PAGE, HEAD_DIM), dtype,
                                                  KV_STAGES)
        # O leaves through Q's memory, each consumer's half as one stage.
        sO_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (ROWS, PAGE, V_COLS), dtype,
                                                  CONSUMERS)
        sP_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (ROWS, V_COLS, PAGE), dtype, 1)
        # The consumers keep each page's P in its RoPE columns: the stage's
        # last 64 x 64 block, laid out as the P operand (see kernel()).
        if cutlass.const_expr(str(sK_layout) != K_LAYOUT or str(sP_layout) != P_LAYOUT):
            raise ValueError(f"MlaDecodeSm90: shared layouts {sK_layout} / {sP_layout} are not "
                             f"{K_LAYOUT} / {P_LAYOUT}")
        sQ_stage = cute.slice_(sQ_layout, (None, None, 0))
        sK_stage = cute.slice_(sK_layout, (None, None, 0))
        sO_stage = cute.slice_(sO_layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQt, sQ_stage, (ROWS, HEAD_DIM))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mKt, sK_stage, (PAGE, HEAD_DIM))
        tma_o, mO_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mOt, sO_stage, (ROWS, V_COLS))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            # The seesaw's hand-overs of a pair's first and second page.
            mbar_hand: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            # Per consumer, a value per row: the sums exchanged at the end;
            # per page of a pair, the running maxima handed over.
            sRow: cute.struct.MemRange[cutlass.Float32, 2 * CONSUMERS * ROWS]

        self.q_bytes = cute.size_in_bytes(dtype, sQ_stage)
        self.k_bytes = cute.size_in_bytes(dtype, sK_stage)
        rows = mQ.shape[1]
        grid = (cute.ceil_div(rows, ROWS), cute.size(mO.shape[0]), 1)
        self.kernel(
            tma_q, mQ_tma, tma_k, mK_tma, tma_o, mO_tma, mLSE, mPageTable, mQLens, mKVLens,
            scale, heads, split_pages, rows, sQ_layout, sK_layout, sO_layout, sP_layout,
            tiled_mma_qk, tiled_mma_pv, SharedStorage,
        ).launch(grid=grid, block=[WG_THREADS * (1 + CONSUMERS), 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mPageTable: cute.Tensor,
        mQLens: cute.Tensor,
        mKVLens: cute.Tensor,
        scale: cutlass.Float32,
        heads: cutlass.Int32,
        split_pages: cutlass.Int32,
        rows: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_o):
                cpasync.prefetch_descriptor(atom)
        row_tile, out_idx, _ = cute.arch.block_idx()
        split = SplitProblem(out_idx, mPageTable, mQLens, mKVLens, split_pages, rows // heads)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # P of each stage's page lives in its RoPE columns (the last 64 x 64
        # block of the stage, laid out as the P operand), read as K only by
        # that page's own S product.
        sP_stage = cute.slice_(sP_layout, (None, None, 0))
        stage_elems = cute.cosize(sK_layout) // KV_STAGES
        sPs = cute.make_tensor(
            cute.recast_ptr(storage.sK.data_ptr() + LATENT * PAGE, sP_layout.inner,
                            dtype=self.dtype),
            cute.append(sP_stage.outer, cute.make_layout(KV_STAGES, stride=stage_elems)))
        sRow = storage.sRow.get_tensor(cute.make_layout((CONSUMERS * ROWS, 2)))
        # V (512 columns, 64 keys, stage): the K stages read transposed. The
        # K layout's index is key + 64 * column + 64 * 576 * stage.
        transpose = cute.make_layout((LATENT, PAGE, KV_STAGES), stride=(PAGE, 1, PAGE * HEAD_DIM))
        sV = cute.make_tensor(sK.iterator, cute.composition(sK_layout.outer, transpose))

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer_group,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * CONSUMERS),
            tx_count=self.q_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        # A stage is released with one arrive per consumer warp.
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=KV_STAGES,
            producer_group=producer_group,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * CONSUMERS),
            tx_count=self.k_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        hands = hand_over_pipelines(storage.mbar_hand.data_ptr())
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self._produce(tma_q, mQ, tma_k, mK, sQ, sK, pipe_q, pipe_k, mPageTable, split,
                              row_tile)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(tidx % WG_THREADS, wg_idx - 1, sQ, sK, sV, sPs, sO, sRow, pipe_q, pipe_k,
                          hands, tiled_mma_qk, tiled_mma_pv, tma_o, mO, mLSE, split,
                          scale * LOG2E, heads, rows, row_tile, out_idx)

    @cute.jit
    def _produce(self, tma_q, mQ, tma_k, mK, sQ, sK, pipe_q, pipe_k, mPageTable, split, row_tile):
        """One warp: the Q tile, then the split's pages in order."""
        gQ = cute.local_tile(mQ[None, None, split.sequence], (ROWS, HEAD_DIM), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(mK, 0, 2))
        sequence, first_page, tiles = split.sequence, split.first_page, split.tiles
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ[None, row_tile], tQsQ[None, 0],
                  tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        for j in cutlass.range(tiles, unroll=1):
            # A page id outside the pool is a TMA box out of bounds: zeros.
            page = mPageTable[sequence, first_page + j]
            pipe_k.producer_acquire(kv_state)
            cute.copy(tma_k, tKgK[None, page], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
            kv_state.advance()

    @cute.jit
    def _consume(self, tid, wg, sQ, sK, sV, sPs, sO, sRow, pipe_q, pipe_k, hands, tiled_mma_qk,
                 tiled_mma_pv, tma_o, mO, mLSE, split, scale_log2, heads, rows, row_tile, out_idx):
        """The seesaw over pairs of pages (a, b): consumer 0 computes S of a,
        consumer 1 S of b (each the whole page), and each multiplies both
        pages' P by its half of V, so that one's softmax runs under the
        other's products. Both end each pair with the same running maximum
        (consumer 1 continues from a's, consumer 0 adopts b's)."""
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ[None, None, 0]))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        # This warpgroup's 256 V columns: (256, 64 keys, stage).
        sV_wg = cute.flat_divide(sV, (V_COLS, PAGE))[None, None, wg, 0, None]
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV_wg))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sPs))
        tPsP = thr_qk.partition_C(sPs)
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((ROWS, V_COLS)))
        acc_O.fill(0.0)
        sO_wg = sO[None, None, wg]
        tOsO = thr_pv.partition_C(sO_wg)
        # Set once, outside control flow: S starts from a zero fill.
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((ROWS, PAGE)))
        acc_O_mn = wgmma_acc_as_rows_cols(acc_O)
        acc_S_mn = wgmma_acc_as_rows_cols(acc_S)
        tOcO = wgmma_acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((ROWS, V_COLS))))
        tScS = wgmma_acc_as_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((ROWS, PAGE))))
        num_rows = cute.size(tScS, mode=[0])
        row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        factor = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        tile_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # The last split-local key each of this thread's rows sees.
        last_key = cute.make_rmem_tensor(num_rows, cutlass.Int32)
        for r in cutlass.range_constexpr(num_rows):
            token = (row_tile * ROWS + tScS[r, 0][0]) // heads
            last_key[r] = cutlass.min(split.diagonal + token, split.kv_len - 1)
        # Keys up to this one are seen by every query row.
        shared_keys = cutlass.min(split.diagonal, split.kv_len - 1)
        rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
        sMaxima = sRow[None, 1]

        kv_len, tiles = split.kv_len, split.tiles
        pipe_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        page_a, page_b, give, take = seesaw_states()
        # Every pair hands page a over, and page b unless it is a last pair of one page.
        hand_a, hand_b = hands
        products = (tiled_mma_pv, acc_O, acc_O_mn, tOrP, tOrV, tOcO, sV_wg)
        for i in cutlass.range(cute.ceil_div(tiles, 2), unroll=1):
            first_a = 2 * i * PAGE
            first_b = first_a + PAGE
            has_b = first_b < kv_len
            partial_a = first_a + PAGE - 1 > shared_keys
            partial_b = first_b + PAGE - 1 > shared_keys
            if wg == 0:
                pipe_k.consumer_wait(page_a)
                self._scores(tSrQ, tSrK, tiled_mma_qk, acc_S, acc_S_mn, tScS, tile_max, 0,
                             first_a, partial_a, last_key)
                for r in cutlass.range_constexpr(num_rows):
                    update_row(acc_S_mn, r, tile_max[r], row_max, row_sum, factor, scale_log2,
                               True, 1)
                self._publish(acc_S, rP, tPsP, 0, row_max, sMaxima, tScS, tid, hand_a, give)
                self._page_product(products, factor, 0, first_a, partial_a, tid, wg, last_key,
                                   shared_keys, kv_len)
                if has_b:
                    pipe_k.consumer_wait(page_b)
                    self._adopt_max(sMaxima, 1, tScS, row_max, row_sum, factor, scale_log2,
                                    hand_b, take)
            else:
                if has_b:
                    pipe_k.consumer_wait(page_b)
                    self._scores(tSrQ, tSrK, tiled_mma_qk, acc_S, acc_S_mn, tScS, tile_max, 1,
                                 first_b, partial_b, last_key)
                pipe_k.consumer_wait(page_a)
                self._adopt_max(sMaxima, 0, tScS, row_max, row_sum, factor, scale_log2, hand_a,
                                take)
                self._page_product(products, factor, 0, first_a, partial_a, tid, wg, last_key,
                                   shared_keys, kv_len)
                if has_b:
                    for r in cutlass.range_constexpr(num_rows):
                        update_row(acc_S_mn, r, tile_max[r], row_max, row_sum, factor,
                                   scale_log2, True, 1)
                    self._publish(acc_S, rP, tPsP, 1, row_max, sMaxima, tScS, tid, hand_b, give)
            # Both consumers: page a's product done, then page b's (factor:
            # from page a's maxima to page b's).
            warpgroup.wait_group(0)
            pipe_k.consumer_release(page_a)
            if has_b:
                self._page_product(products, factor, 1, first_b, partial_b, tid, wg, last_key,
                                   shared_keys, kv_len)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(page_b)
            page_a.advance(KV_STAGES)
            page_b.advance(KV_STAGES)
            give.advance()
            take.advance()

        self._store(tid, wg, acc_O, acc_O_mn, tOsO, tScS, row_max, row_sum, scale_log2, sO_wg,
                    sRow[None, 0], tma_o, mO, mLSE, split, heads, rows, row_tile, out_idx)

    @cute.jit
    def _scores(self, tSrQ, tSrK, tiled_mma_qk, acc_S, acc_S_mn, tScS, tile_max, stage, first,
                partial, last_key):
        """S = Q K^T of the page in `stage` (its first split-local key
        `first`), keys a row does not see masked to -inf; its row maxima in
        tile_max."""
        acc_S.fill(0.0)
        issue_product(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, stage])
        warpgroup.wait_group(0)
        if partial:
            mask_unseen_keys(acc_S_mn, tScS, first, last_key)
        for r in cutlass.range_constexpr(cute.size(tile_max)):
            tile_max[r] = tile_row_max(acc_S_mn, r, 1)

    @cute.jit
    def _publish(self, acc_S, rP, tPsP, stage, row_max, sMaxima, tScS, tid, hand, give):
        """P (in the page's RoPE columns, which only its own S read) and the
        running maxima (sMaxima's half `stage`) to the other consumer,
        visible to its WGMMA."""
        hand.producer_acquire(give)
        store_converted(acc_S, rP)
        cute.autovec_copy(rP, tPsP[None, None, None, stage])
        for r in cutlass.range_constexpr(cute.size(row_max)):
            if tid % 4 == 0:
                sMaxima[stage * ROWS + tScS[r, 0][0]] = row_max[r]
        cute.arch.fence_proxy("async.shared", space="cta")
        hand.producer_commit(give)

    @cute.jit
    def _adopt_max(self, sMaxima, stage, tScS, row_max, row_sum, factor, scale_log2, hand, take):
        """Waits for the other consumer's page in `stage` and takes its
        running maxima: factor[r] is what this consumer's O and row sums are
        rescaled by (exactly 1 where the maximum did not move, 0 from -inf)."""
        hand.consumer_wait(take)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            new_max = sMaxima[stage * ROWS + tScS[r, 0][0]]
            factor[r] = cutlass.Float32(1.0)
            if new_max != -cutlass.Float32.inf:
                factor[r] = cute.arch.exp2((row_max[r] - new_max) * scale_log2)
            row_sum[r] = row_sum[r] * factor[r]
            row_max[r] = new_max
        hand.consumer_release(take)

    @cute.jit
    def _page_product(self, products, factor, stage, first, partial, tid, wg, last_key,
                      shared_keys, kv_len):
        """O rescaled by factor, then O += P V of the page in `stage` (this
        consumer's V columns; issued, not waited for), the values of a page
        with keys not every row sees cleaned first."""
        tiled_mma_pv, acc_O, acc_O_mn, tOrP, tOrV, tOcO, sV_wg = products
        rescale_rows(acc_O_mn, factor, True)
        if partial:
            self._clean_values(tid, wg, sV_wg, stage, acc_O_mn, tOcO, last_key, first,
                               shared_keys, kv_len)
        issue_product(tiled_mma_pv, acc_O, tOrP[None, None, None, stage],
                      tOrV[None, None, None, stage])

    @cute.jit
    def _exchange(self, values, op, tScS, sRow, wg, tid):
        """values[r] <- op(this warpgroup's, the other's) for each of the
        thread's rows: the same bits in both (op commutes), through sRow and
        one barrier of both consumers. The next exchange's writes come after
        another barrier of both, so none overwrites a value still unread."""
        for r in cutlass.range_constexpr(cute.size(values)):
            if tid % 4 == 0:
                sRow[wg * ROWS + tScS[r, 0][0]] = values[r]
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=CONSUMERS * WG_THREADS)
        for r in cutlass.range_constexpr(cute.size(values)):
            values[r] = op(values[r], sRow[(1 - wg) * ROWS + tScS[r, 0][0]])

    @cute.jit
    def _clean_values(self, tid, wg, sV_wg, stage, acc_O_mn, tOcO, last_key, first, shared_keys,
                      kv_len):
        """The V values of a tile's keys that not every row sees: a
        non-finite one makes the output column NaN for the rows that see its
        key, then it is zeroed in shared memory (as are the slots past the
        cache), so that P = 0 times it cannot reach the other rows. The
        page's S product has read the tile as K first; each consumer cleans
        its own columns."""
        band_end = cutlass.min(kv_len, first + PAGE)
        for key in cutlass.range(cutlass.max(shared_keys + 1, first), band_end, unroll=1):
            for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                if key <= last_key[r]:
                    for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                        if is_nonfinite(cutlass.Float32(sV_wg[tOcO[r, c][1], key - first, stage])):
                            acc_O_mn[r, c] = cutlass.Float32(math.nan)
        cute.arch.barrier(barrier_id=BAR_OWN + wg, number_of_threads=WG_THREADS)
        zero = self.dtype(0.0)
        band_start = cutlass.max(shared_keys + 1, first) - first
        for i in cutlass.range(tid, (PAGE - band_start) * V_COLS, WG_THREADS, unroll=1):
            key = band_start + i // V_COLS
            column = i % V_COLS
            if key + first >= kv_len:
                sV_wg[column, key, stage] = zero
            elif is_nonfinite(cutlass.Float32(sV_wg[column, key, stage])):
                sV_wg[column, key, stage] = zero
        # The generic-proxy writes must be visible to the WGMMA (async proxy).
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_OWN + wg, number_of_threads=WG_THREADS)

    @cute.jit
    def _store(self, tid, wg, acc_O, acc_O_mn, tOsO, tScS, row_max, row_sum, scale_log2, sO_wg,
               sRow, tma_o, mO, mLSE, split, heads, rows, row_tile, out_idx, unit=None):
        """O normalised (zeros for rows that see no key or are padding),
        the natural-log LSE (-inf for those rows; NaN for a row that saw a
        NaN logit), and O stored through shared memory with TMA. `unit`:
        per row, the unit O is held in (the FP8 kernel's P scale), if any."""
        num_rows = cute.size(acc_O_mn, mode=[0])
        totals = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(num_rows):
            totals[r] = quad_allreduce(row_sum[r], operator.add)
        # Each consumer summed the P of its own keys.
        self._exchange(totals, operator.add, tScS, sRow, wg, tid)
        for r in cutlass.range_constexpr(num_rows):
            total = totals[r]
            row = row_tile * ROWS + tScS[r, 0][0]
            seen = total != 0.0 and row // heads < split.q_len
            inv = cute.arch.rcp_approx(total)
            if cutlass.const_expr(unit is not None):
                inv = unit[r] * inv
            lse = -cutlass.Float32.inf
            if seen:
                lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * inv if seen else cutlass.Float32(0.0)
            if wg == 0 and tid % 4 == 0 and row < rows:
                mLSE[out_idx, row] = lse
        rO = cute.make_rmem_tensor(acc_O.layout, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # Both consumers must be done with the memory O overwrites (Q in
        # this kernel, the V tiles of the last P V product in the FP8 one).
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=CONSUMERS * WG_THREADS)
        cute.autovec_copy(rO, tOsO)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_OWN + wg, number_of_threads=WG_THREADS)
        if tid < 32:
            gO = cute.local_tile(mO[None, None, out_idx], (ROWS, V_COLS), (row_tile, wg))
            tOsO_tma, tOgO = cpasync.tma_partition(
                tma_o, 0, cute.make_layout(1), cute.group_modes(sO_wg, 0, 2),
                cute.group_modes(gO, 0, 2))
            cute.copy(tma_o, tOsO_tma, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


def hand_over_pipelines(barriers):
    """The seesaw's hand-overs from one consumer warpgroup to the other
    (mbarriers at `barriers`, two per pipeline: each thread's own writes are
    released by its own arrive): page a of each pair from consumer 0, page
    b from consumer 1."""
    consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, WG_THREADS)
    return [pipeline.PipelineAsync.create(
        barrier_storage=barriers + 2 * page, num_stages=1, producer_group=consumer,
        consumer_group=consumer, defer_sync=True) for page in range(2)]


def seesaw_states():
    """A consumer's pipeline states for the seesaw: the stages of a pair's
    pages (page a in stage 0, page b in stage 1: each advances by
    KV_STAGES per pair), and its side of the hand-overs (give, take)."""
    page_a = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
    page_b = page_a.clone()
    page_b.advance()
    give = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    take = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    return page_a, page_b, give, take


@cute.jit
def issue_product(tiled_mma, acc, tA, tB):
    """acc += A B over the K blocks of the fragments tA (values, M, K) and
    tB (values, N, K), issued as one WGMMA group, not waited for."""
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
    warpgroup.commit_group()


@cute.jit
def mask_unseen_keys(acc_S_mn, tScS, first, last_key):
    """S to -inf where a row does not see the key: the tile's keys start at
    split-local key `first`, row r sees up to last_key[r]."""
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            if first + tScS[r, c][1] > last_key[r]:
                acc_S_mn[r, c] = -cutlass.Float32.inf


class SplitProblem:
    """What a CTA reads, from its grid index: the sequence, its split's
    pages and keys, and where the causal diagonal sits in them."""

    def __init__(self, out_idx, mPageTable, mQLens, mKVLens, split_pages, s_q):
        splits = mPageTable.shape[1] // split_pages
        self.sequence = out_idx // splits
        self.first_page = out_idx % splits * split_pages
        first_key = self.first_page * PAGE
        total = cutlass.max(cutlass.min(mKVLens[self.sequence], mPageTable.shape[1] * PAGE), 0)
        self.q_len = cutlass.max(cutlass.min(mQLens[self.sequence], s_q), 0)
        self.kv_len = cutlass.max(cutlass.min(total - first_key, split_pages * PAGE), 0)
        self.tiles = cute.ceil_div(self.kv_len, PAGE)
        # Token t (of q_len new ones) sees split-local keys up to diagonal + t.
        self.diagonal = total - self.q_len - first_key
