"""Finds the CUDA headers and static runtime that the pip packages
nvidia-cuda-runtime, nvidia-cuda-crt and nvidia-cuda-cccl installed (the
build requirements of pyproject.toml), for cmake/cuda_kernels.cmake.

Prints a CMake list: the runtime's version, libcudart_static.a, then the
include folders. Looks the files up in each package's own file list, so
it finds them wherever pip put them and never strays into a system CUDA
toolkit. Exits non-zero, saying which package is missing, otherwise.
"""

import importlib.metadata
import pathlib
import sys

# package -> a file it must provide, found as a path ending.
#  runtime: the headers cuda_runtime.h, cuda.h, ... and the static runtime;
#  crt: crt/host_config.h and the like, which cuda_runtime.h includes;
#  cccl: nv/target, which cuda_fp16.h (included by the exported kernels'
#        headers) includes.
WANTED = {
    "nvidia-cuda-runtime": ("include/cuda_runtime.h", "lib/libcudart_static.a"),
    "nvidia-cuda-crt": ("include/crt/host_config.h",),
    "nvidia-cuda-cccl": ("include/nv/target",),
}


def find(package: str, ending: str) -> pathlib.Path:
  try:
    dist = importlib.metadata.distribution(package)
  except importlib.metadata.PackageNotFoundError:
    sys.exit(f"the pip package {package} is not installed")
  for entry in dist.files or ():
    if str(entry).replace("\\", "/").endswith(ending):
      path = pathlib.Path(dist.locate_file(entry)).resolve()
      if path.is_file():
        return path
  sys.exit(f"the pip package {package} {dist.version} holds no {ending}")


def main() -> None:
  includes = []
  for package, endings in WANTED.items():
    for ending in endings:
      path = find(package, ending)
      if ending.startswith("lib/"):
        library = path
      else:
        # The include folder: the path less the header's own part.
        folder = str(path)[:-len(ending.split("/", 1)[1]) - 1]
        if folder not in includes:
          includes.append(folder)
  version = importlib.metadata.version("nvidia-cuda-runtime")
  print(";".join([version, str(library), *includes]), end="")


if __name__ == "__main__":
  main()
