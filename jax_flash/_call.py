"""The description of one attention call, built once from the user's
arguments and carried unchanged from the API to the kernel launch.

* ``Mask``: which keys each query row sees, as structure (static): the
  diagonal and the window. ``causal`` becomes a window here, once.
* ``KernelCall``: the static part of the call (hashable: a custom_vjp and
  custom_partitioning static argument): the backend serving it, the scale,
  the ``Mask``, the softcap and the flags.
* ``MaskOperands``: the mask's arrays (lengths, packed documents), a pytree
  in the layout of kernel_api.h. The sinks travel beside it
  (``sink_operand``): they are the one differentiable operand.

``_plan.py`` turns a description into what each kernel call needs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Mask:
  """Query row ``i`` sees key ``j`` when ``i + diag_offset - window_left <=
  j <= i + diag_offset + window_right``; a side of -1 is unbounded. The
  lengths and documents (``MaskOperands``) mask further."""

  diag_offset: int = 0
  window_left: int = -1
  window_right: int = -1

  @classmethod
  def of(cls, *, causal: bool, window: tuple[int, int], diag_offset: int = 0) -> "Mask":
    """``window`` (validation.check_window's pair) narrowed by ``causal`` to
    no key right of the diagonal."""
    left, right = window
    if causal:
      right = 0 if right < 0 else min(right, 0)
    return cls(diag_offset, left, right)

  @property
  def windowed(self) -> bool:
    """Whether the diagonal bounds some side (causal included)."""
    return self.window_left >= 0 or self.window_right >= 0

  def all_keys_visible(self, seq_q: int, seq_k: int) -> bool:
    """Whether every one of ``seq_q`` rows sees every one of ``seq_k`` keys
    under the diagonal and window."""
    left_free = self.window_left < 0 or self.window_left >= seq_q - 1 + self.diag_offset
    right_free = self.window_right < 0 or self.diag_offset + self.window_right >= seq_k - 1
    return left_free and right_free


UNMASKED = Mask()


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """The static part of one kernel call (hashable)."""

  backend: str  # "cpu", "gpu" or "xla" (reference.py's composition behind the same interface)
  scale: float
  mask: Mask = UNMASKED
  softcap: float = 0.0  # > 0: logits are softcap * tanh(logit / softcap)
  deterministic: bool = False  # backward: bitwise reproducible dQ
  batch_invariant: bool = False  # forward: key splits independent of the batch (kv_split.py)
  # Where the GPU's shared memory is too small for the backward's tiles
  # (_gpu_support.py): run XLA's backward, or the reason to raise when traced.
  backward_on_xla: bool = False
  backward_unavailable: str = ""

  def attributes(self, direction: str) -> dict:
    """The FFI handlers' attributes (cuda_src/ffi/attention_ffi.h)."""
    attrs = dict(scale=np.float32(self.scale), diag_offset=np.int32(self.mask.diag_offset),
                 window_left=np.int32(self.mask.window_left),
                 window_right=np.int32(self.mask.window_right), softcap=np.float32(self.softcap))
    if direction == "bwd":
      attrs["deterministic"] = np.int32(self.deterministic)
    return attrs

  def reference_args(self) -> dict:
    """The mask and logit arguments of reference.py's functions."""
    return dict(scale=self.scale, softcap=self.softcap, **dataclasses.asdict(self.mask))

  def with_mask(self, mask: Mask) -> "KernelCall":
    return dataclasses.replace(self, mask=mask)


@dataclasses.dataclass(frozen=True)
class PerPlatform:
  """What serves one call on each platform it may be lowered for.

  The kernels are chosen when the computation is lowered, not when it is
  traced: ``jax.export`` lowers one trace for every platform it is asked
  for, whatever devices the exporting host has (``lax.platform_dependent``
  stages each branch; lowering keeps those of its platforms). ``cpu`` and
  ``cuda`` hold the KernelCall that serves the problem there, or the reason
  none may (``implementation="flash"``), which lowering for that platform
  raises as NotImplementedError; other platforms get ``other``, the XLA
  composition or a reason.
  """

  cpu: KernelCall | str
  cuda: KernelCall | str
  other: KernelCall | str


def runs_kernels(call: KernelCall | PerPlatform) -> bool:
  """Whether ``call`` may run a kernel on some platform."""
  return not (isinstance(call, KernelCall) and call.backend == "xla")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskOperands:
  """The mask's arrays as the kernels take them (kernel_api.h), with any
  leading batch dims ``[...]``: lengths ``[...]``, segment ids ``[..., T]`` /
  ``[..., S]`` and document bounds flattened to ``[..., 2T]`` / ``[..., 2S]``;
  the four document arrays have a last dim of 0 without packed documents."""

  q_lens: jax.Array
  kv_lens: jax.Array
  q_ids: jax.Array
  kv_ids: jax.Array
  kv_bounds: jax.Array
  q_bounds: jax.Array

  @classmethod
  def build(cls, batch_dims: tuple, q_lens, kv_lens, q_ids=None, kv_ids=None, bounds=None):
    """``bounds``: segments.segment_bounds' pair, or None where no kernel
    skips tiles by them (then empty)."""
    empty = jnp.zeros((*batch_dims, 0), jnp.int32)
    if q_ids is None:
      return cls(q_lens, kv_lens, empty, empty, empty, empty)
    if bounds is None:
      return cls(q_lens, kv_lens, q_ids, kv_ids, empty, empty)
    flat = lambda x: x.reshape(*x.shape[:-2], -1)
    kv_bounds, q_bounds = bounds
    return cls(q_lens, kv_lens, q_ids, kv_ids, flat(kv_bounds), flat(q_bounds))

  @property
  def has_segments(self) -> bool:
    return self.q_ids.shape[-1] > 0

  def leaves(self) -> tuple:
    return (self.q_lens, self.kv_lens, self.q_ids, self.kv_ids, self.kv_bounds, self.q_bounds)


# The number of arrays of a MaskOperands (the flat operand lists of _sharding).
MASK_ARRAYS = len(dataclasses.fields(MaskOperands))


def whole_lengths(batch: int, seq: int) -> np.ndarray:
  """Lengths that cover every row: the kernels read a length at or past the
  sequence as the whole of it. Distinct values (seq, seq + 1, ...) keep the
  array a constant of the executable; one value repeated, XLA turns it into
  a broadcast, a kernel launched on every call (H100, 16 heads, 16k tokens,
  seq 1024: 1.0-3.6 us, 0.5-1.6% of the forward)."""
  if seq + batch > np.iinfo(np.int32).max:  # past int32: no executable this large runs anyway
    return np.full(batch, seq, np.int32)
  return np.arange(seq, seq + batch, dtype=np.int32)


def sink_operand(sinks, q):
  """float32 ``[heads_q]`` sinks (or None) as the forward's operand ``[...,
  heads_q, 1]`` (``[..., heads_q, 0]`` without): one per batch entry, so
  that it shards and maps like the lse."""
  if sinks is None:
    return jnp.zeros((*q.shape[:-3], q.shape[-2], 0), jnp.float32)
  return jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[:, None],
                          (*q.shape[:-3], q.shape[-2], 1))
