"""Which tile each CTA of a causal-like grid computes: longest first within
sections of heads.

The GPU starts CTAs in the order of their linear block index. Under a
causal-like mask the tiles of a head differ in length: the forward's last
query tile visits every KV tile and its first one a single tile; in the
backward it is the other way round, the first KV tile meets every query tile.
Launched head after head, each head's longest tile first, the last head's
longest tile starts near the end of the grid and runs alone while the other
multiprocessors idle; a greedy-schedule model puts that tail at 5-7% of a
causal grid from 1k to 8k rows (16 heads, 16k tokens), forward and backward.

Launching every head's longest tile before any shorter one removes the tail
but spreads the CTAs in flight over all heads, whose operands then compete
for L2. So the heads go in sections whose streamed operands fit an L2
budget, each section longest tile first; the first section takes the
remainder, so that the last one has enough short tiles to end the grid
evenly.
"""

import cutlass
import cutlass.cute as cute

# H100, bf16, 16 heads, 16k tokens, causal forward TFLOPS (results run 89;
# the build before timed first and last):
#   seq        2k            4k            8k            16k
#   hd64   345 / 348-349  429 / 402-409  477 / 449     504 / 476
#   hd128  456 / 457-481  546 / 538-544  599 / 587-608 653 / 650-656
#   hd256  544 / 530      620 / 595-596  664 / 650-657 734 / 735-736
# At 1k it lost (run 88: hd64 273 against 285-288, hd128 334 against
# 357-365), so shorter forward problems keep the plain order (head after
# head), and an 8 MB budget gained less (run 89: hd64 4k-16k 418 / 472 /
# 483, hd256 4k 589).
# The bytes the heads of one section stream: about half of an H100's L2.
L2_BUDGET_BYTES = 24 * 2**20
FWD_MIN_ROWS = 2048
BWD_MIN_ROWS = 1024


@cute.jit
def sectioned_longest_first(x, y, z, tiles, heads, batches, rows_fit, rows_per_head, heads_per_unit):
    """(tile, head, batch) of the CTA at block (x, y, z) of a grid of
    (tiles, heads, batches) whose tile 0 is each head's longest. The heads
    (batch-major, so that a section may span batch entries) run in sections
    of as many units of heads_per_unit heads as fit rows_fit rows of the
    budget at rows_per_head rows each (at least one unit); the first section
    takes the remainder. Within a section the tile 0s of all its heads go
    first, then their tile 1s, and so on."""
    all_heads = heads * batches
    linear = x + tiles * (y + heads * z)
    units_fit = cutlass.max(rows_fit // cutlass.max(rows_per_head, 1), 1)
    size = cutlass.min(units_fit * heads_per_unit, all_heads)
    first = all_heads - (cute.ceil_div(all_heads, size) - 1) * size
    head0, within, width = cutlass.Int32(0), linear, first
    if linear >= first * tiles:
        rest = linear - first * tiles
        head0 = first + rest // (size * tiles) * size
        within = rest % (size * tiles)
        width = size
    head = head0 + within % width
    return within // width, head % heads, head // heads


@cute.jit
def fwd_tile_of_cta(m_blocks, seqlen_q, window_right, heads_q, heads_kv, batches, seqlen_k,
                    kv_row_bytes: cutlass.Constexpr):
    """(reversed query tile, query head, batch) of a forward CTA: head after
    head but for a causal-like problem of at least FWD_MIN_ROWS rows, whose
    sections hold the query heads of as many kv heads as fit the budget with
    their K and V (kv_row_bytes: one key's K and V row), so that a section's
    query heads share kv heads."""
    x, y, z = cute.arch.block_idx()
    if window_right >= 0 and seqlen_q >= FWD_MIN_ROWS:
        x, y, z = sectioned_longest_first(x, y, z, m_blocks, heads_q, batches, L2_BUDGET_BYTES // kv_row_bytes,
                                          seqlen_k, heads_q // heads_kv)
    return cute.arch.make_warp_uniform(x), cute.arch.make_warp_uniform(y), cute.arch.make_warp_uniform(z)


@cute.jit
def bwd_tile_of_cta(n_blocks, seqlen_q, seqlen_k, key_hi, kv_heads, batches, group,
                    query_row_bytes: cutlass.Constexpr):
    """(KV tile, kv head, batch) of a backward CTA: head after head but
    where the right edge of the mask cuts the grid (key_hi < seqlen_k - 1:
    causal-like) and there are at least BWD_MIN_ROWS query rows. A CTA walks
    all query tiles its keys see, of every query head of its group, so a
    section holds as many kv heads as fit the budget with the query side
    they stream (query_row_bytes: one query row's Q, dO, fp32 dQ and stats)."""
    x, y, z = cute.arch.block_idx()
    if key_hi < seqlen_k - 1 and seqlen_q >= BWD_MIN_ROWS:
        x, y, z = sectioned_longest_first(x, y, z, n_blocks, kv_heads, batches,
                                          L2_BUDGET_BYTES // query_row_bytes // group, seqlen_q, 1)
    return cute.arch.make_warp_uniform(x), cute.arch.make_warp_uniform(y), cute.arch.make_warp_uniform(z)
