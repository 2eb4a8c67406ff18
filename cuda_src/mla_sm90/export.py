"""Ahead-of-time export of the MLA decode kernel (kernel.py) to C objects.

    python -m cuda_src.mla_sm90.export --arch sm_90a --out DIR

writes DIR/jf_mla90_<arch>_<dtype>.{o,h} for the bfloat16 and float16
caches (kernel.py) and DIR/jf_mla90_<arch>_fp8.{o,h} for the FP8 cache
(kernel_fp8.py), and DIR/mla_sm90_variants_<arch>.h, which includes them
and defines

    JF_MLA_SM90_VARIANTS_SM_90A(X)      ->  X(arch, JfDtype, prefix) ...
    JF_MLA_SM90_FP8_VARIANTS_SM_90A(X)  ->  X(arch, prefix)   (none or one)

for launch.cc. Every extent but the 64-token page and the 576 / 512 / 64
columns is a runtime value of the exported wrapper.
"""

import pathlib

from ..common.export_common import (
    ROW_MAJOR_3D, SCALAR_ALIGN, VECTOR_ALIGN, export_variants, parse_export_args,
    write_variants_header,
)

ARCHES = ("sm_90a",)
DTYPES = (("fp16", "JF_FLOAT16", "Float16"), ("bf16", "JF_BFLOAT16", "BFloat16"))


def variant_name(arch: str, dtype_tag: str) -> str:
    return f"jf_mla90_{arch}_{dtype_tag}"


def _fake_args(dtype):
    """__call__'s operands with symbolic extents: batch, rows (s_q * heads),
    pages, outputs (batch * splits) and the table's width."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from .kernel import HEAD_DIM, LATENT, PAGE

    batch, rows, pages, outputs = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    tensor = lambda dt, shape, order, align: make_fake_compact_tensor(
        dt, shape, stride_order=order, assumed_align=align)
    q = tensor(dtype, (batch, rows, HEAD_DIM), ROW_MAJOR_3D, VECTOR_ALIGN)
    cache = tensor(dtype, (pages, PAGE, HEAD_DIM), ROW_MAJOR_3D, VECTOR_ALIGN)
    o = tensor(dtype, (outputs, rows, LATENT), ROW_MAJOR_3D, VECTOR_ALIGN)
    lse = tensor(cutlass.Float32, (outputs, rows), (1, 0), SCALAR_ALIGN)
    table = tensor(cutlass.Int32, (batch, cute.sym_int()), (1, 0), SCALAR_ALIGN)
    lens = lambda: tensor(cutlass.Int32, (batch,), (0,), SCALAR_ALIGN)
    return (q, cache, o, lse, table, lens(), lens(), cutlass.Float32(1.0), cutlass.Int32(1),
            cutlass.Int32(1), cutlass.runtime.make_fake_stream())


def _fake_fp8_args():
    """kernel_fp8's operands: the quantised queries (codes, scales, RoPE),
    the cache's three arrays, then kernel.py's."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from .kernel import LATENT, PAGE
    from .kernel_fp8 import ROPE

    batch, rows, pages, outputs = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    tensor = lambda dt, shape, order, align: make_fake_compact_tensor(
        dt, shape, stride_order=order, assumed_align=align)
    fp8, bf16, f32 = cutlass.Float8E4M3FN, cutlass.BFloat16, cutlass.Float32
    q = tensor(fp8, (batch, rows, LATENT), ROW_MAJOR_3D, VECTOR_ALIGN)
    q_scales = tensor(f32, (batch, rows), (1, 0), SCALAR_ALIGN)
    q_rope = tensor(bf16, (batch, rows, ROPE), ROW_MAJOR_3D, VECTOR_ALIGN)
    latent = tensor(fp8, (pages, PAGE, LATENT), ROW_MAJOR_3D, VECTOR_ALIGN)
    scales = tensor(f32, (pages, PAGE), (1, 0), VECTOR_ALIGN)
    rope = tensor(bf16, (pages, PAGE, ROPE), ROW_MAJOR_3D, VECTOR_ALIGN)
    o = tensor(bf16, (outputs, rows, LATENT), ROW_MAJOR_3D, VECTOR_ALIGN)
    lse = tensor(f32, (outputs, rows), (1, 0), SCALAR_ALIGN)
    table = tensor(cutlass.Int32, (batch, cute.sym_int()), (1, 0), SCALAR_ALIGN)
    lens = lambda: tensor(cutlass.Int32, (batch,), (0,), SCALAR_ALIGN)
    return (q, q_scales, q_rope, latent, scales, rope, o, lse, table, lens(), lens(),
            cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.runtime.make_fake_stream())


def main():
    args = parse_export_args(__doc__.splitlines()[0], ARCHES, "comma list of variant names")
    import cutlass
    import cutlass.cute as cute
    from .kernel import MlaDecodeSm90

    only = set(filter(None, args.only.split(",")))
    variants, built = [], []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        name = variant_name(args.arch, dtype_tag)
        if only and name not in only:
            continue
        dtype = getattr(cutlass, cutlass_name)
        variants.append((name, lambda dtype=dtype: cute.compile(MlaDecodeSm90(dtype),
                                                                *_fake_args(dtype))))
        built.append(f"{args.arch}, {enum_name}, {name}")
    fp8_built = []
    fp8_name = variant_name(args.arch, "fp8")
    if not only or fp8_name in only:
        from .kernel_fp8 import MlaDecodeFp8Sm90
        variants.append((fp8_name, lambda: cute.compile(MlaDecodeFp8Sm90(), *_fake_fp8_args())))
        fp8_built.append(f"{args.arch}, {fp8_name}")
    names = export_variants(args.out, variants)
    arch_macro = args.arch.upper()
    write_variants_header(
        str(pathlib.Path(args.out) / f"mla_sm90_variants_{args.arch}.h"),
        generator="cuda_src/mla_sm90/export.py",
        guard=f"JAX_FLASH_MLA_SM90_VARIANTS_{arch_macro}_H_",
        include_names=names,
        macros=[(f"X(arch, JfDtype, prefix) for every exported {args.arch} MLA decode variant.",
                 f"JF_MLA_SM90_VARIANTS_{arch_macro}", built),
                (f"X(arch, prefix) for the exported {args.arch} FP8-cache MLA decode variant.",
                 f"JF_MLA_SM90_FP8_VARIANTS_{arch_macro}", fp8_built)],
    )


if __name__ == "__main__":
    main()
