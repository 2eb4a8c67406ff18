"""Ahead-of-time export of the MLA decode kernel (kernel.py) to C objects.

    python -m cuda_src.mla_sm90.export --arch sm_90a --out DIR

writes DIR/jf_mla90_<arch>_<dtype>.{o,h} for bfloat16 and float16 and
DIR/mla_sm90_variants_<arch>.h, which includes them and defines

    JF_MLA_SM90_VARIANTS_SM_90A(X)  ->  X(arch, JfDtype, prefix) ...

for launch.cc. Every extent but the 64-token page and the 576 / 512
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
    names = export_variants(args.out, variants)
    arch_macro = args.arch.upper()
    write_variants_header(
        str(pathlib.Path(args.out) / f"mla_sm90_variants_{args.arch}.h"),
        generator="cuda_src/mla_sm90/export.py",
        guard=f"JAX_FLASH_MLA_SM90_VARIANTS_{arch_macro}_H_",
        include_names=names,
        macros=[(f"X(arch, JfDtype, prefix) for every exported {args.arch} MLA decode variant.",
                 f"JF_MLA_SM90_VARIANTS_{arch_macro}", built)],
    )


if __name__ == "__main__":
    main()
