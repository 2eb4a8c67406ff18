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
  same_head_dim_v: bool  # head_dim_v must equal head_dim

  def unsupported_reason(self, dtype, head_dim: int, head_dim_v: int) -> str | None:
    """Why this backend cannot run the problem, or None when it can."""
    if np.dtype(dtype) not in self.dtypes:
      names = ", ".join(np.dtype(d).name for d in self.dtypes)
      return f"the {self.name} kernels support dtypes {names}, got {np.dtype(dtype).name}"
    allowed = self.head_dims
    for label, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
      if allowed is not None and dim not in allowed:
        return f"the {self.name} kernels support {label} in {allowed}, got {dim}"
      if dim > self.max_head_dim:
        return f"the {self.name} kernels support {label} <= {self.max_head_dim}, got {dim}"
    if self.same_head_dim_v and head_dim_v != head_dim:
      return (f"the {self.name} kernels need head_dim_v == head_dim, got head_dim={head_dim}, "
              f"head_dim_v={head_dim_v}")
    return None


CPU = BackendSupport(
    name="cpu",
    dtypes=(np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)),
    head_dims=None,
    max_head_dim=512,
    same_head_dim_v=False,
)

# The FlashAttention-2-style CuTe DSL kernels (cuda_src/fwd_sm80, bwd_sm80),
# exported for sm_80 and sm_90a.
GPU = BackendSupport(
    name="gpu",
    dtypes=(np.dtype(jnp.float16), np.dtype(jnp.bfloat16)),
    head_dims=(64, 96, 128, 192, 256),
    max_head_dim=256,
    same_head_dim_v=True,
)

BACKENDS = {"cpu": CPU, "gpu": GPU}
