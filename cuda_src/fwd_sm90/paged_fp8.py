"""The FP8 paged KV cache for the Hopper forward (FlashFwdSm90 with
paged_kv=True and fp8_cache=True; docs/fp8.md).

The pages hold float8_e4m3fn codes in the bf16 cache's layout and a float32
scale per token and kv head ([num_pages, heads_kv, page_size]). The
consumer warpgroups run the 16-bit paged kernel unchanged; two producer
warpgroups turn the cache into their 16-bit K / V stages:

* warp 0 streams each tile's codes and scales with TMA (PAGE_BOX keys from
  each page, as paged_kv does) into FP8 stages of their own, several tiles
  ahead, since a tile carries half the bytes of a 16-bit one;
* all eight warps dequantise a landed tile, value = code x scale rounded to
  Q's dtype, straight into the consumers' swizzled stage, then arrive on
  its barrier (one arrive per warp).

The conversion (about three instructions per value) bounds a decode step,
so two warpgroups share it (docs/fp8.md has the measurements).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from .kv_producer import WG_ROWS
from .paged_kv import PAGE_BOX, load_query_rows, page_of_box

FP8 = cutlass.Float8E4M3FN
CONVERT_WARPGROUPS = 2  # decode 0.70x the bf16 cache's; one 0.48x, three (640 threads) 0.65x
CONVERT_WARPS = 4 * CONVERT_WARPGROUPS
CONVERT_THREADS = 32 * CONVERT_WARPS
VECTOR = 8  # values per conversion step: 8 bytes of codes, 16 of output
SCALE_BOX = 32  # floats between the FP8 stages' boxes of PAGE_BOX scales (128 bytes)
LOADS_IN_FLIGHT = 4  # conversion steps loaded before any is converted (registers: PRODUCER_REGS)
# The producer warpgroups' setmaxnreg share: 2 x 128 x 96 + 2 x 128 x 160
# (the consumers, kernel.consumer_registers) == 64K.
PRODUCER_REGS = 96


def staging_layouts(tile_n: int, head_dim: int, head_dim_v: int, stages: int):
    """Plain row-major FP8 stages (key, column, stage) for K and V codes, and
    float32 scales (key in its box, box, stage): what TMA writes, read once
    by the conversion (a warp's 8-byte reads cover 256 contiguous bytes).
    A TMA box lands on a 128-byte boundary: a box of PAGE_BOX scales (64
    bytes) takes 128."""
    codes = lambda dim: cute.make_layout((tile_n, dim, stages), stride=(dim, 1, tile_n * dim))
    boxes = tile_n // PAGE_BOX
    scales = cute.make_layout((PAGE_BOX, boxes, stages), stride=(1, SCALE_BOX, boxes * SCALE_BOX))
    return codes(head_dim), codes(head_dim_v), scales


@dsl_user_op
def ld_shared_v2(addr, *, loc=None, ip=None):
    """8 bytes of shared memory as two 32-bit words."""
    words = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]), [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Uint32(llvm.extractvalue(T.i32(), words, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def st_shared_v4(addr, words, *, loc=None, ip=None):
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip)] + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def dequantize4(codes, scale, bf16: cutlass.Constexpr, *, loc=None, ip=None):
    """Four e4m3 codes (a 32-bit word, the first in the low byte) times a
    float32 scale, as two words of 16-bit pairs (bf16 or fp16, rounded to
    nearest). e4m3 -> f16 is exact, f16 -> f32 too; the product rounds once."""
    pack = "cvt.rn.bf16x2.f32" if bf16 else "cvt.rn.f16x2.f32"
    words = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        [Uint32(codes).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .b16 c0, c1;\n"
        ".reg .b32 h0, h1;\n"
        ".reg .b16 a0, a1, a2, a3;\n"
        ".reg .f32 f0, f1, f2, f3;\n"
        "mov.b32 {c0, c1}, $2;\n"
        "cvt.rn.f16x2.e4m3x2 h0, c0;\n"
        "cvt.rn.f16x2.e4m3x2 h1, c1;\n"
        "mov.b32 {a0, a1}, h0;\n"
        "mov.b32 {a2, a3}, h1;\n"
        "cvt.f32.f16 f0, a0;\n"
        "cvt.f32.f16 f1, a1;\n"
        "cvt.f32.f16 f2, a2;\n"
        "cvt.f32.f16 f3, a3;\n"
        "mul.rn.f32 f0, f0, $3;\n"
        "mul.rn.f32 f1, f1, $3;\n"
        "mul.rn.f32 f2, f2, $3;\n"
        "mul.rn.f32 f3, f3, $3;\n"
        f"{pack} $0, f1, f0;\n"
        f"{pack} $1, f3, f2;\n"
        "}",
        "=r,=r,r,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Uint32(llvm.extractvalue(T.i32(), words, [i], loc=loc, ip=ip)) for i in range(2))


def swizzled(byte_offset):
    """The 128-byte swizzle of the 16-bit stages (S<3,4,3> on byte offsets
    from a 1024-byte aligned base; kernel.py checks the layouts' swizzle)."""
    return byte_offset ^ ((byte_offset >> 3) & 0x70)


@cute.jit
def dequantize_tile(codes_base, scales, stage8, out_base, out_layout, stage, tidx, values_first: cutlass.Constexpr,
                    tile_n: cutlass.Constexpr, dim: cutlass.Constexpr, bf16: cutlass.Constexpr):
    """One K or V tile: codes (tile_n x dim bytes at codes_base, row-major)
    times their key's scale into the 16-bit stage `stage` of out_layout (the
    consumers' layout without its swizzle; (key, column, stage), or (column,
    key, stage) where values_first: V's). LOADS_IN_FLIGHT steps at a time:
    their loads first, so that their latencies overlap (one step after
    another, the conversion ran 2.3x slower than the bf16 cache's decode)."""
    steps = tile_n * dim // VECTOR // CONVERT_THREADS
    for first in cutlass.range_constexpr(0, steps, LOADS_IN_FLIGHT):
        loaded = []
        for i in cutlass.range_constexpr(first, min(first + LOADS_IN_FLIGHT, steps)):
            step = tidx + i * CONVERT_THREADS
            key = step // (dim // VECTOR)
            column = step % (dim // VECTOR) * VECTOR
            codes = ld_shared_v2(codes_base + key * dim + column)
            loaded.append((key, column, codes, scales[key % PAGE_BOX, key // PAGE_BOX, stage8]))
        for key, column, (low, high), scale in loaded:
            out = dequantize4(low, scale, bf16) + dequantize4(high, scale, bf16)
            coord = (column, key, stage) if values_first else (key, column, stage)
            st_shared_v4(out_base + swizzled(cute.crd2idx(coord, out_layout) * 2), out)


@cute.jit
def produce_paged_fp8(
    tma_q, mQ, sQ, pipe_q, cache, staging, k_layout, v_layout, bases, pipe_k, pipe_v, pipe8, mPageTable,
    problem, head_q, head_kv, wg_tile0, n_block_max, num_n_blocks, tidx,
    consumers: cutlass.Constexpr, kv_stages: cutlass.Constexpr, fp8_stages: cutlass.Constexpr,
    tile_n: cutlass.Constexpr, wg_rows: cutlass.Constexpr, bf16: cutlass.Constexpr,
):
    """The producer warpgroups of the FP8-cache kernel (module docstring).
    cache: (tma, tensor) of K codes, V codes, K scales, V scales; staging:
    their shared-memory stages and the codes' byte addresses; k_layout /
    v_layout and bases: the 16-bit K / V stages' layouts (unswizzled) and
    addresses."""
    (tma_k, mK), (tma_v, mV), (tma_ks, mKS), (tma_vs, mVS) = cache
    sK8, sV8, sKS, sVS, k8_base, v8_base = staging
    head_dim, head_dim_v = cute.size(sK8, mode=[1]), cute.size(sV8, mode=[1])
    warp = tidx // 32
    lookup = problem.page_lookup()
    # Global boxes: codes (PAGE_BOX, dim, box, 1, page), scales (PAGE_BOX, box, page).
    gK = cute.flat_divide(mK[None, None, head_kv, None], (PAGE_BOX, head_dim))
    gV = cute.flat_divide(mV[None, None, head_kv, None], (PAGE_BOX, head_dim_v))
    gKS = cute.flat_divide(mKS[None, head_kv, None], (PAGE_BOX,))
    gVS = cute.flat_divide(mVS[None, head_kv, None], (PAGE_BOX,))
    part = lambda tma, s, g, modes: cpasync.tma_partition(
        tma, 0, cute.make_layout(1), cute.group_modes(s, 0, modes), cute.group_modes(g, 0, modes))
    tKsK, tKgK = part(tma_k, cute.flat_divide(sK8, (PAGE_BOX, head_dim)), gK, 2)
    tVsV, tVgV = part(tma_v, cute.flat_divide(sV8, (PAGE_BOX, head_dim_v)), gV, 2)
    tSsK, tSgK = part(tma_ks, sKS, gKS, 1)
    tSsV, tSgV = part(tma_vs, sVS, gVS, 1)
    loads = (pipe8, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, tma_ks, tSgK, tSsK, tma_vs, tSgV, tSsV)
    boxes_of = lambda i: [page_of_box(mPageTable, lookup, (n_block_max - 1 - i) * tile_n + j * PAGE_BOX)
                          for j in range(tile_n // PAGE_BOX)]

    if warp == 0:
        load_query_rows(tma_q, mQ, sQ, pipe_q, head_q, problem.sequence, wg_tile0, consumers, wg_rows)

    issue_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, fp8_stages)
    if warp == 0:
        for i in cutlass.range(cutlass.min(num_n_blocks, fp8_stages), unroll=1):
            _issue(issue_state, boxes_of(i), *loads)
            issue_state.advance()
    read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, fp8_stages)
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, kv_stages)
    k_base, v_base = bases
    for i in cutlass.range(num_n_blocks, unroll=1):
        # The pages of the tile warp 0 loads after this one's conversion:
        # looked up now, so that the table's latency passes meanwhile.
        ahead = boxes_of(cutlass.min(i + fp8_stages, num_n_blocks - 1))
        pipe8.consumer_wait(read_state)
        s8 = read_state.index
        for codes_base, scales, out_base, out_layout, pipe, values_first, dim in (
                (k8_base, sKS, k_base, k_layout, pipe_k, False, head_dim),
                (v8_base, sVS, v_base, v_layout, pipe_v, True, head_dim_v)):
            pipe.sync_object_empty.wait(kv_state.index, kv_state.phase)
            dequantize_tile(codes_base + s8 * tile_n * dim, scales, s8, out_base, out_layout, kv_state.index,
                            tidx, values_first, tile_n, dim, bf16)
            # Generic-proxy stores, read by WGMMA (async proxy).
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()
            if tidx % 32 == 0:
                cute.arch.mbarrier_arrive(pipe.producer_get_barrier(kv_state))
        pipe8.consumer_release(read_state)
        read_state.advance()
        kv_state.advance()
        if warp == 0:
            if i + fp8_stages < num_n_blocks:
                _issue(issue_state, ahead, *loads)
                issue_state.advance()


def _issue(state, boxes, pipe8, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, tma_ks, tSgK, tSsK, tma_vs, tSgV, tSsV):
    """Warp 0: a tile's codes and scales into FP8 stage state.index, box by
    box from their pages ((page, box in page) each, page_of_box)."""
    pipe8.producer_acquire(state)
    bar = pipe8.producer_get_barrier(state)
    for j, (page, box) in enumerate(boxes):
        cute.copy(tma_k, tKgK[None, box, 0, page], tKsK[None, j, 0, state.index], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV[None, box, 0, page], tVsV[None, j, 0, state.index], tma_bar_ptr=bar)
        cute.copy(tma_ks, tSgK[None, box, page], tSsK[None, j, state.index], tma_bar_ptr=bar)
        cute.copy(tma_vs, tSgV[None, box, page], tSsV[None, j, state.index], tma_bar_ptr=bar)


class Fp8Cache:
    """FlashFwdSm90's FP8-cache entry point and the pieces its _launch and
    kernel take from here (they read head_dim(_v), tile_n, dtype and
    fp8_stages)."""

    @cute.jit
    def call_paged_fp8(
        self, mQ: cute.Tensor,
        mK: cute.Tensor,  # [num_pages, page_size, Nkv, H] e4m3 codes
        mV: cute.Tensor,  # [num_pages, page_size, Nkv, Hv] e4m3 codes
        mO: cute.Tensor, mLSE: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        scale: cutlass.Float32, softcap: cutlass.Float32, diag_offset: cutlass.Int32,
        window_left: cutlass.Int32, window_right: cutlass.Int32, stream: cuda.CUstream,
        mPageTable: cute.Tensor, split_pages: cutlass.Int32,
        mKScale: cute.Tensor,  # [num_pages, Nkv, page_size] float32
        mVScale: cute.Tensor,  # [num_pages, Nkv, page_size] float32
    ):
        """Entry point of the FP8-cache variant: call_paged's, the pages as
        codes, and their scales."""
        self._launch(mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
                     window_left, window_right, stream, None, None, None, None, mPageTable,
                     split_pages, scales=(mKScale, mVScale))

    def _fp8_cache_atoms(self, mK, mV, scales):
        """TMA atoms and tensors, flat, of the codes (PAGE_BOX-key boxes of
        one head) and of the scales (PAGE_BOX tokens)."""
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        k_codes, v_codes, _ = staging_layouts(PAGE_BOX, self.head_dim, self.head_dim_v, 1)
        atoms = []
        for pages, box in ((mK, k_codes), (mV, v_codes)):
            view = cute.make_tensor(pages.iterator, cute.select(pages.layout, mode=[1, 3, 2, 0]))
            atoms.append(cpasync.make_tiled_tma_atom(g2s, view, cute.slice_(box, (None, None, 0)),
                                                     (PAGE_BOX, cute.size(box, mode=[1]))))
        for per_token in scales:
            view = cute.make_tensor(per_token.iterator, cute.select(per_token.layout, mode=[2, 1, 0]))
            atoms.append(cpasync.make_tiled_tma_atom(g2s, view, cute.make_layout(PAGE_BOX), (PAGE_BOX,)))
        return [part for atom in atoms for part in atom]

    def _fp8_pipeline(self, storage, producer_group):
        """The FP8 stages' pipeline: warp 0's TMA fills them, the eight
        producer warps (one arrive each) empty them."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_8.data_ptr(), num_stages=self.fp8_stages,
            producer_group=producer_group,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERT_WARPS),
            tx_count=self._fp8_stage_bytes(), defer_sync=True,
        )

    @cute.jit
    def _produce_fp8_cache(self, tma_q, mQ, sQ, pipe_q, cache, storage, sK_layout, sV_layout, pipe_k, pipe_v,
                           pipe8, mPageTable, paged, head_q, head_kv, wg_tile0, n_block_max, num_n_blocks,
                           tidx):
        """The producer warpgroups' work (produce_paged_fp8) with this
        kernel's tiles; cache: the flat TMA atoms and tensors of
        _fp8_cache_atoms."""
        tma_k, mK, tma_v, mV, tma_ks, mKS, tma_vs, mVS = cache
        produce_paged_fp8(
            tma_q, mQ, sQ, pipe_q, ((tma_k, mK), (tma_v, mV), (tma_ks, mKS), (tma_vs, mVS)),
            self._fp8_staging(storage), sK_layout.outer, sV_layout.outer,
            (storage.sK.data_ptr().toint(), storage.sV.data_ptr().toint()), pipe_k, pipe_v,
            pipe8, mPageTable, paged, head_q, head_kv, wg_tile0, n_block_max, num_n_blocks, tidx,
            self.consumers, self.kv_stages, self.fp8_stages, self.tile_n, WG_ROWS,
            self.dtype is cutlass.BFloat16,
        )

    def _fp8_cache_fields(self):
        """The FP8 stages' shared memory and barriers (storage fields)."""
        k_codes, v_codes, scales = staging_layouts(self.tile_n, self.head_dim, self.head_dim_v, self.fp8_stages)
        aligned = lambda dtype, layout, align: cute.struct.Align[
            cute.struct.MemRange[dtype, cute.cosize(layout)], align]
        return {
            "mbar_8": cute.struct.MemRange[cutlass.Int64, 2 * self.fp8_stages],
            "sK8": aligned(FP8, k_codes, 1024),
            "sV8": aligned(FP8, v_codes, 1024),
            "sKS": aligned(Float32, scales, 128),
            "sVS": aligned(Float32, scales, 128),
        }

    def _fp8_stage_bytes(self):
        """What TMA writes into one FP8 stage (its tx count)."""
        return self.tile_n * (self.head_dim + self.head_dim_v + 2 * 4)

    def _fp8_smem_bytes(self):
        """The FP8 stages' shared memory, the scales' padding included."""
        return self.fp8_stages * (self.tile_n * (self.head_dim + self.head_dim_v)
                                  + 2 * self.tile_n // PAGE_BOX * SCALE_BOX * 4)

    @cute.jit
    def _fp8_staging(self, storage):
        """(sK8, sV8, sKS, sVS, K codes' address, V codes' address)."""
        k_codes, v_codes, scales = staging_layouts(self.tile_n, self.head_dim, self.head_dim_v, self.fp8_stages)
        return (storage.sK8.get_tensor(k_codes), storage.sV8.get_tensor(v_codes),
                storage.sKS.get_tensor(scales), storage.sVS.get_tensor(scales),
                storage.sK8.data_ptr().toint(), storage.sV8.data_ptr().toint())
