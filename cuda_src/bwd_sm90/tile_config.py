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
    # dQ added to global memory by the consumers (red.global.add.v2.f32)
    # instead of through a shared fp32 tile and the writer warp's TMA, for
    # want of shared memory; not deterministic.
    dq_red: bool = False


# Frozen per head dim. n_block = 128 puts one 64-row WGMMA per consumer WG in
# the S^T, dP^T, dK and dV GEMMs; m_block = 64 keeps the S^T/dP^T/dQ
# fragments at 32 floats per thread next to dK and dV (64 each at hd128)
# within 240 registers. Shared memory (2 stages, dS, fp32 dQ tile): hd128
# 192 KiB, hd96 152 KiB, hd64 112 KiB.
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
# hd256 has no room for its 64 KiB dQ tile and adds dQ with red.global.
# H100 (same setting as above, results runs 19 and 20): hd192 378-390 /
# 376-378 (cuDNN 295-302 / 310-319); hd256 275-288 / 272-285 (cuDNN 342 /
# 365-370; the sm80 kernel ran 166). What red.global costs, timed at hd192:
# 258 / 255 against 385 / 376 with the tile; at hd256 one Q/dO stage with
# the tile ran 267 / 277, red.global.add.v4 272 / 270.
TILE_CONFIGS = {
    64: TileConfig(m_block=64, n_block=128, stages=2),
    96: TileConfig(m_block=64, n_block=128, stages=2),
    128: TileConfig(m_block=64, n_block=128, stages=2),
    192: TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True),
    256: TileConfig(m_block=64, n_block=64, stages=2, split_head_dim=True, dq_red=True),
}
