"""The named barriers of the sm90 backward (ids 0-15 per CTA; 0 is
__syncthreads). Plain Python, so that a CPU test (tests/test_kernel_build.py)
can check that no two hand-overs of a variant share an id: two on one id
would pair arrivals of different meanings, a silent race."""

# dQ writer warps (warp_roles.DQ_WARP on) at most: each has a pair of ids.
MAX_DQ_WRITERS = 2

# staggered.py: a warpgroup with nobody to meet syncs or arrives here alone.
# Nothing else uses barrier 0 once the warps have split into their roles.
BAR_ALONE = 0
BAR_PDS = 1  # P and dS of a query tile are in shared memory
BAR_EPI = 2  # epilogue staging through sK / sV
# dq_in_stage: both consumer WGs are done with the Q / dO stage.
BAR_STAGE_READ = 3


def bar_dq_empty(writer):
    """Writer `writer` has read the dQ tile out of shared memory (staggered:
    WG `writer`'s half of it)."""
    return 4 + 2 * writer


def bar_dq_full(writer):
    """The consumers wrote the dQ tile that writer `writer` adds (staggered:
    WG `writer` wrote its half)."""
    return 5 + 2 * writer


# The stats warp and all consumers meet here once per query tile: the stats
# warp after writing the tile's stage, the consumers before reading it. A
# barrier both sides wait at (not arrive / wait: racecheck reported hazards
# on that hand-over, and on an mbarrier one) orders both directions: the
# stats warp writes a stage again only after the consumers reached the next
# tile's barrier, past their reads of it (hence stages >= 2).
BAR_STATS = 4 + 2 * MAX_DQ_WRITERS


def bar_stats_of_wg(wg):
    """The staggered variant's stats barrier of WG wg (BAR_PDS and
    BAR_STAGE_READ, which it does not use otherwise)."""
    return BAR_PDS + 2 * wg


def bar_ds_full(wg, buffer):
    """Staggered: WG wg's dS^T rows of the query tile in dS buffer `buffer`
    are stored."""
    return BAR_STATS + 2 * wg + buffer


def bar_ds_free(wg, buffer):
    """Staggered: WG wg's dQ^T GEMM has read dS buffer `buffer`."""
    return BAR_STATS + 4 + 2 * wg + buffer
