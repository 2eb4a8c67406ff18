"""Which NVIDIA GPUs the compiled kernels run on.

libjax_flash_cuda.so holds machine code (cubins, no PTX to compile at run
time) for two targets: sm_80, which runs on every GPU of compute capability
8.x (A100, A10, RTX 30xx, L4, L40, RTX 40xx, Jetson Orin), and sm_90a, which
runs on 9.0 only (H100, H200, GH200). On any other GPU -- below 8.0 (V100,
T4) or newer (10.x: B200, GB200, B300; 12.x: RTX 50xx, RTX PRO 6000, DGX
Spark) -- the kernels' modules would fail to load at the first launch, so
``api.select_backend`` routes such calls away before that: to XLA with
``implementation=None``, to a NotImplementedError that names the GPU with
``implementation="flash"`` or ``"gpu"``.

On 8.6 and 8.9 a block has less shared memory than on 8.0, too little for
some of the sm_80 kernels' tiles (configs.SM80_SHARED_MEMORY): calls whose
forward cannot launch there are routed the same way, and a backward that
cannot runs XLA's backward with ``implementation=None`` (the forward keeps
the kernel) or raises with ``"flash"`` / ``"gpu"`` when it is traced.

Only the first GPU is looked at (as ``ffi.gpu_compute_capability`` does).
Its facts are known while tracing, with no host synchronisation: whether
the Hopper kernels serve it (``is_hopper``, which ``_plan`` asks once per
kernel call) and its SM count (``split_target``).
"""

import functools

import jax

from jax_flash import _configs as configs, _ffi as ffi

# The compiled targets, in words. Keep in step with the rule below and with
# the architectures cmake/cuda_kernels.cmake exports (JF_FAMILY_ARCHS_*).
_TARGETS = "compute capability 8.x (sm_80) and 9.0 (sm_90a)"


def capability_unsupported_reason(capability: tuple[int, int], device_kind: str) -> str | None:
  """Why the kernels cannot run on a GPU of this compute capability, or None."""
  major, minor = capability
  if major == 8 or capability == (9, 0):
    return None
  return (f"the GPU kernels are compiled for {_TARGETS}; {device_kind} has compute capability "
          f"{major}.{minor}")


# Shared memory one block may opt into where a compute capability has less
# than the sm_80 kernels' tiles take (the CUDA C++ programming guide's table
# of technical specifications): 8.6 and 8.9, that is RTX 30xx / 40xx, A10,
# A40, L4, L40. 8.0 and 8.7 have 163 KiB, 9.0 227 KiB.
_SHARED_MEMORY_PER_BLOCK = {(8, 6): 99 * 1024, (8, 9): 99 * 1024}


def shared_memory_reason(capability, direction: str, head_dim: int) -> str | None:
  """Why the sm_80 ``direction`` ("forward" or "backward") kernel for
  ``head_dim`` cannot launch on a GPU of this compute capability (its tiles
  take more shared memory than a block may have there), or None."""
  limit = _SHARED_MEMORY_PER_BLOCK.get(tuple(capability)) if capability else None
  need = configs.SM80_SHARED_MEMORY[direction].get(head_dim)
  if limit is None or need is None or need <= limit:
    return None
  return (f"the GPU {direction} kernel for head_dim {head_dim} takes {need} bytes of shared "
          f"memory per block; {gpu_device_kind()} (compute capability {capability[0]}."
          f"{capability[1]}) has {limit}")


def device_reason(direction: str, head_dim: int) -> str | None:
  """``shared_memory_reason`` for the first GPU, if this process has one."""
  return shared_memory_reason(ffi.gpu_compute_capability(), direction, head_dim)


def is_hopper() -> bool:
  """Whether the first GPU runs the sm_90a kernels (compute capability 9.x).
  Without a GPU (lowering for CUDA on another host) the plans are those of
  the other GPUs; the handlers pick the kernels again where they run."""
  return (ffi.gpu_compute_capability() or (0,))[0] == 9


# The SM count that a split aims at where no GPU is visible (lowering for
# CUDA on another host): an H100's and an H200's.
_DEFAULT_SM_COUNT = 132


def split_target(backend: str) -> int:
  """The CTAs a forward of ``backend`` aims at when it splits its keys
  (kv_split.parts): configs' fixed count, else one wave of the first GPU,
  its SM count (kv_split.py has the measurements)."""
  target = configs.BACKENDS[backend].kv_split_ctas
  return _sm_count() if target is None else target


@functools.cache
def _sm_count() -> int:
  try:
    sms = getattr(jax.devices("gpu")[0], "core_count", None)
  except RuntimeError:  # no GPU backend
    sms = None
  return sms or _DEFAULT_SM_COUNT


def gpu_device_kind() -> str:
  """The first GPU's name as JAX reports it, e.g. "NVIDIA H100 80GB HBM3"."""
  return jax.devices("gpu")[0].device_kind


def gpu_unavailable_reason() -> str | None:
  """Why calls cannot run on the GPU kernels here, or None if they can."""
  if not ffi.cuda_kernels_available():
    return ("this installation holds no CUDA kernels (it was built with JAX_FLASH_CUDA=OFF or on "
            "a platform other than Linux x86-64)")
  capability = ffi.gpu_compute_capability()
  if capability is None:
    return "no CUDA GPU is visible to JAX"
  return capability_unsupported_reason(capability, gpu_device_kind())
