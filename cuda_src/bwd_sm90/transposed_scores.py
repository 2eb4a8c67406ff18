"""What the sm90 backward does with its transposed score tiles S^T and dP^T
(keys as rows, query rows as columns): per-column query statistics, the
visibility mask and the segment-id test.

In a WGMMA accumulator lane l holds the columns 8 g + 2 (l % 4) + {0, 1} of
every 8-column group g, and all lanes with the same l % 4 hold the same
columns. A thread's 16 query rows would take 16 registers per statistic, so
each lane reads only the two rows of group l // 4 (own_query_column) and
serves them to the others by shuffles (query_stat). (Holding all 16 per
thread spilled at head_dim 64.) The 32 lanes serve 8 groups, 64 columns, per
pair of rows: 80 or 112 query rows give each lane one pair per 64 columns
(stat_pairs), the lanes past the last group serving nobody. (Those tiles
take only their segment ids this way: each thread reads lse and delta of its
own columns from shared memory, QueryStats.)
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.dsl_common import LOG2E, WARP_SIZE, capped_score_slope
from ..common.hidden_pairs import HIDDEN
from ..common.nonfinite import is_nonfinite



PAIR_COLUMNS = 64  # columns whose statistics one pair per lane covers


def stat_pairs(columns: int) -> int:
    """Pairs of statistics per lane for a tile of `columns` query columns."""
    return (columns + PAIR_COLUMNS - 1) // PAIR_COLUMNS


@cute.jit
def own_query_column(lane, b: cutlass.Constexpr, pair: cutlass.Constexpr = 0):
    """Column b of group 8 * pair + lane // 4: a query row (within the tile)
    whose statistics this lane reads and serves (module docstring)."""
    return PAIR_COLUMNS * pair + 8 * (lane // 4) + 2 * (lane % 4) + b


@cute.jit
def lse_to_log2(lse):
    """lse * log2 e, with +inf for rows that see no key (lse = -inf), so
    that P = 0 there."""
    lse_log2 = lse * Float32(LOG2E)
    if lse == -Float32.inf:
        lse_log2 = Float32.inf
    return lse_log2


@cute.jit
def flag_nonfinite_stats(sStats, nan_flags, stage, lane):
    """The stats warp, once it staged a query tile's statistics: nan_flags
    [stage] = whether a row's lse * log2 e or delta is not finite (read back
    after the staging loop, which stays as it was: the warp has 24
    registers)."""
    rows = cute.size(sStats, mode=[0])
    # A lane reads rows other lanes staged: without this, racecheck reports
    # the intra-warp hazard (the warp is converged here, so it costs nothing).
    cute.arch.sync_warp()
    found = False
    for i in cutlass.range_constexpr((rows + WARP_SIZE - 1) // WARP_SIZE):
        row = cutlass.min(i * WARP_SIZE + lane, rows - 1)
        found = found or is_nonfinite(sStats[row, 0, stage]) or is_nonfinite(sStats[row, 1, stage])
    found = cute.arch.vote_any_sync(found)
    if lane == 0:
        nan_flags[stage] = Int32(1) if found else Int32(0)


@cute.jit
def load_query_stats(lse_pair, delta_pair, mLSE, mDelta, batch, head, m0, lane, seqlen_q):
    """Without the stats warp: fill lse_pair and delta_pair with lse and
    delta of this lane's two own_query_column rows (rows past seqlen_q take
    the last row's, which the mask hides). Nothing here reads the loaded
    values, so the loads stay in flight until the pairs are used."""
    for b in cutlass.range_constexpr(2):
        row = cutlass.min(m0 + own_query_column(lane, b), seqlen_q - 1)
        lse_pair[b] = mLSE[batch, head, row]
        delta_pair[b] = mDelta[batch, head, row]


@cute.jit
def query_stat(pair, c: cutlass.Constexpr, lane):
    """The value for column index c = 2 g + b of a thread's accumulator
    (wgmma_acc_as_rows_cols order), shuffled from the lane that read
    column group g."""
    group = c // 2
    return cute.arch.shuffle_sync(pair[2 * (group // 8) + c % 2], 4 * (group % 8) + lane % 4)


@cute.jit
def warp_sees_several_ids(key_seg, seg_pair):
    """Whether the keys and query rows this warp holds (key_seg per thread,
    the query ids as the own_query_column pairs) carry more than one
    segment id; the answer is warp-uniform."""
    first = cute.arch.shuffle_sync(key_seg[0], 0)
    differs = seg_pair[0] != first or seg_pair[1] != first
    for i in cutlass.range_constexpr(2, cute.size(seg_pair)):
        differs = differs or seg_pair[i] != first
    for r in cutlass.range_constexpr(cute.size(key_seg)):
        differs = differs or key_seg[r] != first
    return cute.arch.vote_any_sync(differs)


@cute.jit
def zero_hidden_pairs(acc_mn, tScS, m0, n0, q_len, kv_len, lo, hi, key_seg=None, seg_pair=None,
                      lane=None):
    """Zero the (key, query) accumulator entries of a pair that is not
    visible: query i >= q_len, key j >= kv_len, j - i outside [lo, hi], or
    (with key_seg and the query ids' seg_pair) different segment ids. P and
    dS are computed from these, so a hidden pair must contribute exactly 0."""
    for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
        query = m0 + tScS[0, c][1]
        query_seg = Int32(0)
        if cutlass.const_expr(key_seg is not None):
            query_seg = query_stat(seg_pair, c, lane)
        # Visible keys of this query as tile-local rows [key_lo, key_hi).
        key_lo = query + lo - n0
        key_hi = cutlass.min(kv_len, query + hi + 1) - n0
        if query >= q_len:
            key_hi = Int32(0)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            key = tScS[r, c][0]
            if cutlass.const_expr(key_seg is not None):
                if key < key_lo or key >= key_hi or key_seg[r] != query_seg:
                    acc_mn[r, c] = Float32(HIDDEN)
            elif key < key_lo or key >= key_hi:
                acc_mn[r, c] = Float32(HIDDEN)


class QueryStats:
    """lse * log2 e and delta of a score tile's query columns as this thread
    reads them: by shuffles from the lanes' pairs (query_stat), or, given
    smem_stats = (sStats, stage, tScS) for query rows that do not tile
    WGMMA's M, each column its own from the stats warp's stage."""

    def __init__(self, lse_log2_pair, delta_pair, lane, smem_stats=None):
        self.pairs = (lse_log2_pair, delta_pair)
        self.lane = lane
        self.smem_stats = smem_stats

    def _column(self, which: int, c: int):
        if self.smem_stats is None:
            return query_stat(self.pairs[which], c, self.lane)
        sStats, stage, tScS = self.smem_stats
        return sStats[tScS[0, c][1], which, stage]

    def lse_log2(self, c: int):
        return self._column(0, c)

    def delta(self, c: int):
        return self._column(1, c)


def probabilities_in_place(acc_S_mn, stats: QueryStats, scale_log2):
    """P^T = exp2(S^T scale log2 e - lse log2 e) over S^T's (keys, query
    columns) view."""
    for c in range(cute.size(acc_S_mn, mode=[1])):
        row_lse = stats.lse_log2(c)
        for r in range(cute.size(acc_S_mn, mode=[0])):
            acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - row_lse, fastmath=True)


def score_gradients_in_place(acc_dP_mn, acc_P_mn, stats: QueryStats, slope_from_probability: bool,
                             inv_scale_log2):
    """dS^T = P^T (dP^T - delta) over dP^T's (keys, query columns) view; with
    slope_from_probability (softcap) also times tanh's slope, recovered from
    P^T and the column's lse."""
    for c in range(cute.size(acc_dP_mn, mode=[1])):
        delta = stats.delta(c)
        if slope_from_probability:
            row_lse = stats.lse_log2(c)
        for r in range(cute.size(acc_dP_mn, mode=[0])):
            acc_dP_mn[r, c] = acc_P_mn[r, c] * (acc_dP_mn[r, c] - delta)
            if slope_from_probability:
                acc_dP_mn[r, c] *= capped_score_slope(acc_P_mn[r, c], row_lse, inv_scale_log2)
