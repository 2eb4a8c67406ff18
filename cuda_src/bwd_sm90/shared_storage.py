"""Where the sm90 backward (kernel.py) keeps its tiles in shared memory: the
struct that places them, the tensors the kernel reads them through and the
TMA atoms that fill and drain them. TileConfig.smem_bytes (tile_config.py)
counts the same bytes."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from .warp_roles import NUM_WARPS
from .staggered import dq_half_layout, dq_half_shape
from .wgmma_views import stage_pair_views


def _buffer(dtype, cosize, used=True):
    # An unused one is empty and unaligned: 1024 bytes of alignment each
    # would not fit at hd256.
    return cute.struct.Align[cute.struct.MemRange[dtype, cosize], 1024] if used else cute.struct.MemRange[dtype, 0]


def shared_storage(dtype, m_block: int, stages: int, layouts: dict, dq_in_stage: bool, split: bool):
    """The SharedStorage struct for the tile layouts sQ, sdO, sK, sV, sdS and
    sdQ (`layouts`, by those names)."""

    @cute.struct
    class SharedStorage:
        pipe_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
        kv_bar: cute.struct.MemRange[cutlass.Int64, 1]
        # Per stage, nonzero where a query row's lse or delta is not finite
        # (nan_guard.py); in the padding before sStats at 2 stages.
        nan_flags: cute.struct.MemRange[Int32, stages]
        # lse * log2 e and delta of each stage's query rows (STATS_WARP).
        sStats: cute.struct.Align[cute.struct.MemRange[Float32, 2 * m_block * stages], 16]
        # dq_in_stage: sQ holds Q and dO of each stage side by side (no sdO,
        # no sdQ), the fp32 dQ tile's 4 M D bytes exactly.
        sQ: _buffer(dtype, (2 if dq_in_stage else 1) * cute.cosize(layouts["sQ"]))
        sdO: _buffer(dtype, cute.cosize(layouts["sdO"]), not dq_in_stage)
        sK: _buffer(dtype, cute.cosize(layouts["sK"]))
        sV: _buffer(dtype, cute.cosize(layouts["sV"]))
        sdS: _buffer(dtype, cute.cosize(layouts["sdS"]))
        sdQ: _buffer(Float32, cute.cosize(layouts["sdQ"]), not dq_in_stage)
        # Per-warp partial (min first, max last) of the keys' q_bounds.
        sSegRange: cute.struct.MemRange[Int32, 2 * NUM_WARPS]
        sP: _buffer(dtype, cute.cosize(layouts["sdS"]), split)

    return SharedStorage


def shared_tiles(storage, layouts: dict, dtype, m_block: int, stages: int, dq_in_stage: bool, dq_in_tiles: bool,
                 split: bool):
    """(sQ, sdO, sdQ, sStats, sK, sV, sdS, sP) of an allocated SharedStorage;
    sP is None without split_head_dim."""
    sdQ_layout = layouts["sdQ"]
    if dq_in_stage:
        sQ, sdO, sdQ = stage_pair_views(storage.sQ, layouts["sQ"], sdQ_layout, dtype, stages, dq_in_tiles)
    else:
        sQ = storage.sQ.get_tensor(layouts["sQ"].outer, swizzle=layouts["sQ"].inner)
        sdO = storage.sdO.get_tensor(layouts["sdO"].outer, swizzle=layouts["sdO"].inner)
    sStats = storage.sStats.get_tensor(cute.make_layout((m_block, 2, stages)))
    sK = storage.sK.get_tensor(layouts["sK"].outer, swizzle=layouts["sK"].inner)
    sV = storage.sV.get_tensor(layouts["sV"].outer, swizzle=layouts["sV"].inner)
    sdS = storage.sdS.get_tensor(layouts["sdS"].outer, swizzle=layouts["sdS"].inner)
    sP = None
    if split:
        sP = storage.sP.get_tensor(layouts["sdS"].outer, swizzle=layouts["sdS"].inner)
    if not dq_in_stage and dq_in_tiles:
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer)
    elif not dq_in_stage:
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
    return sQ, sdO, sdQ, sStats, sK, sV, sdS, sP


def _seq_major(t):
    """(batch, seqlen, heads, head_dim) -> (seqlen, head_dim, heads, batch),
    so that a (rows, cols) box tiles the first two modes; rows past seqlen
    read as zeros."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def load_tma_atoms(tensors, layouts, rows, cols):
    """(atom, TMA view) per tensor (Q, dO, K, V): stage 0 of its layout, boxes
    of (rows, cols)."""
    g2s = cpasync.CopyBulkTensorTileG2SOp()
    return tuple(
        cpasync.make_tiled_tma_atom(g2s, _seq_major(t), cute.slice_(layout, (None, None, 0)), (r, c))
        for t, layout, r, c in zip(tensors, layouts, rows, cols)
    )


def dq_tma_atoms(mdQ, sdQ_layout, m_block: int, head_dim: int, dq_in_tiles: bool, staggered: bool, deterministic: bool,
                 splits_queries: bool):
    """The dQ writer's (reduce-add atom, view, store atom, view) over
    dq_accum; the store pair only for the deterministic variant, whose first
    turn of each accumulator stores its tile instead of adding it (so that
    nobody zeroes dq_accum). Staggered (staggered.py): each WG's half of the
    tile is a box of its own."""
    M, D = m_block, head_dim
    if dq_in_tiles:
        # The launcher passes the tiles as [B x chains x Hq, tiles x M, 1]:
        # one (rows, D) view, tile t its rows t M on.
        rows = mdQ.shape[0] * mdQ.shape[1] * mdQ.shape[2]
        dq_view = cute.make_tensor(mdQ.iterator, cute.make_layout((rows, D), stride=(D, 1)))
        dq_smem = sdQ_layout.outer
    else:
        dq_view, dq_smem = _seq_major(mdQ), sdQ_layout
    dq_box = (M, D)
    if staggered:
        dq_box = dq_half_shape(M, D, splits_queries)
        dq_smem = dq_half_layout(M, D, splits_queries)
    tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), dq_view, dq_smem, dq_box)
    tma_atom_dQ_store, tma_dQ_store = None, None
    if deterministic:
        tma_atom_dQ_store, tma_dQ_store = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), dq_view, dq_smem, dq_box
        )
    return tma_atom_dQ, tma_dQ, tma_atom_dQ_store, tma_dQ_store
