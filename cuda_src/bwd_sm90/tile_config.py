"""The tile choices of the sm90 backward (kernel.py), per head dim, with the
measurements behind them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    m_block: int  # query rows per iteration
    n_block: int  # keys per CTA
    stages: int  # Q/dO pipeline depth, also dS buffers
    # Large head dims: the consumer WGs split the head dim of dK, dV and dQ
    # (and the query rows of S^T, dP^T) instead of the keys, so that each
    # holds half of dK and dV; P^T then goes through shared memory too.
    split_head_dim: bool = False
    # dQ's fp32 tile written over the Q / dO stage it came from (4 M D bytes
    # either way), freed by the writer warp after its TMA add: no shared
    # memory of its own, at the price of waiting for the dK / dV GEMMs
    # before the tile is written.
    dq_in_stage: bool = False
    # Warps adding dQ in the deterministic variant, taking the query tiles
    # in turn (the default variant has one). A deterministic writer waits for
    # its add to complete before it passes the tile's turn on; alone, it held
    # the consumers up. H100, seq 8192, deterministic over default backward,
    # non-causal / causal: one writer hd192 0.74 / 0.63, hd256 0.87 / 0.76;
    # two 0.89 / 0.88 and 0.89 / 0.82 (results run 35, which also dropped a
    # redundant gpu fence before each turn's release); three no better
    # (run 36: hd192 0.88 / 0.87, hd256 0.93 / 0.80 against two's 0.88-0.89
    # / 0.85-0.87 and 0.94 / 0.81-0.82).
    det_dq_writers: int = 2
    # The deterministic variant with the stats warp (warp_roles.STATS_WARP;
    # the default variant always has it). Without it the consumers load lse
    # and delta themselves, one tile ahead. H100, deterministic causal, with
    # / without in one process (results run 43), seq 2k / 8k / 16k: hd192
    # 272 / 300-340 / 202-207 against 259 / 332 / 345 TFLOPS, hd256 263-268
    # / 343-345 / 181-191 against 260 / 324 / 339. Why it collapses at long
    # sequences is not understood; off at those head dims. Again with the
    # rotated order without a mask (results runs 55-56, deterministic over
    # default, non-causal seq 1k / 2k / 4k): hd192 0.89 / 0.90 / 0.87
    # against 0.86 / 0.86 / 0.86 without, hd256 0.89 / 0.86 / 0.91 against
    # 0.87 / 0.85 / 0.89, but hd192 causal seq 16k collapsed again (205
    # against 352 TFLOPS): still off. 192 / 128 with it (run 68, non-causal
    # seq 2k / 4k): 0.85 / 0.83 against 0.86 / 0.83 without (twice).
    det_stats_warp: bool = True
    # dQ accumulators per group of KV tiles in the deterministic variant's
    # rotated order (warp_roles._write_dq, "dQ chains"): a query tile's
    # turns alternate between them, so that each CTA waits on the turn
    # det_turn_chains before its own, at the cost of one more float32 dQ per
    # chain, zeroed and summed per call. H100, deterministic backward TFLOPS
    # with two / one, non-causal seq 2k / 4k (results run 93): 192 / 128 281
    # / 314 against 254 / 284, hd192 314 / 346 against 305 / 331; where the
    # hand-over did not hold the CTAs up, the extra pass over dQ cost more
    # than the chains won: hd256 315 / 349 against 330 / 354, hd128 434 / 483
    # against 451 / 503, hd64 368 / 413 against 376 / 431. Four lost
    # everywhere (H200, results run 15, deterministic over default,
    # non-causal seq 1k / 4k: 192 / 128 0.69 / 0.83 against 0.86 / 0.90,
    # hd256 0.64 / 0.81 against 0.89 / 0.90): at short sequences the extra
    # passes over dQ weigh most. One instead of two at short sequences lost
    # too (H100, results run 152, deterministic over default, non-causal seq
    # 1k / 2k, two processes each): 192 / 128 0.82 / 0.79-0.80 against
    # 0.83-0.84 / 0.87-0.88, hd192 0.84 / 0.82 against 0.85-0.86 / 0.88.
    # A head of KV tiles in several rotation groups
    # (dsl_common.rotated_order) takes this many per group.
    det_turn_chains: int = 1

    @property
    def dq_tile_rows(self) -> int:
        """Query rows of the dq_accum tiles this tile writes (kernel_api.h:
        dq_tile_rows), or 0 for dQ in q's layout: m_block where it tiles
        WGMMA's M (kernel.py, "dQ in tiles"); the other tiles write dQ^T."""
        return self.m_block if self.m_block % 64 == 0 else 0

    def __post_init__(self):
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2 (warp_roles.BAR_STATS), got {self.stages}")

    def smem_bytes(self, head_dim: int, head_dim_v: int = None) -> int:
        """Bytes of FlashBwdSm90's SharedStorage at this tile (its size is a
        multiple of its 1024-byte alignment); V and dO are head_dim_v wide
        (default head_dim)."""
        widths = head_dim + (head_dim_v or head_dim)
        q_do = self.stages * self.m_block * widths * 2
        k_v = self.n_block * widths * 2
        p_ds = (2 if self.split_head_dim else 1) * self.stages * self.m_block * self.n_block * 2
        dq = 0 if self.dq_in_stage else self.m_block * head_dim * 4
        stats = 2 * self.m_block * self.stages * 4 + 128
        return -(-(q_do + k_v + p_ds + dq + stats + 1024) // 1024) * 1024


# Frozen per head dim. n_block = 128 puts one 64-row WGMMA per consumer WG in
# the S^T, dP^T, dK and dV GEMMs; m_block = 64 keeps the S^T/dP^T/dQ
# fragments at 32 floats per thread next to dK and dV (64 each at hd128)
# within 240 registers (hd128 takes 80 rows and hd64 112 since: see below). Shared
# memory (2 stages, dS, fp32 dQ tile) at 64 rows: hd128 192 KiB (227 at 80), hd96
# 152 KiB, hd64 112 KiB (176 at 112).
# Measured on H100 (bf16, batch 2, 16 heads, seq 8192, backward TFLOPS,
# non-causal / causal, cuDNN in the same process; results runs 6 and 13):
# the earlier layout (S = Q K^T, P through shared memory, dQ by red.global,
# 168 registers) ran hd128 366 / 348, hd64 258 / 245 (run 6) and, in a
# trial, hd96 198 / 185 (slower than the sm80 kernel, so not built then).
# This layout: hd128 485 / 444 (cuDNN 539 / 469), hd96 433 / 395 (cuDNN
# 423 / 393), hd64 345 / 322 (cuDNN 439 / 370).
#
# hd192 and hd256 keep 64 keys per CTA and split the head dim over the WGs:
# dK and dV are then 64 floats each per thread at hd256 (128 keys would need
# 256), S^T and dP^T 16. Shared memory is full at both (224 KiB: Q, dO in
# two stages, K, V, P^T and dS^T double buffered, hd192's 48 KiB dQ tile);
# hd256 has no room for its 64 KiB dQ tile and writes dQ over its spent Q /
# dO stage (dq_in_stage).
# H100 (same setting as above, results runs 19 to 21): hd192 378-394 /
# 376-382 (cuDNN 295-306 / 310-321); hd256 with dq_in_stage 393-394 / 400-401
# (cuDNN 350-354 / 365-373; run 21). Alternatives timed in the same runs: hd256
# adding dQ from the consumers with red.global.add.v2 (no dQ tile) 275-288 /
# 272-285, with red.global.add.v4 272 / 270, one Q/dO stage and its own dQ
# tile 267 / 277 (the sm80 kernel ran 166); hd192 with dq_in_stage 348 /
# 351 (its own tile: 390 / 382 in the same run), with red.global 258 / 255.
# hd128 with dq_in_stage and three stages: 487 / 442 (shipped 493 / 454).
# Run 24: one WG computing S^T and the other dP^T, each for all 64 query
# rows (64-wide WGMMAs instead of two 32-wide ones), and dS^T from P^T in
# shared memory: hd192 385 / 380, hd256 388 / 385 against 382-390 / 380-383
# and 381-387 / 392-394 shipped, so the 32-wide score GEMMs are not what
# holds these head dims back (that trial also had a dQ bug; not kept).
# Nsight Compute reads L2 86.8% busy at hd256 (its dQ reduction input 61.5%;
# H100, seq 8192), but halving the Q / dO loads (clusters of two KV tiles
# multicasting them, run 129: hd256 8k 399 / 378 against 398 / 402), the next
# tile's score GEMMs issued under the dQ stores (run 130: 318 / 332 against
# 400 / 403) and a conflict-free 32-byte swizzle for the dQ tile (run 131:
# 288 / 288 against 399 / 400) all lost or tied. A timing probe without the
# dQ TMA add ran hd256 8k at 447 / 431 (run 132): the reduction costs 11-13%,
# and the rest of the CTA stays below 1.5x cuDNN. Conflict-free dQ stores in
# a tile-contiguous accumulator, added as one box, ran +2-5% as a probe (run
# 133: 8k 416 / 416 against 399 / 397), +1-7% at hd96, hd192 and 192 / 128
# too (run 134). Shipped as dq_tile_rows (every tile of 64 query rows; the
# caller transposes the tiles back), against the build before in one process
# (run 136, seq 8192): hd256 418 / 413 against 404 / 397 TFLOPS, hd192 402 /
# 392 against 395 / 377, 192 / 128 372 / 351 against 352 / 342, hd96 485 /
# 434 against 467 / 417; the deterministic variant, bound by its turns, moved
# by 0-6% (run 137).
# hd128 at 80 query rows (TileConfig(80, 128, 2), export --tile 80,128,2,
# FlashAttention-3's non-causal hd128 tile; shipped): 80 rows do not
# tile WGMMA's M = 64, so dQ^T = K^T dS^T (the head dim as M, the WGs
# splitting it), stored transposed into the fp32 dQ tile; S^T, dP^T and dQ^T
# are 40 floats per thread, and each thread reads lse and delta of its own
# columns from shared memory. SharedStorage is 227 KiB exactly. ptxas: no
# spills, WGMMAs unserialised only with P^T converted after dS^T and dV
# issued after the dS^T stores (kernel.py). H100 against 64 rows in one
# process (results run 48, non-causal / causal): seq 8192 544 / 480 against
# 498-503 / 464-469 TFLOPS (cuDNN 506 / 460), 2048 473 / 389 against 447-449
# / 354-377, 1024 393 / 270 against 384-388 / 284-285.
# Since e4ee69c its two consumer WGs run out of step (FlashBwdSm90.staggered,
# staggered.py): H100, results runs 160-161, seq 8192 non-causal / causal,
# 583-596 / 514-524 against 536-544 / 480-486 in step (cuDNN 515-516 /
# 458-461), seq 2048 490 / 380 against 456-461 / 358-361. Since 817c9eb
# hd64's 112 rows too, whose WGs split dQ^T's query columns and store the dQ
# tile's row halves one after the other: H100, runs 162-163, non-causal /
# causal, seq 2048 426 / 298 against 380-392 / 296 in step (cuDNN 361 / 258),
# 8192 496 / 425 against 463-469 / 410-412 (cuDNN 442 / 366), 16384 508 /
# 464 against 475-479 / 462-465 (cuDNN 440 / 430).
# The deterministic variant staggered too (a dQ writer warp per WG's half,
# each half of a query tile taking turns of its own; det_dq_writers then
# does not apply): H100, runs 166-168, seq 8192, deterministic backward
# TFLOPS non-causal / causal, hd128 584 / 512 against 531-538 / 472-473 in
# step, hd64 464 / 403 against 446-457 / 392-402 (default 598-601 / 526-530
# and 498-510 / 426-433, cuDNN 510 / 462 and 437 / 374).
# At this tile the fp32 dQ tile's shared stores (40 per thread and query
# tile) cost 7-8% of the backward, waiting on shared-memory bandwidth that
# the dK and dQ GEMMs use at the same time (timing probes, H200 run 13 and
# H100 run 126; docs/history.md).
# The dV GEMM issued as soon as P^T is converted, dS^T then computed from
# the 16-bit P^T so that the fp32 one dies (hd128 80 rows: 40 bytes
# spilled; hd64 112 rows: none), results run 99, backward TFLOPS non-causal
# / causal at seq 2k / 8k / 16k: hd64 337 / 258, 391 / 356, 403 / 401
# against 391-396 / 295-302, 458-462 / 417-420, 487-489 / 469-480; hd128
# 424 / 338, 499 / 444, 505 / 482 against 465-466 / 364-382, 559-560 /
# 488-497, 555-560 / 541-553. Not kept.
# Runs 27 (H100) and 9 (H200), hd64 / hd128 at 64 x 128, not kept: lse and
# delta loaded before the S^T / dP^T GEMMs are issued, with an immediate
# shuffle source lane, hd64 338 / 318 and hd128 449 / 439 against 343-349 /
# 319-326 and 474-483 / 442-449 shipped; the same plus dV issued after dS^T
# (the FlashAttention-3 order) 335 / 315 and 454 / 430; K and V held in
# registers as the A operands of S^T and dP^T (hd64, H200) 346 / 323 against
# 343-347 / 319-322. 128 query rows at hd64 (FlashAttention-3's tile) compile
# only with every WGMMA serialised by ptxas (S^T and dP^T then hold 64 floats
# each next to dK and dV), as does issuing the next tile's S^T / dP^T across
# the loop turn. With dS^T computed from the 16-bit P^T (its fp32 copy dies
# after the exp) they compile unserialised, but ran 306 / 281 against 344-348
# / 322-328 (run 33), so 64 query rows stay. More Q / dO stages (run 46,
# seq 8192 non-causal / causal): hd64 at 3 stages 400 / 357, at 4 392 / 360
# against 397-401 / 362-363 at 2; hd96 at 3 464 / 422 against 453-457 /
# 416-418: within the spread, so two stages stay. Reading lse / delta per
# query column from the stats warp's stage at 64 rows too, as the 80-row
# path does (branch bwd-column-stats, run 50): hd64 390 / 365 against
# 397-400 / 361-362, hd96 467 / 417 against 452-465 / 421-429; not kept.
#
# hd64 at 112 query rows (dQ^T = K^T dS^T as at hd128's 80 rows, but with a
# head dim of one WGMMA M the WGs split dQ^T's query columns, 56 each): S^T,
# dP^T 56 floats per thread, dQ^T 28, dK and dV 32 each, no spills. H100,
# results run 69 (16 heads, 16k tokens, backward TFLOPS, non-causal / causal,
# seq 1k / 4k / 8k / 16k), against 64 rows timed before and after:
#   112 x 2: 332 / 210, 429 / 371, 470 / 416, 462 / 461;
#   96 x 2:  334 / 220, 414 / 371, 457 / 406, 469 / 455;
#   96 x 3:  337 / 223, 435 / 377, 454 / 403, 473 / 470;
#   80 x 2:  327 / 222, 406 / 350, 447 / 389, 459 / 447;
#   64 x 2:  305-308 / 217-218, 376-380 / 324-325, 390-396 / 358-359,
#            398-407 / 392-402 (cuDNN at 8k 424-427 / 369-373).
# With dQ over the spent Q / dO stage (dq_in_stage, room for a third stage;
# run 71, against 112 x 2 shipped, timed before and after): 112 x 3 315 /
# 202, 439 / 355, 449 / 403, 473 / 444; 96 x 3 324 / 216, 429 / 357, 453 /
# 394, 461 / 451; 112 x 2 313 / 203, 417 / 352, 451 / 405, 459 / 435;
# shipped 323-329 / 201-210, 438-447 / 369-373, 467-468 / 416-419, 477-480
# / 451-464.
# K^T held in registers (32 per thread, loaded once per CTA) as the A operand
# of dQ^T = K^T dS^T, so that the dQ^T GEMM reads only dS^T from shared
# memory (branch bwd-kt-registers; gradients bitwise equal): hd64 compiles
# without spills but ran the same (H100, results run 154, seq 8k / 16k
# non-causal / causal: 466 / 414, 486 / 469 against 455-463 / 410-413,
# 488-491 / 471); at hd128's 80 rows even 8 more registers (two of the
# eight k-steps) spill and serialise the WGMMAs.
# DeepSeek's prefill shape, head_dim 192 with head_dim_v 128, takes hd192's
# tile with V, dO and dV 128 wide: each WG holds 64 columns of dV (32 floats
# per thread) and 96 of dK and dQ. Shared memory 203 KiB against hd192's 227
# (Q / dO stages 80 KiB, K / V 40 KiB, P^T / dS^T 32 KiB, dQ 48 KiB), so a
# third stage does not fit (259 KiB), nor does dq_in_stage help: the 48 KiB
# fp32 dQ tile is larger than a 40 KiB Q / dO pair. H100, run 52 (FLOPs
# over 192 + 128 columns, non-causal / causal): seq 8192 350 / 328 TFLOPS
# against 324 / 310 with V and dout padded to 192 (run 51), 1024 268 / 211
# against 229 / 174.
# (head_dim, head_dim_v) -> tile
TILE_CONFIGS = {
    (64, 64): TileConfig(m_block=112, n_block=128, stages=2),
    (96, 96): TileConfig(m_block=64, n_block=128, stages=2),
    (128, 128): TileConfig(m_block=80, n_block=128, stages=2),
    (192, 192): TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, det_stats_warp=False,
                           det_turn_chains=2),
    (192, 128): TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, det_stats_warp=False,
                           det_turn_chains=2),
    (256, 256): TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, dq_in_stage=True,
                           det_stats_warp=False),
}
