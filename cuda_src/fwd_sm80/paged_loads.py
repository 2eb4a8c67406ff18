"""K / V from a paged cache for the sm80 forward (FlashFwdSm80 with
paged_kv=True), filled with cp.async.

The cache holds pages [num_pages, page_size, heads_kv, head_dim]; a page
table row names a sequence's pages in order (kernel_api.h: JfPagedFwdArgs).
Each copy row of a K / V tile is one key: the thread looks its page up in
the table and copies from that page's row, so any page size serves, and the
offsets are 64-bit (the strides of the pool are: a pool may hold more than
2^31 elements).

A CTA serves one (sequence, split) pair: splits of split_pages pages, so
that a sequence's partial results never depend on the other sequences of
the batch (the caller merges them in a fixed order). Keys are numbered from
the split's first; the queries sit at the end of their sequence, so the
causal diagonal is per sequence. The Hopper kernel derives the same values
(cuda_src/fwd_sm90/paged_kv.py: PagedProblem).
"""

import cutlass
import cutlass.cute as cute


class PagedSplit:
    """What one CTA of the paged kernel reads, from its grid index: the
    sequence (its Q rows and page table row), the split's first page and
    keys, and the mask geometry of that split."""

    def __init__(self, out_batch, mQLens, mKVLens, mPageTable, split_pages, page_size, seqlen_q,
                 diag_offset):
        splits = mPageTable.shape[1] // split_pages
        self.sequence = out_batch // splits
        self.first_page = out_batch % splits * split_pages
        self.split_keys = split_pages * page_size
        first_key = self.first_page * page_size
        total = cutlass.max(cutlass.min(mKVLens[self.sequence], mPageTable.shape[1] * page_size), 0)
        self.q_len = cutlass.max(cutlass.min(mQLens[self.sequence], seqlen_q), 0)
        self.kv_len = cutlass.max(cutlass.min(total - first_key, self.split_keys), 0)
        # The last query of the sequence is its last key: bottom-right.
        self.diag_offset = diag_offset + total - self.q_len - first_key


def zero_row_stride_view(mX, head_kv, rows, head_dim):
    """A (rows, head_dim) view of the pool whose rows all start at element 0
    of kv head head_kv: partitioned by the tile copy, it gives each copy
    row's columns (the same for every row), to which load_paged_tile adds
    the row's own offset."""
    base = mX.iterator + cute.crd2idx((0, 0, head_kv, 0), mX.layout)
    return cute.make_tensor(base, cute.make_layout((rows, head_dim), stride=(0, 1)))


@cute.jit
def load_paged_tile(
    tiled_copy: cute.TiledCopy,
    mX: cute.Tensor,
    tXgCols: cute.Tensor,
    tXsX: cute.Tensor,
    tXcX: cute.Tensor,
    mPageTable: cute.Tensor,
    sequence: cutlass.Int32,
    first_page: cutlass.Int32,
    n_start: cutlass.Int32,
    rows_end: cutlass.Int32,
):
    """cp.async one K or V tile of split keys [n_start, n_start + tile):
    each copy row from the page that the table names for its key. Rows from
    rows_end on, and rows whose page id lies outside the pool, become zeros
    in shared memory (a masked probability meets V's; nothing reads past
    the pool). tXgCols: zero_row_stride_view partitioned like tXsX."""
    page_size = mX.shape[1]
    num_pages = mX.shape[0]
    for r in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        key = n_start + tXcX[0, r, 0][0]
        page = cutlass.Int32(-1)
        if key < rows_end:
            page = mPageTable[sequence, first_page + key // page_size]
        if page >= 0 and page < num_pages:
            row = cute.crd2idx((page, key % page_size, 0, 0), mX.layout)
            cols = tXgCols[None, r, None]
            src = cute.make_tensor(cols.iterator + row, cols.layout)
            cute.copy(tiled_copy, src, tXsX[None, r, None])
        else:
            tXsX[None, r, None].fill(0)
