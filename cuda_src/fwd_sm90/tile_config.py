"""The tile choices of the sm90 forward (kernel.py), per head dim: TFLOPS at
bf16, 16 heads, 16k tokens, seq 8192 non-causal / causal on an H100 unless
said otherwise."""

from dataclasses import dataclass

# Each choice with the measurement that decided it; the alternatives and
# their numbers are in docs/history.md ("Hopper forward tile choices").
# Limits: consumers hold S (tile_n / 2 fp32), P (tile_n / 4 packed) and O
# (head_dim_v / 2 fp32) per thread within 240 registers (160 with three
# consumers); Q (rows x hd) + stages x (K + V) (tile_n x hd each) fit 227 KiB.

# (head_dim, head_dim_v) -> (tile_n, kv_stages, consumer warpgroups)
TILE_CONFIG = {
    (64, 64): (128, 4, 3),  # 3 consumers: 498 / 431 TFLOPS against 429-443 / 396-399 with 2
    (96, 96): (128, 3, 2),  # 509-513 / 466-476 against 469 / 435 at 160 x 2
    (128, 128): (128, 3, 2),  # 633 / 564 against 605-612 / 557-564 at 2 stages
    (192, 192): (96, 2, 2),  # 112-key tiles ran within the spread (8k 698 / 668 against 702 / 653-657)
    (192, 128): (128, 2, 2),  # 667-687 / 608-611 against 639 / 565 at 112 x 2
    (256, 256): (80, 2, 2),  # 669 / 607 against 625-639 / 591-592 at 64 x 2
}

# Head dims whose consumers keep Q in registers as the S GEMM's operand:
# hd128 8k 648 against 638-644 TFLOPS; hd64, hd256 and the packed-document
# variant spill with it.
Q_IN_REGISTERS = {(128, 128)}

# (head_dim, head_dim_v) -> independent chains per row in the softmax's max
# and sum (online_softmax.reduce_row; 1 elsewhere): hd64 8k 494-509 / 468-480
# against 492-499 / 462-467 with one chain; hd128 within the spread.
REDUCTION_PARTIALS = {(64, 64): 4}

# (head_dim, head_dim_v) -> seqlen_q from which non-causal calls without
# segments run cluster pairs of query tiles that multicast K / V (kernel.py
# kv_multicast): +1-5% from 4k, a loss at 1k, nothing at hd64.
KV_MULTICAST = {
    (128, 128): 4096,
    (192, 192): 4096,
    (192, 128): 4096,
    (256, 256): 4096,
}


@dataclass(frozen=True)
class ShortTile:
    """A variant for short sequences: exported as jf_fwdshort90_*; the
    launcher runs it when seqlen_q is at most max_seqlen_q_causal (right
    edge of the window bounded) or max_seqlen_q (otherwise)."""
    tile_n: int
    consumers: int
    kv_stages: int
    ctas_per_sm: int
    max_seqlen_q_causal: int
    max_seqlen_q: int
    reduction_partials: int = 1  # as REDUCTION_PARTIALS; 4 chains tied at 1k


# One consumer and three CTAs per SM, so one CTA's Q load and O store run
# under another's GEMMs: hd64 causal 1024 / 2048 285 / 344 TFLOPS (1.03 /
# 1.01x cuDNN); past causal 2048 and non-causal 768 the plain kernel wins.
SHORT_TILE = {
    64: ShortTile(tile_n=64, consumers=1, kv_stages=3, ctas_per_sm=3, max_seqlen_q_causal=2048,
                  max_seqlen_q=768),
}

# (head_dim, head_dim_v) pairs exported with paged K / V (call_paged): the
# head dims of serving models; their tiles are TILE_CONFIG's, whose tile_n
# are multiples of paged_kv.PAGE_BOX.
PAGED = ((64, 64), (128, 128), (256, 256))

# (head_dim, head_dim_v) -> (tile_n, kv_stages, consumer warpgroups) of the
# FP8 (e4m3) variants (fp8_operands.py), not yet timed: FP8 WGMMA slices keys
# by 32, so tile_n is a multiple of 32; Q / K / V take half the bytes of
# bf16's, O (bf16) its own buffer.
FP8_TILE_CONFIG = {
    (64, 64): (128, 4, 3),  # bf16's tile: the FP8 stages take half its memory
    (128, 128): (128, 3, 2),  # bf16's tile; 16 + 3 x 32 + 32 (O) KiB
    (256, 256): (96, 2, 2),  # bf16's 80 is no multiple of 32; 128 would leave O 208 of 240 registers
}

# (head_dim, head_dim_v) -> (tile_n, kv_stages, consumer warpgroups, FP8
# stages) of the paged variant on an FP8 cache (paged_fp8.py): the 16-bit
# stages as the consumers read them, fed by FP8 stages that TMA fills
# several tiles ahead (a tile is half the bytes, so twice as many tiles must
# be in flight for the same bytes); tile_n * head_dim / 8 a multiple of the
# 256 converting threads. H200, decode at 64 x 16k, hd128.
FP8_CACHE_TILE_CONFIG = {
    (64, 64): (64, 2, 2, 8),  # 16 + 2 x 16 + 8 x 8.5 KiB; 128-key tiles spilled 512 bytes (producer, 56 registers)
    (128, 128): (64, 2, 2, 6),  # 0.74 G tokens/s; 3 x 16-bit + 4 x FP8 stages 0.74, one consumer 0.59
}
