import importlib.util
import os
import pathlib
import sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _api as api


def _import_kernel_sources():
  """Makes the build-time package cuda_src of this checkout importable (the
  wheel does not install it) without putting the repository root on
  sys.path, where its jax_flash/ would hide the installed package that CI
  tests."""
  package = pathlib.Path(__file__).resolve().parents[1] / "cuda_src"
  spec = importlib.util.spec_from_file_location(
      "cuda_src", package / "__init__.py", submodule_search_locations=[str(package)])
  module = importlib.util.module_from_spec(spec)
  sys.modules["cuda_src"] = module
  spec.loader.exec_module(module)


_import_kernel_sources()


# JAX keeps every compiled program (up to about 300 MB for a reference check
# on a CPU) and the suite compiles hundreds; tests share many of them (the
# same reference at the same shapes), so the caches are dropped only when the
# process grows past this, which keeps the quick suite well under 4 GB.
CACHE_LIMIT_BYTES = 2 << 30


def resident_bytes() -> int | None:
  try:
    with open("/proc/self/statm") as statm:
      return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError):  # not Linux: no cheap reading
    return None


@pytest.fixture(autouse=True)
def _free_compiled_programs():
  yield
  resident = resident_bytes()
  if resident is None or resident > CACHE_LIMIT_BYTES:
    jax.clear_caches()


def gpu_unavailable_reason() -> str | None:
  if jax.default_backend() != "gpu":
    return "no CUDA GPU visible to JAX"
  return api._gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
  # The quick suite by default: the long CPU sweeps run only when asked for
  # (`-m slow`, or any other -m expression, which then decides alone).
  if not config.getoption("markexpr"):
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
      config.hook.pytest_deselected(items=slow)
      items[:] = [item for item in items if "slow" not in item.keywords]
  reason = gpu_unavailable_reason()
  if reason is None:
    return
  skip = pytest.mark.skip(reason=f"GPU test: {reason}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_report_header(config):
  return (f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"jax_flash CUDA kernels: {jax_flash.cuda_kernels_available()}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")


def pytest_generate_tests(metafunc):
  """Parametrises ``dtype`` / ``head_dim`` from the backend test class."""
  cls = metafunc.cls
  if cls is None:
    return
  if "dtype" in metafunc.fixturenames:
    metafunc.parametrize("dtype", cls.dtypes, ids=[jnp.dtype(d).name for d in cls.dtypes])
  if "head_dim" in metafunc.fixturenames:
    metafunc.parametrize("head_dim", cls.head_dims, ids=[f"hd{h}" for h in cls.head_dims])
