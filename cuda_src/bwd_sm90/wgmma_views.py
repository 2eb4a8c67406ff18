"""How the sm90 backward (kernel.py) hands operands to WGMMA: shared tiles
read through transposed views of the same bytes, 16-bit copies of
accumulators reused as register A operands, and the issue of one GEMM as a
WGMMA group."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from ..common.dsl_common import wgmma_acc_as_operand_a
from .warp_roles import NUM_MMA_WG

WGMMA_M = 64  # rows of one warpgroup's WGMMA


def tiled_mma(dtype, a_major, b_major, atoms, tile_n: int, a_source=warpgroup.OperandSource.SMEM):
    """fp32-accumulating WGMMAs of (WGMMA_M, tile_n) per warpgroup, laid out
    over the consumer WGs by `atoms`."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, cutlass.Float32, atoms, (WGMMA_M, tile_n), a_source
    )


def key_rows_mma(dtype, cols: int, split: bool):
    """dK += dS^T Q or dV += P^T dO for `cols` columns of dK or dV: the WGs
    split the columns (TileConfig.split_head_dim), else the keys, with the A
    operand (P^T, dS^T) from registers."""
    K_MAJOR, MN_MAJOR = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
    if split:
        return tiled_mma(dtype, K_MAJOR, MN_MAJOR, (1, NUM_MMA_WG, 1), cols // NUM_MMA_WG)
    return tiled_mma(dtype, K_MAJOR, MN_MAJOR, (NUM_MMA_WG, 1, 1), cols, warpgroup.OperandSource.RMEM)


def smem_tile_layout(dtype, rows: int, cols: int, stages: int, major_size: int):
    """Row-major (rows, cols, stages) tile of WGMMA swizzle atoms.

    The same bytes serve K-major reads (cols is the reduction dim) and
    MN-major reads of the transposed view, so the atom width must divide
    the widest per-WG slice of `cols` any GEMM reads: `major_size` (80 query
    rows of 16 bits, 160 bytes, admit only the 32-byte swizzle).
    """
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_size)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def dq_tile_layout(rows: int, cols: int, major_size: int, in_tiles: bool):
    """The fp32 dQ tile. dQ^T (not in_tiles): swizzled so that the
    accumulator's row pairs land in distinct banks; the TMA reads it back box
    by box (major_size wide). dQ in tiles: plain rows x cols floats, written
    in fragment order (store_dq_fragments) and added as one box to a block
    of dq_accum laid out the same way."""
    if in_tiles:
        return cute.make_composed_layout(
            cute.make_swizzle(0, 4, 3), 0, cute.make_layout((rows, cols), stride=(cols, 1))
        )
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float32, major_size)
    atom = warpgroup.make_smem_layout_atom(kind, cutlass.Float32)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


@cute.jit
def store_dq_fragments(acc: cute.Tensor, tile: cute.Pointer, wg, warp, lane):
    """dQ in tiles: this thread's fp32 accumulator of dQ = dS K (64 query
    rows by head_dim / 2 columns per WG) into the fp32 tile at `tile` in
    fragment order. Each (WG, warp) owns 32 x size(acc) floats, in which the
    value pair p of lane l lies at 64 p + 2 l: a warp's 8-byte stores of one
    pair fill 256 contiguous bytes, free of bank conflicts (the swizzled
    (rows, cols) tile took two wavefronts per store; tile_config.py).
    jax_flash/_ffi.py reads the element order back: pair p = h + 2 j holds
    rows 16 warp + 8 h + l / 4, columns wg head_dim / 2 + 8 j + 2 (l % 4) + 0, 1."""
    pairs = cute.size(acc) // 2
    block = (wg * 4 + warp) * pairs * 64 + lane * 2
    dst = cute.make_tensor((tile + block).align(8), cute.make_layout((2, pairs), stride=(1, 64)))
    src = cute.make_tensor(acc.iterator, cute.make_layout((2, pairs), stride=(1, 2)))
    cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=64), src, dst)


def stage_accumulator(acc, copy_atom, mma, dst, tidx, dtype, scale=None):
    """acc (times scale), converted to dtype, into stage 0 of the shared tile
    dst, through copy_atom in the accumulator layout of mma."""
    r2s = cute.make_tiled_copy_C(copy_atom, mma)
    thr = r2s.get_slice(tidx)
    if scale is not None:
        acc.store(acc.load() * scale)
    frag = cute.make_fragment_like(acc, dtype)
    frag.store(acc.load().to(dtype))
    cute.copy(r2s, thr.retile(frag), thr.partition_D(dst)[None, None, None, 0])


def transposed(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols[, stages]) -> (cols, rows[, stages]) view of the same bytes."""
    rest = tuple(range(2, cute.rank(t)))
    shape = (t.shape[1], t.shape[0], *(t.shape[i] for i in rest))
    return cute.composition(t, cute.make_ordered_layout(shape, order=(1, 0, *rest)))


def as_operand_a(frag: cute.Tensor) -> cute.Tensor:
    """A 16-bit copy of a key-major accumulator (P^T, dS^T) as the A operand
    of dV / dK."""
    return cute.make_tensor(frag.iterator, wgmma_acc_as_operand_a(frag.layout))


@cute.jit
def issue_wgmma(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr):
    """Issue acc (+)= A B as one WGMMA group (not waited on)."""
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not zero_init or k != 0)
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
    warpgroup.commit_group()


def stage_pair_views(buffer, sQ_layout, sdQ_layout, dtype, stages: int, dq_in_tiles: bool):
    """(sQ, sdO, sdQ) for TileConfig.dq_in_stage: Q and dO of each stage side
    by side in `buffer` (so sdO shares sQ's layout: V is as wide as Q there),
    and each stage's fp32 (M, D) dQ tile over its Q / dO pair, from Q[s]
    (unswizzled for dQ in tiles)."""
    stage = cute.cosize(cute.slice_(sQ_layout, (None, None, 0)))
    outer = sQ_layout.outer
    # The stage mode is (1, stages) after tile_to_shape.
    paired = cute.make_layout(outer.shape, stride=(outer.stride[0], outer.stride[1], (outer.stride[2][0], 2 * stage)))
    sQ = buffer.get_tensor(paired, swizzle=sQ_layout.inner)
    sdO = cute.make_tensor(cute.recast_ptr(buffer.data_ptr() + stage, sQ_layout.inner, dtype=dtype), paired)
    dq = sdQ_layout.outer
    staged = cute.make_layout((*dq.shape, stages), stride=(*dq.stride, cute.cosize(dq)))
    if dq_in_tiles:
        return sQ, sdO, buffer.get_tensor(staged, dtype=cutlass.Float32)
    return sQ, sdO, buffer.get_tensor(staged, swizzle=sdQ_layout.inner, dtype=cutlass.Float32)
