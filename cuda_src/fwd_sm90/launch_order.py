"""Which (query tile, query head, batch) triple each forward CTA computes.

The GPU starts CTAs in the order of their linear block index. Under a
causal-like mask (the right edge of the window bounded) query tiles differ
in length: the last one of a head visits every KV tile, the first one a
single tile. Launched head after head, each head's longest tiles first, the
last head's longest tile starts near the end of the grid and runs alone
while the other multiprocessors idle; a greedy-schedule model puts that tail
at 5-7% of a causal grid from 1k to 8k rows (16 heads, 16k tokens).

Launching every head's longest tile before any shorter one removes the tail
but spreads the CTAs in flight over all heads, whose K / V then compete for
L2. So the heads go in sections that fit an L2 budget, each section longest
tile first; the first section takes the remainder, so that the last one has
enough short tiles to end the grid evenly.
"""

import cutlass
import cutlass.cute as cute

# Problems shorter than MIN_ROWS keep the plain order (head after head),
# where the sectioned one lost (docs/kernel-evidence.md).
# The K / V bytes of the heads in one section: about half of an H100's L2;
# a smaller budget gained less.
L2_BUDGET_BYTES = 24 * 2**20
MIN_ROWS = 2048


@cute.jit
def tile_of_cta(m_blocks, seqlen_q, window_right, heads_q, heads_kv, batches, seqlen_k,
                kv_row_bytes: cutlass.Constexpr):
    """(reversed query tile, query head, batch) of this CTA: head after head
    but for a causal-like problem of at least MIN_ROWS rows, which runs in
    the sectioned longest-first order; kv_row_bytes: the bytes of one key's
    K and V row. A section's query heads are consecutive, so that they share
    kv heads."""
    x, y, z = cute.arch.block_idx()
    if window_right >= 0 and seqlen_q >= MIN_ROWS:
        heads = heads_q * batches
        linear = x + m_blocks * (y + heads_q * z)
        kv_heads_fit = cutlass.max((L2_BUDGET_BYTES // kv_row_bytes) // cutlass.max(seqlen_k, 1), 1)
        size = cutlass.min(kv_heads_fit * (heads_q // heads_kv), heads)
        first = heads - (cute.ceil_div(heads, size) - 1) * size
        head0, within, width = cutlass.Int32(0), linear, first
        if linear >= first * m_blocks:
            rest = linear - first * m_blocks
            head0 = first + rest // (size * m_blocks) * size
            within = rest % (size * m_blocks)
            width = size
        head = head0 + within % width
        x, y, z = within // width, head % heads_q, head // heads_q
    return cute.arch.make_warp_uniform(x), cute.arch.make_warp_uniform(y), cute.arch.make_warp_uniform(z)
