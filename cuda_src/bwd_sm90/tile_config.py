"""The tile choices of the sm90 backward (kernel.py), per head dim: backward
TFLOPS at bf16, 16 heads, 16k tokens, seq 8192 non-causal / causal on an H100
unless said otherwise. The alternatives and their numbers are in
docs/history.md ("Hopper backward tile choices")."""

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
    # Warps adding dQ in the deterministic variant, taking the query tiles in
    # turn (the default variant has one): at hd192 / hd256 one writer ran the
    # deterministic backward at 0.74 / 0.63 and 0.87 / 0.76 of the default,
    # two at 0.89 / 0.88 and 0.89 / 0.82; three no better.
    det_dq_writers: int = 2
    # The deterministic variant with the stats warp (warp_roles.STATS_WARP;
    # the default variant always has it); without it the consumers load lse
    # and delta themselves, one tile ahead. Off where it collapsed at long
    # sequences (hd192 causal 16k 202-207 against 345; cause not understood).
    det_stats_warp: bool = True
    # dQ accumulators per group of KV tiles in the deterministic variant's
    # rotated order (warp_roles._write_dq, "dQ chains"): a query tile's turns
    # alternate between them, at the cost of one more float32 dQ per chain.
    # Two where the hand-over held the CTAs up (192 / 128 seq 2k 281 against
    # 254 with one); one elsewhere, where the extra pass over dQ cost more.
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


# n_block = 128 gives each consumer WG one 64-row WGMMA in the S^T, dP^T, dK
# and dV GEMMs; hd192 / hd256 keep 64 keys and split the head dim of dK, dV
# and dQ over the WGs (dK and dV would need 256 floats per thread at 128
# keys). Rows that do not tile WGMMA's M (hd64's 112, hd128's 80) compute
# dQ^T = K^T dS^T.
# (head_dim, head_dim_v) -> tile
TILE_CONFIGS = {
    # 112 rows: 470 / 416 against 390-396 / 358-359 at 64 (96 and 80 rows between).
    (64, 64): TileConfig(m_block=112, n_block=128, stages=2),
    # 64 rows, 2 stages: 3 stages within the spread (464 / 422 against 453-457 / 416-418).
    (96, 96): TileConfig(m_block=64, n_block=128, stages=2),
    # 80 rows, 227 KiB of shared memory: 544 / 480 against 498-503 / 464-469 at 64.
    (128, 128): TileConfig(m_block=80, n_block=128, stages=2),
    # Shared memory full at 224 KiB with its own dQ tile: 390 / 382 against 348 / 351 without.
    (192, 192): TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, det_stats_warp=False,
                           det_turn_chains=2),
    # hd192's tile with V, dO, dV 128 wide (203 KiB): 350 / 328 against 324 / 310 padded to 192.
    (192, 128): TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, det_stats_warp=False,
                           det_turn_chains=2),
    # No room for a 64 KiB dQ tile: dQ over the spent Q / dO stage, 393 / 400 against 275-288 /
    # 272-285 adding dQ with red.global.
    (256, 256): TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, dq_in_stage=True,
                           det_stats_warp=False),
}
