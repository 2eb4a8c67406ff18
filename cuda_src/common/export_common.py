"""What every family's export.py does the same way: fake tensors with
symbolic extents, the compile-and-export loop, and the X-macro header that
tells launch.cc which variants exist.

Importing cutlass here is deferred to the functions: the DSL fixes its
target architecture when cutlass is first imported, and export.py must set
CUTE_DSL_ARCH before that happens.
"""

import argparse
import os
import time
from typing import Callable, Iterable, List, Sequence, Tuple

ROW_MAJOR_3D = (2, 1, 0)
ROW_MAJOR_4D = (3, 2, 1, 0)  # [B, T, N, H]: the last mode is the fastest
VECTOR_ALIGN = 16  # the kernels move 16 bytes per cp.async / vector store
SCALAR_ALIGN = 4
# The head dims of the sm80 families (fwd_sm80, bwd_sm80), the GPU's in
# jax_flash/_configs.py (tests/test_kernel_build.py checks that they agree).
SM80_HEAD_DIMS = (64, 96, 128, 192, 256)


def parse_export_args(doc: str, arches: Sequence[str], only_help: str, argv=None,
                      extra=()) -> argparse.Namespace:
    """extra: (flag, add_argument keywords) pairs of family-specific flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=arches)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--only", default="", help=only_help)
    for flag, options in extra:
        parser.add_argument(flag, **options)
    args = parser.parse_args(argv)
    # The DSL picks its target when cutlass is first imported; on a machine
    # without a GPU it would otherwise default to sm_100a.
    os.environ["CUTE_DSL_ARCH"] = args.arch
    return args


class FakeProblem:
    """Fake tensors for cute.compile whose dynamic extents are shared SymInts,
    so the compiled kernel knows that, e.g., q and o have the same seqlen_q
    while every extent stays a runtime value of the exported wrapper."""

    def __init__(self, head_dim: int):
        import cutlass.cute as cute

        self.head_dim = head_dim
        self.batch, self.seqlen_q, self.seqlen_k = cute.sym_int(), cute.sym_int(), cute.sym_int()
        self.heads_q, self.heads_kv = cute.sym_int(), cute.sym_int()

    def bthd(self, dtype, seqlen, heads, head_dim=None):
        """[batch, seqlen, heads, head_dim], row-major; head_dim defaults to
        the problem's (V and O take head_dim_v)."""
        from cutlass.cute.runtime import make_fake_compact_tensor

        shape = (self.batch, seqlen, heads, head_dim or self.head_dim)
        return make_fake_compact_tensor(dtype, shape, stride_order=ROW_MAJOR_4D, assumed_align=VECTOR_ALIGN)

    def per_head_row(self, assumed_align: int):
        """Float32 [batch, heads_q, seqlen_q] (lse, delta), row-major."""
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor

        return make_fake_compact_tensor(
            cutlass.Float32, (self.batch, self.heads_q, self.seqlen_q),
            stride_order=ROW_MAJOR_3D, assumed_align=assumed_align,
        )

    def lens(self):
        """Int32 [batch]: valid query or key count per batch entry."""
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor

        return make_fake_compact_tensor(cutlass.Int32, (self.batch,), assumed_align=SCALAR_ALIGN)

    def dq_semaphore(self):
        """Int32 [batch, heads_q, query tiles]: the deterministic backward's turns."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        return make_fake_compact_tensor(
            cutlass.Int32, (self.batch, self.heads_q, cute.sym_int()),
            stride_order=ROW_MAJOR_3D, assumed_align=SCALAR_ALIGN,
        )

    def segment_ids(self, seqlen):
        """Int32 [batch, seqlen], row-major."""
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor

        return make_fake_compact_tensor(
            cutlass.Int32, (self.batch, seqlen), stride_order=(1, 0), assumed_align=SCALAR_ALIGN
        )

    def segment_bounds(self, seqlen):
        """Int32 [batch, seqlen, 2]: per position, the [first, last) range it can see."""
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor

        return make_fake_compact_tensor(
            cutlass.Int32, (self.batch, seqlen, 2), stride_order=ROW_MAJOR_3D, assumed_align=SCALAR_ALIGN
        )


def export_variants(out_dir: str, variants: Iterable[Tuple[str, Callable[[], object]]]) -> List[str]:
    """cute.compile each (name, compile_fn) and export it as out_dir/name.{o,h}
    with every symbol prefixed by name, so that all variants of all families
    and arches link into one library. Returns the names exported."""
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for name, compile_fn in variants:
        start = time.perf_counter()
        compile_fn().export_to_c(file_path=out_dir, file_name=name, function_prefix=name)
        print(f"{name}: compiled and exported in {time.perf_counter() - start:.1f} s", flush=True)
        names.append(name)
    return names


def write_variants_header(
    path: str,
    generator: str,
    guard: str,
    include_names: Sequence[str],
    macros: Sequence[Tuple[str, str, Sequence[str]]],
) -> None:
    """Write the header launch.cc includes: every variant's export_to_c header
    and, per (comment, macro name, X arguments) in macros, an X-macro

        #define MACRO(X) X(args of variant 1) X(args of variant 2) ...

    so that launch.cc can stamp out one launcher per variant and a lookup over
    them without naming any variant itself."""
    lines = [f"// Generated by {generator}. Do not edit.", f"#ifndef {guard}", f"#define {guard}", ""]
    lines += [f'#include "{name}.h"' for name in include_names]
    for comment, macro, x_args in macros:
        lines += ["", f"// {comment}", f"#define {macro}(X)" + "".join(f" \\\n  X({a})" for a in x_args)]
    lines += ["", f"#endif  // {guard}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
