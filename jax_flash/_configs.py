"""What each backend supports, as data.

The tile shapes of the GPU kernels live next to the kernels
(``cuda_src/*/kernel.py``), with the measurements that chose them; this table
is what the Python side needs to route a call.
"""

import dataclasses

import numpy as np
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BackendSupport:
  """The inputs one kernel backend accepts."""

  name: str
  dtypes: tuple[np.dtype, ...]
  head_dims: tuple[int, ...] | None  # None: any head dim up to max_head_dim
  max_head_dim: int
  # False: any head_dim_v up to max_head_dim. True: head_dim_v <= head_dim,
  # served with V zero-padded to head_dim (exact: the padded columns of O are
  # zeros and are cut off) at the cost of the wider P V product, but where a
  # Hopper kernel of those head dims exists (the library says: _plan.py).
  pads_head_dim_v: bool
  # GQA query heads are packed into one sequence below this many queries
  # (head_packing.py): the query rows of one forward tile (CPU: up to head
  # dim 128).
  query_tile_rows: int
  # A forward with fewer CTAs than this splits its keys (kv_split.py); 0:
  # never (the CPU kernels parallelise over their own tasks); None: one wave
  # of the device, its SM count (_gpu_support.split_target).
  kv_split_ctas: int | None

  def unsupported_reason(self, dtype, head_dim: int, head_dim_v: int) -> str | None:
    """Why this backend cannot run the problem, or None when it can."""
    if np.dtype(dtype) not in self.dtypes:
      names = ", ".join(np.dtype(d).name for d in self.dtypes)
      return f"the {self.name} kernels support dtypes {names}, got {np.dtype(dtype).name}"
    if self.head_dims is not None and head_dim not in self.head_dims:
      return f"the {self.name} kernels support head_dim in {self.head_dims}, got {head_dim}"
    for label, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
      if dim > self.max_head_dim:
        return f"the {self.name} kernels support {label} <= {self.max_head_dim}, got {dim}"
    if self.pads_head_dim_v and head_dim_v > head_dim:
      return (f"the {self.name} kernels need head_dim_v <= head_dim, got head_dim={head_dim}, "
              f"head_dim_v={head_dim_v}")
    return None

  def value_padding(self, head_dim: int, head_dim_v: int) -> int:
    """Zero columns to append to V (and cut from O, or dV) for the kernels
    that need V as wide as K."""
    return head_dim - head_dim_v if self.pads_head_dim_v else 0


# The head dims (head_dim == head_dim_v) of the Hopper paged forward
# (cuda_src/fwd_sm90/tile_config.py: PAGED).
PAGED_HEAD_DIMS = (64, 128, 256)

# CUDA's limit on a grid's y and z dimensions, which the kernels give to
# batch entries (times key splits) and heads.
MAX_GRID_YZ = 65535


CPU = BackendSupport(
    name="cpu",
    dtypes=(np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)),
    head_dims=None,
    max_head_dim=512,
    pads_head_dim_v=False,
    query_tile_rows=64,
    kv_split_ctas=0,
)

# The FlashAttention-2-style CuTe DSL kernels (cuda_src/fwd_sm80, bwd_sm80),
# exported for sm_80 and sm_90a, and the Hopper kernels (fwd_sm90, bwd_sm90).
# A smaller V head dim runs padded, but for DeepSeek's 192 / 128 on Hopper
# (cuda_src/fwd_sm90/tile_config.py, cuda_src/bwd_sm90/tile_config.py).
GPU = BackendSupport(
    name="gpu",
    dtypes=(np.dtype(jnp.float16), np.dtype(jnp.bfloat16)),
    head_dims=(64, 96, 128, 192, 256),
    max_head_dim=256,
    pads_head_dim_v=True,
    query_tile_rows=128,
    kv_split_ctas=None,
)

BACKENDS = {"cpu": CPU, "gpu": GPU}

# Shared memory per block of the sm_80 kernels, in bytes, by head dim: the
# forward's Q, K and V tiles (cuda_src/fwd_sm80/kernel.py TILE_CONFIG) and
# two int32 per warp, and FlashBwdSm80.smem_bytes (cuda_src/bwd_sm80/
# kernel.py). tests/test_kernel_build.py recomputes them from the kernels;
# _gpu_support.py routes GPUs with less.
SM80_SHARED_MEMORY = {
    "forward": {64: 49184, 96: 49184, 128: 65568, 192: 98368, 256: 131136},
    "backward": {64: 99328, 96: 132096, 128: 164864, 192: 164864, 256: 139776},
}
