"""jax_flash's kernel sources, a package for the build only: the CuTe DSL
kernel families (one subpackage each) and the tools that export them ahead of
time, run from the repository root as modules, e.g.
``python -m cuda_src.export_kernels``. The wheel does not install it."""
