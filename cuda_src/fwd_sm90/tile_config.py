"""The tile choices of the sm90 forward (kernel.py), per head dim, with the
measurements behind them."""

from dataclasses import dataclass

# head_dim -> (tile_n, kv_stages). Consumers hold S (tile_n / 2 fp32), P
# (tile_n / 4 packed regs) and O (head_dim / 2 fp32) per thread within 240
# registers; Q (128 x hd) + stages x (K + V) (tile_n x hd each) must fit
# 227 KiB of shared memory. Every entry compiles without spills (ptxas -v);
# hd128 at tile_n 176 spills and hd96 at 192 spills 12 bytes.
# Timed on H100 (bf16, batch 2, 16 heads, seq 8192, forward TFLOPS
# non-causal / causal, scripts/gpu_alternatives.sh, results run 14; cuDNN
# in the same process moves by about 2% between runs):
#   hd64:  128 x 4 stages 410-414 / 379-382; 192 x 4: 395 / 358; 176 x 4:
#          405 / 362.
#   hd96:  128 x 3 509-513 / 466-476; 160 x 2: 469 / 435; 128 x 4: 502 / 460.
#   hd128: 128 x 2 565-572 / 526-529; 160 x 2: 546 / 497; 144 x 2: 535 / 486.
#   hd256: 64 x 2 625-639 / 591-592; 80 x 2: 669 / 607 (chosen).
# With the anchored PV wait (kernel.py, _consume), run 15: hd64 385-440 / 399-401,
# hd96 530-533 / 486-504, hd128 594-603 / 546-547, hd256 687-689 / 619-626.
# Three consumer warpgroups (192-row tiles, 160 registers each) at hd64,
# run 17: 498 / 431 against 429-443 / 396-399 with two (cuDNN 456 / 406).
# Run 45 (bf16 plain variant only, seq 8192 / 2048): hd128 at 128 x 3 633 /
# 564 and 571 / 458 against 605-612 / 557-564 and 556-588 / 439-468 for
# 128 x 2 (the same kernel timed three times); hd64 at 128 x 5 with three
# consumers 487 / 438 and 450 / 332 against 475-519 / 424-430 and 443-446
# / 328-332. hd128 ships at 128 x 3 since (GPU suite passed on it; run
# 47, cuDNN in the same process: seq 8192 625 / 568 (1.06 / 1.08x), 16384
# 637 / 642 (1.04 / 1.18x), 1024 500 / 357 (0.96 / 0.98x)).
# hd128 with three consumer warpgroups (192-row tiles at 160 registers;
# 96- and 112-key tiles spill), run 67, seq 1024 / 8192 non-causal / causal:
# 64 x 3 stages 453 / 593 and 315 / 550, 80 x 2 481 / 602 and 298 / 542,
# 80 x 3 454 / 577 and 297 / 535 against 512 / 639 and 355 / 568 shipped.
# hd128 at short sequences with smaller KV tiles (run 81, seq 1024 / 2048
# / 4096, non-causal / causal): 64 x 4 stages 480 / 357, 509 / 438, 609 /
# 479; 64 x 5 464 / 350, 518 / 422, 612 / 475; 96 x 3 459 / 336, 514 /
# 430, 609 / 487, against 503-512 / 359-363, 588-613 / 451-465, 604-616
# / 523-527 shipped (cuDNN at causal 1024 moved between 351 and 378).
# DeepSeek's prefill shape, head_dim 192 with head_dim_v 128, has its own
# kernel: O holds 64 fp32 per thread instead of 96 and a KV stage takes 80
# KiB instead of 96, which leaves room for hd128's 128-key tiles. Run 51
# (seq 8192, FLOPs over 192 + 128 columns): 128 x 2 667-687 / 608-611;
# 112 x 2 639 / 565; 80 x 3 608 / 551.
# The spills at 176 keys (hd128) and 192 (hd96) came from P: converted to
# bf16 whole, a fragment whose size is not a power of two took a register per
# element (online_softmax.store_converted). Converted in pairs they compile
# without spills; H200, results run 11, seq 1k / 2k / 8k non-causal /
# causal, against the shipped tiles timed twice in the same process: hd128
# 176 x 2 473 / 333, 540 / 457, 632 / 585 against 513-537 / 354-356,
# 568-577 / 461-480, 628-632 / 613-622; hd96 192 x 2 392 / 281, 488 / 376,
# 542 / 503 against 442-445 / 303-314, 479-492 / 390-409, 541-547 /
# 502-509; hd192 112 x 2 575 / 421, 646 / 540, 698 / 668 against 544-559 /
# 421-426, 612-658 / 501-522, 702 / 653-657 (within the spread).
# Two consumers at hd64 with more keys per tile lost (results run 142, seq
# 8192 non-causal / causal): 160 x 3 stages 437 / 407, 192 x 3 442 / 412
# against 500 / 476 for 128 x 4 with three. Three consumers with fewer keys
# per tile lost too (run 151, seq 8192 / 16384, non-causal / causal): 96 x 5
# stages 466 / 439, 470 / 463 and 112 x 4 466 / 447, 472 / 464 against 502 /
# 470, 510 / 498 (control 506 / 480, 508 / 501). Without the pingpong between
# consumers (export --no-pingpong, run 141) hd64 8k ran 498 / 462 and hd128
# 648 / 623 against 501 / 476 and 653 / 616, within the spread; it stays.
# (head_dim, head_dim_v) -> (tile_n, kv_stages, consumer warpgroups)
TILE_CONFIG = {
    (64, 64): (128, 4, 3),
    (96, 96): (128, 3, 2),
    (128, 128): (128, 3, 2),
    (192, 192): (96, 2, 2),
    (192, 128): (128, 2, 2),
    (256, 256): (80, 2, 2),
}

# Head dims whose consumers copy their Q tile into registers once and run
# the S GEMM with Q as the register operand, so that each of its WGMMAs
# reads only K from shared memory. H100, bf16, 16 heads, 16k tokens,
# forward TFLOPS, three timings each in turn with the build before
# (results runs 108-110, three machines), non-causal / causal:
#   hd128 seq 1k   522-524 / 371-373 against 508-516 / 361-362;
#         seq 4k   614     / 545-551 against 611     / 552-556;
#         seq 8k   648     / 597-624 against 638-644 / 594-604;
#         seq 16k            660     against           652.
# hd64 (three consumers at 160 registers) and hd256 (64 more registers
# beside its 128 of O) spill and serialise their WGMMAs, and so does the
# packed-document variant at hd128 (152 bytes), which keeps Q in shared
# memory. hd96 and 192 / 128 compile without spills; not timed.
Q_IN_REGISTERS = {(128, 128)}

# (head_dim, head_dim_v) -> independent chains per row in the softmax's max
# and sum (online_softmax.reduce_row; 1 elsewhere: one serial chain). H100,
# bf16, 16 heads, 16k tokens, forward TFLOPS, 4 / 8 chains against 1 timed
# in turn in one process (medians of 2, 3 and 4 timings; results runs
# 112-114), non-causal / causal:
#   hd64  seq 8k  498 / 468, 509 / 480 (4); 501 / 481, 500 / 477 (8) against
#                 493 / 463, 499 / 462;
#   hd128 seq 8k  639 / 592, 633 / 594 (4); 643 / 591, 635 / 592 (8) against
#                 638 / 607, 638 / 595.
# Run 116 (four timings each, 4 chains against 1): seq 8k 494 / 471 against
# 492 / 467. The packed-document variant of a head dim shares its entry (not
# timed); the short-sequence one has its own (ShortTile.reduction_partials).
# Taking the row sum off the FP32 pipe (a WGMMA of P times a tile of ones
# beside the PV GEMM) or every k-th exp2 off the MUFU (a polynomial on the
# FMA pipe) did not pay at hd64 (results runs 166-167, seq 8192: bf16 495 /
# 469 against 497 / 472; fp16 at k = 4 429 / 411 against 488 / 452;
# docs/history.md).
REDUCTION_PARTIALS = {(64, 64): 4}

# (head_dim, head_dim_v) -> seqlen_q from which the launcher runs, for masks
# without a window (non-causal) and without segments, a variant whose CTAs
# pair up in clusters of two neighbouring query tiles and each load half of
# every K / V tile into both (TMA multicast, kernel.py kv_multicast).
# H100, bf16, 16 heads, 16k tokens, non-causal forward TFLOPS, two runs each
# with / without in one process (results run 62), seq 4k / 8k / 16k / 32k:
#   hd128:   592 582 / 630 605 / 642 618 / 647 639 against 587 597 / 611 611
#            / 619 611 / 629 627;
#   hd192:   614 607 / 652 664 / 647 665 / 685 671 against 591 592 / 640 624
#            / 645 638 / 664 666;
#   192/128: 658 626 / 673 670 / 684 709 / 698 667 against 647 610 / 657 676
#            / 647 675 / 664 680;
#   hd256:   659 644 / 682 693 / 677 698 / 702 699 against 670 633 / 642 648
#            / 666 680 / 684 691.
# At 1k it loses (run 61: hd128 473 / 472 against 516, hd192 517 / 501
# against 541); hd64 gains nothing (run 61, 4k-16k: 463-476 / 457-483
# against 468-490). Its L2 traffic is not what holds the plain kernel back:
# Nsight Compute on it (hd128, seq 8192, run 62) reads L2 throughput 53%,
# the tensor pipe 75% busy, issue slots 36%. hd128 with 160-key tiles and two
# stages, paired, ran 431 / 556 / 596 / 616 at 1k / 4k / 8k / 16k (run 61).
# Clusters of four query tiles, each loading a quarter of every K / V tile
# (results run 150, hd128 non-causal, seq 4k / 8k / 16k, medians of three):
# 585 / 610 / 641 against 619 / 663 / 677 for the pairs (control 622 / 648 /
# 677, cuDNN 588 / 610 / 616); not kept.
# Under causal masks too (the cluster walking the union of its two tiles' KV
# ranges; the lower tile skips the one it cannot see), results runs 109-110,
# causal forward TFLOPS against the plain variant timed in turn: hd256 8k
# 708 / 688 against 665 / 670, 4k and 16k within the spread; hd128 4k 517 /
# 538 against 556 / 551-552, 8k 586 / 606 against 594 / 611 (run 110's
# hd128 kernels with Q in registers on both sides). Not kept.
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
    # Chains per row in the softmax's max and sum (REDUCTION_PARTIALS). hd64
    # at seq 1k, 4 chains against 1, results runs 112 / 114 / 116, forward
    # TFLOPS non-causal 366 / 381 / 358 against 380 / 373 / 370, causal 281 /
    # 280 / 286 against 283 / 284 / 287.
    reduction_partials: int = 1


# With few KV tiles per query tile, the CTA's prologue (Q and the first K/V
# loads) and epilogue (O out through shared memory) take much of its time;
# one consumer warpgroup (64-row tiles) and several CTAs per SM let one
# CTA's prologue and epilogue run under the others' GEMMs.
# H100, bf16, 16 heads, 16k tokens, forward TFLOPS, cuDNN in the same run
# (results run 30): hd64 causal 1024 259 (0.97x) against 228-229 with two
# consumers (run 27: 228 against 202-208 with three); causal 2048 332
# (0.96x) against 293-310; non-causal 1024 378 (0.97x) against 362-363;
# they lose at non-causal 2048 (389 against 439-445) and causal 4096 (368
# against 373). 64-key tiles with four stages were slower everywhere (249,
# 302, 328), and so was hd128 with one consumer and 64-key tiles. Run 31,
# shipped: causal 1024 260 (cuDNN 281), causal 2048 321 (cuDNN 345),
# non-causal 1024 368 (cuDNN 388). Run 32: three stages no different (258,
# 331, 370 against 259, 323-329, 365-376), 96-key tiles slower.
# A persistent grid instead (one CTA per SM walking the tiles longest first,
# the K / V pipeline running on from tile to tile, O through its own buffer
# at hd64 / hd96 / hd128 at 2 stages; branch fwd-persistent, results run
# 48) was slower everywhere: hd128 non-causal 1024 329 against 507-529
# TFLOPS, 8192 573 against 626-630; hd64 8192 394 against 475-477; hd256
# 8192 620 against 654-683. Its tile order ran heads fastest, so the CTAs
# in flight each streamed another head's K / V instead of sharing it in L2;
# With this grid's order (query tiles fastest; run 50) it came closer and
# still lost: hd128 8192 596 / 532 against 607-620 / 564-568, hd64 8192
# 432 / 402 against 474-481 / 422-434, hd128 causal 1024 295 against
# 355-358. Not kept.
# Persistent again (results run 101: 132 CTAs taking the launch order's
# tiles in rounds, odd rounds backwards, three stages kept by storing O from
# registers), against 2e4e659 timed before and after, seq 1024 / 8192
# non-causal / causal: hd128 502 / 642 and 383 / 524 against 504-506 /
# 642-659 and 356-370 / 595-608; hd64 8192 488 / 417 against 489-510 /
# 468-469; hd256 539 / 699 and 386 / 608 against 569-577 / 748-751 and
# 425-426 / 662-672. Not kept (docs/history.md).
# Three CTAs per SM (64-key tiles; 80 launch registers per thread, 136 for
# the consumer), results run 64, seq 1024 / 2048, forward TFLOPS against
# the two-CTA variant above timed before and after: 3 stages causal 277 /
# 325 against 256-258 / 312-331, non-causal 1024 360 against 355-363; 2
# stages 278 / 320 and 344; 96-key tiles, 2 stages (76 bytes spilled) 252
# / 297 and 335. Shipped at 64 x 3 stages x 3 CTAs; run 65: causal 285 /
# 344 (1.03 / 1.01x cuDNN), non-causal 1024 360 (0.94x).
# Run further (up to seqlen_q 8192 causal-like, 4096 otherwise; run 66,
# two timings each) it ties at causal 4096 (362 / 371 against 359 / 370)
# and loses at non-causal 2048 / 4096 (404 / 378 and 392 / 406 against
# 442-445 and 463-466) and causal 8192 (381 / 393 against 427-431).
# The 192-row tiles at causal 4096 ran 372 then, 390-408 once their spare
# rows went before row 0 and their warpgroups skipped the KV tiles right of
# their rows (results run 78), so the threshold stays at 2048.
# Run 96, seq 1024 non-causal / causal and 2048 causal, against 363-369 /
# 279-280 and 331-354 shipped (cuDNN 381-388 / 275-281 / 338-341): one
# consumer at 2 CTAs per SM with 128-key tiles and 2 stages 354 / 253 / 311;
# two consumers at one CTA per SM, 128 x 4 stages 345 / 228 / 297.
# Since the plain hd64 kernel's reductions run as four chains (0ce39c0), it
# overtakes this variant at non-causal 1024 (results runs 118-119, the plain
# kernel exported under this variant's name, against the shipped build in
# turn, forward TFLOPS, median [range] of 3 + 4 rounds, cuDNN 388-391):
# non-causal 1024 391 [390-395] and 391 [367-392] against 370 [362-375] and
# 374 [365-384]; 768 369 [367-370] against 363 [359-374]; 512 304 against
# 332; causal 512 / 768 / 1024 / 1536 / 2048 164 / 222 / 253 / 310 / 353
# against 217 / 263 / 294 / 323 / 357. So non-causal stops at 768. Run 125,
# with the shipped build timed twice per round (the same kernels moved by 4%
# between libraries in run 118), non-causal 896 / 1024: 388 / 392 and 387 /
# 391 against 381 / 383 for this variant exported as the plain kernel.
SHORT_TILE = {
    64: ShortTile(tile_n=64, consumers=1, kv_stages=3, ctas_per_sm=3, max_seqlen_q_causal=2048,
                  max_seqlen_q=768),
}

# (head_dim, head_dim_v) pairs exported with paged K / V (call_paged): the
# head dims of serving models; their tiles are TILE_CONFIG's, whose tile_n
# are multiples of paged_kv.PAGE_BOX.
PAGED = ((64, 64), (128, 128), (256, 256))
