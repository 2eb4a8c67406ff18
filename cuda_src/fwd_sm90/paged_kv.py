"""K / V from a paged cache for the Hopper forward (FlashFwdSm90 with
paged_kv=True).

The cache holds pages of PAGE_BOX-aligned token rows, [num_pages,
page_size, heads_kv, head_dim]: the same 4-D layout as a contiguous K, with
pages in place of batch entries, so the kernel's TMA view of it is the plain
one. A K / V tile of tile_n keys is filled by tile_n / PAGE_BOX boxes, each
from the page that the page table names for its keys; page sizes are any
multiple of PAGE_BOX, so one build serves them all. Pages of a multiple of
LARGE_BOX keys fill it in fewer, larger boxes (a choice made at run time).

A CTA serves one (sequence, split) pair: splits of a fixed number of keys,
split_pages pages each, so that a sequence's partial results never depend on
the other sequences of the batch (the caller merges them in a fixed order).
Keys are numbered from the split's first; the queries sit at the end of
their sequence, so the causal diagonal is per sequence.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

# Rows of one TMA box: the smallest page size served. A multiple of the
# 8-row swizzle atom, so every box of a tile starts on an atom boundary.
PAGE_BOX = 16
# Rows of the boxes for page sizes it divides, where it divides tile_n: a
# tile in 2 boxes instead of 8 ran chunked prefill (2048 x 64k keys, one
# split, page 64, hd128, H200) at 0.99x the contiguous kernel, against 0.90x.
LARGE_BOX = 64


class PagedCall:
    """FlashFwdSm90's paged entry point."""

    @cute.jit
    def call_paged(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
        mLSE: cute.Tensor, mQLens: cute.Tensor, mKVLens: cute.Tensor,
        scale: cutlass.Float32, softcap: cutlass.Float32, diag_offset: cutlass.Int32,
        window_left: cutlass.Int32, window_right: cutlass.Int32, stream: cuda.CUstream,
        mPageTable: cute.Tensor,  # [B, splits * split_pages] int32
        split_pages: cutlass.Int32,
    ):
        """Entry point of the paged variant (paged_kv.py): mK / mV are
        [num_pages, page_size, Nkv, H] pages, mKVLens the cache lengths, mO /
        mLSE hold one partial result per (sequence, split): [B * splits, ...].
        The mask's diagonal is diag_offset from each sequence's bottom right.
        No sinks: the caller merges the splits and adds them."""
        self._launch(mQ, mK, mV, mO, mLSE, mQLens, mKVLens, scale, softcap, diag_offset,
                     window_left, window_right, stream, None, None, None, None, mPageTable,
                     split_pages)


class PagedProblem:
    """What one CTA of the paged kernel reads, from its grid index: the
    sequence (its Q rows and page table row), the split and its keys, and
    the mask geometry of that split."""

    def __init__(self, out_batch, mQLens, mKVLens, mPageTable, split_pages, page_size, seqlen_q,
                 diag_offset):
        splits = mPageTable.shape[1] // split_pages
        self.sequence = out_batch // splits
        self.split_pages = split_pages
        self.page_size = page_size
        self.split_keys = split_pages * page_size
        self.first_page = out_batch % splits * split_pages
        first_key = self.first_page * page_size
        total = cutlass.max(cutlass.min(mKVLens[self.sequence], mPageTable.shape[1] * page_size), 0)
        self.q_len = cutlass.max(cutlass.min(mQLens[self.sequence], seqlen_q), 0)
        self.kv_len = cutlass.max(cutlass.min(total - first_key, self.split_keys), 0)
        # The last query of the sequence is its last key: bottom-right.
        self.diag_offset = diag_offset + total - self.q_len - first_key
        # Boxes past the cache read its last page (masked, their V zeroed in
        # shared memory: value_check.py): the page table need not name a page
        # there.
        self.last_page = cutlass.max(cute.ceil_div(total, page_size) - 1 - self.first_page, 0)

    def page_lookup(self):
        """What the producer's loop needs to find a key's page, as runtime
        values (a DSL loop cannot carry this object)."""
        return self.sequence, self.first_page, self.last_page, self.page_size


def page_of_box(mPageTable, lookup, key, box_rows=PAGE_BOX):
    """(page, box within the page) holding split key `key`; lookup:
    PagedProblem.page_lookup()."""
    sequence, first_page, last_page, page_size = lookup
    slot = cutlass.min(key // page_size, last_page)
    return mPageTable[sequence, first_page + slot], key % page_size // box_rows


def slab_layouts(sK_stage, sV_stage, head_dim, head_dim_v, box_rows=PAGE_BOX):
    """The shared-memory layouts of one box_rows-key slab of a K stage and
    of a V stage (the TMA boxes' destinations)."""
    rows = lambda n: cute.make_layout(n)
    return (cute.composition(sK_stage, (rows(box_rows), rows(head_dim))),
            cute.composition(sV_stage, (rows(head_dim_v), rows(box_rows))))


def slabs(sK, sV, head_dim, head_dim_v, box_rows=PAGE_BOX):
    """The K and V stages cut into box_rows-key slabs:
    K (box_rows, head_dim, slab, 1, stage), V (head_dim_v, box_rows, 1, slab, stage)."""
    return cute.flat_divide(sK, (box_rows, head_dim)), cute.flat_divide(sV, (head_dim_v, box_rows))


def large_box_atoms(g2s, mK, mV, sK_stage, sV_stage, head_dim, head_dim_v):
    """TMA atoms (and their views) of LARGE_BOX-key K and V boxes, from
    the kernel's TMA views of the pages."""
    sK_box, sV_box = slab_layouts(sK_stage, sV_stage, head_dim, head_dim_v, LARGE_BOX)
    tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, sK_box, (LARGE_BOX, head_dim))
    tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s, mV, sV_box, (head_dim_v, LARGE_BOX))
    return tma_k, mK_tma, tma_v, mV_tma


@cute.jit
def load_query_rows(tma_q, mQ, sQ, pipe_q, head_q, sequence, wg_tile0, consumers: cutlass.Constexpr,
                    wg_rows: cutlass.Constexpr):
    """One producer warp: each consumer's Q rows of `sequence`, on barriers
    of their own."""
    gQ = cute.local_tile(mQ[None, None, head_q, sequence], (wg_rows, cute.size(sQ, mode=[1])), (None, 0))
    tQsQ, tQgQ = cpasync.tma_partition(
        tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, consumers)
    for w in cutlass.range_constexpr(consumers):
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ[None, cutlass.max(wg_tile0 + w, 0)], tQsQ[None, w],
                  tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()


@cute.jit
def produce_paged(
    tma_q, mQ, small_boxes, large_boxes, sQ, sK, sV, pipe_q, pipe_k, pipe_v, mPageTable,
    problem: PagedProblem, head_q, head_kv, wg_tile0, n_block_max, num_n_blocks,
    consumers: cutlass.Constexpr, kv_stages: cutlass.Constexpr, tile_n: cutlass.Constexpr,
    wg_rows: cutlass.Constexpr,
):
    """The producer warp of the paged kernel: each consumer's Q rows once,
    then K(n) and V(n) for n = n_block_max - 1 down, box by box from their
    pages. small_boxes / large_boxes: (tma_k, mK, tma_v, mV) of PAGE_BOX- and
    LARGE_BOX-key boxes, the latter's atoms None where tile_n is no multiple
    of LARGE_BOX."""
    load_query_rows(tma_q, mQ, sQ, pipe_q, head_q, problem.sequence, wg_tile0, consumers, wg_rows)
    tiles = (mPageTable, problem.page_lookup(), head_kv, n_block_max, num_n_blocks, sK, sV, pipe_k,
             pipe_v, kv_stages, tile_n)
    if cutlass.const_expr(large_boxes[0] is None):
        stream_tiles(*small_boxes, PAGE_BOX, *tiles)
    else:
        if problem.page_size % LARGE_BOX == 0:
            stream_tiles(*large_boxes, LARGE_BOX, *tiles)
        else:
            stream_tiles(*small_boxes, PAGE_BOX, *tiles)


@cute.jit
def stream_tiles(
    tma_k, mK, tma_v, mV, box_rows: cutlass.Constexpr, mPageTable, lookup, head_kv, n_block_max,
    num_n_blocks, sK, sV, pipe_k, pipe_v, kv_stages: cutlass.Constexpr, tile_n: cutlass.Constexpr,
):
    """K(n) and V(n) for n = n_block_max - 1 down, in box_rows-key boxes."""
    head_dim, head_dim_v = cute.size(sK, mode=[1]), cute.size(sV, mode=[0])
    # Global boxes: K (box_rows, head_dim, box, 1, page), V (head_dim_v, box_rows, 1, box, page).
    gK = cute.flat_divide(mK[None, None, head_kv, None], (box_rows, head_dim))
    gV = cute.flat_divide(mV[None, None, head_kv, None], (head_dim_v, box_rows))
    sK_slabs, sV_slabs = slabs(sK, sV, head_dim, head_dim_v, box_rows)
    tKsK, tKgK = cpasync.tma_partition(
        tma_k, 0, cute.make_layout(1), cute.group_modes(sK_slabs, 0, 2), cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(
        tma_v, 0, cute.make_layout(1), cute.group_modes(sV_slabs, 0, 2), cute.group_modes(gV, 0, 2))
    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, kv_stages)
    for i in cutlass.range(num_n_blocks, unroll=1):
        n_start = (n_block_max - 1 - i) * tile_n
        boxes = [page_of_box(mPageTable, lookup, n_start + j * box_rows, box_rows)
                 for j in range(tile_n // box_rows)]
        pipe_k.producer_acquire(kv_state)
        for j in cutlass.range_constexpr(len(boxes)):
            page, box = boxes[j]
            cute.copy(tma_k, tKgK[None, box, 0, page], tKsK[None, j, 0, kv_state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
        pipe_v.producer_acquire(kv_state)
        for j in cutlass.range_constexpr(len(boxes)):
            page, box = boxes[j]
            cute.copy(tma_v, tVgV[None, 0, box, page], tVsV[None, 0, j, kv_state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
        kv_state.advance()
