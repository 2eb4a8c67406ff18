"""How long a causal grid takes in launch order, as a greedy-schedule model.

    python benchmarks/launch_order_model.py [--fixed-cost 3] [--sms 132]

The GPU starts CTAs in block-index order, each on the first multiprocessor
that frees up. The model gives every CTA a cost of `--fixed-cost` (prologue
and epilogue, in units of one KV or query tile iteration) plus the tiles the
causal mask lets it visit, schedules the grid greedily on `--sms`
multiprocessors (one CTA each) and prints the time over the ideal (total work
over the multiprocessors) for the plain order (head after head, each head's
longest tile first) and for the sectioned order of
cuda_src/common/launch_order.py, with the section size its L2 rule gives.
It models the tail of the grid only: no L2 effects, no tile-to-tile variance.
It predicted the forward's gain at 2k-16k (5-7%; measured 1-7%, results run
89) but not its loss at 1k (run 88), which came from L2.
"""

import argparse
import heapq
import math

L2_BUDGET_BYTES = 24 * 2**20  # cuda_src/common/launch_order.py
BF16 = 2
FP32 = 4
# head_dim -> (query rows, keys) per CTA tile: cuda_src/*_sm90/tile_config.py
FWD_TILES = {64: (192, 128), 128: (128, 128), 256: (128, 80)}
BWD_TILES = {64: (112, 128), 128: (80, 128), 256: (64, 64)}


def makespan(costs, sms: int) -> float:
  free_at = [0.0] * sms
  for cost in costs:
    heapq.heappush(free_at, heapq.heappop(free_at) + cost)
  return max(free_at)


def sectioned(costs_of_head: list, heads: int, size: int) -> list:
  """The tile costs of `heads` identical heads in the sectioned order."""
  size = max(min(size, heads), 1)
  first = heads - (math.ceil(heads / size) - 1) * size
  order, start, width = [], 0, first
  while start < heads:
    order += [cost for cost in costs_of_head for _ in range(width)]
    start, width = start + width, size
  return order


def tail(costs_of_head: list, heads: int, size: int, sms: int) -> tuple:
  ideal = sum(costs_of_head) * heads / sms
  plain = [cost for _ in range(heads) for cost in costs_of_head]
  return makespan(plain, sms) / ideal, makespan(sectioned(costs_of_head, heads, size), sms) / ideal


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--fixed-cost", type=float, default=3.0)
  parser.add_argument("--sms", type=int, default=132)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  args = parser.parse_args()
  print(f"{'pass':<5}{'hd':>4}{'seq':>7}{'section':>9}{'plain':>8}{'sectioned':>11}")
  for head_dim in (64, 128, 256):
    for seq in (1024, 2048, 4096, 8192, 16384):
      heads = args.heads * max(args.tokens // seq, 1)
      rows, keys = FWD_TILES[head_dim]
      fwd = [args.fixed_cost + math.ceil(min((m + 1) * rows, seq) / keys)
             for m in reversed(range(math.ceil(seq / rows)))]
      fwd_size = L2_BUDGET_BYTES // (2 * head_dim * BF16) // seq
      rows, keys = BWD_TILES[head_dim]
      bwd = [args.fixed_cost + math.ceil((seq - n * keys) / rows) for n in range(math.ceil(seq / keys))]
      bwd_size = L2_BUDGET_BYTES // (2 * head_dim * BF16 + (head_dim + 2) * FP32) // seq
      for name, costs, size in (("fwd", fwd, fwd_size), ("bwd", bwd, bwd_size)):
        plain, ordered = tail(costs, heads, size, args.sms)
        print(f"{name:<5}{head_dim:>4}{seq:>7}{max(size, 1):>9}{plain:>8.3f}{ordered:>11.3f}")


if __name__ == "__main__":
  main()
