"""Ahead-of-time export of every FlashFwdSm80 variant to C objects.

    python -m cuda_src.fwd_sm80.export --arch sm_80 --out DIR

writes DIR/<name>.o and DIR/<name>.h per (dtype, head_dim) variant, plain
(jf_fwd_*), packed-document (jf_fwdseg_*, has_segments=True, which takes
the three segment tensors after the stream) and paged (jf_fwdpaged_*,
compiled from FlashFwdSm80.call_paged, which takes the page table and
split_pages after the stream), and DIR/fwd_sm80_variants_<arch>.h, which
includes them all and defines

    JF_FWD_SM80_VARIANTS_<ARCH>(X)        ->  X(arch, JfDtype, head_dim, prefix) ...
    JF_FWD_SM80_SEG_VARIANTS_<ARCH>(X)    ->  the same for the segment variants
    JF_FWD_SM80_PAGED_VARIANTS_<ARCH>(X)  ->  the same for the paged variants

for launch.cc. Scalars (scale, diag_offset, window_left, window_right) are
ordinary Float32/Int32 parameters: export_to_c passes them by value in the
generated `cute_dsl_<prefix>_wrapper`.
"""

import os

from ..common.export_common import (
    ROW_MAJOR_4D,
    SCALAR_ALIGN,
    VECTOR_ALIGN,
    SM80_HEAD_DIMS as HEAD_DIMS,
    FakeProblem,
    export_variants,
    parse_export_args,
    write_variants_header,
)

ARCHES = ("sm_80", "sm_90a")
DTYPES = (("fp16", "JF_FLOAT16", "Float16"), ("bf16", "JF_BFLOAT16", "BFloat16"))


def variant_name(arch: str, dtype_tag: str, head_dim: int, has_segments: bool,
                 paged: bool = False) -> str:
    family = "fwdpaged" if paged else "fwdseg" if has_segments else "fwd"
    return f"jf_{family}_{arch}_{dtype_tag}_hd{head_dim}"


def _fake_args(dtype, head_dim, has_segments):
    import cutlass

    fake = FakeProblem(head_dim)
    q = fake.bthd(dtype, fake.seqlen_q, fake.heads_q)
    k = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    v = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    o = fake.bthd(dtype, fake.seqlen_q, fake.heads_q)
    lse = fake.per_head_row(assumed_align=SCALAR_ALIGN)
    # scale, softcap, diag_offset, window_left, window_right
    scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(-1), cutlass.Int32(-1))
    args = (q, k, v, o, lse, fake.lens(), fake.lens(), *scalars, cutlass.runtime.make_fake_stream())
    if not has_segments:
        return args
    kv_bounds = fake.segment_bounds(fake.seqlen_q)
    return (*args, fake.segment_ids(fake.seqlen_q), fake.segment_ids(fake.seqlen_k), kv_bounds)


def _fake_paged_args(dtype, head_dim):
    """call_paged's operands: Q and the lengths per sequence, K / V as pages
    (their own extents), O / LSE per (sequence, split) and the page table."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    fake = FakeProblem(head_dim)
    pages, page_size, outputs = cute.sym_int(), cute.sym_int(), cute.sym_int()
    paged = lambda: make_fake_compact_tensor(
        dtype, (pages, page_size, fake.heads_kv, head_dim), stride_order=ROW_MAJOR_4D,
        assumed_align=VECTOR_ALIGN)
    o = make_fake_compact_tensor(dtype, (outputs, fake.seqlen_q, fake.heads_q, head_dim),
                                 stride_order=ROW_MAJOR_4D, assumed_align=VECTOR_ALIGN)
    lse = make_fake_compact_tensor(cutlass.Float32, (outputs, fake.heads_q, fake.seqlen_q),
                                   stride_order=(2, 1, 0), assumed_align=SCALAR_ALIGN)
    table = make_fake_compact_tensor(cutlass.Int32, (fake.batch, cute.sym_int()), stride_order=(1, 0),
                                     assumed_align=SCALAR_ALIGN)
    scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(-1), cutlass.Int32(-1))
    return (fake.bthd(dtype, fake.seqlen_q, fake.heads_q), paged(), paged(), o, lse,
            fake.lens(), fake.lens(), *scalars, cutlass.runtime.make_fake_stream(), table,
            cutlass.Int32(1))


def main():
    args = parse_export_args(__doc__, ARCHES, "comma list of variant names to build (debugging); default all")
    import cutlass
    import cutlass.cute as cute
    from .kernel import FlashFwdSm80

    only = set(args.only.split(",")) if args.only else None
    built = {False: [], True: []}
    variants = []
    for has_segments in (False, True):
        for dtype_tag, enum_name, cutlass_name in DTYPES:
            dtype = getattr(cutlass, cutlass_name)
            for head_dim in HEAD_DIMS:
                name = variant_name(args.arch, dtype_tag, head_dim, has_segments)
                if only is not None and name not in only:
                    continue
                variants.append((name, lambda d=dtype, h=head_dim, s=has_segments: cute.compile(
                    FlashFwdSm80(d, h, s), *_fake_args(d, h, s))))
                built[has_segments].append(f"{args.arch}, {enum_name}, {head_dim}, {name}")

    paged_built = []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        dtype = getattr(cutlass, cutlass_name)
        for head_dim in HEAD_DIMS:
            name = variant_name(args.arch, dtype_tag, head_dim, False, paged=True)
            if only is not None and name not in only:
                continue
            kernel = FlashFwdSm80(dtype, head_dim, paged_kv=True)
            variants.append((name, lambda kernel=kernel, d=dtype, h=head_dim: cute.compile(
                kernel.call_paged, *_fake_paged_args(d, h))))
            paged_built.append(f"{args.arch}, {enum_name}, {head_dim}, {name}")

    names = export_variants(args.out, variants)
    arch_macro = args.arch.upper()
    write_variants_header(
        os.path.join(args.out, f"fwd_sm80_variants_{args.arch}.h"),
        generator="cuda_src/fwd_sm80/export.py",
        guard=f"JAX_FLASH_FWD_SM80_VARIANTS_{arch_macro}_H_",
        include_names=names,
        macros=[
            (f"X(arch, JfDtype, head_dim, prefix) for every exported {args.arch} {kind} variant.",
             f"JF_FWD_SM80_{macro}_{arch_macro}", built[has_segments])
            for has_segments, macro, kind in ((False, "VARIANTS", "plain"), (True, "SEG_VARIANTS", "packed-document"))
        ] + [
            (f"X(arch, JfDtype, head_dim, prefix) for every exported {args.arch} variant that reads "
             "K / V through a page table (call_paged).",
             f"JF_FWD_SM80_PAGED_VARIANTS_{arch_macro}", paged_built),
        ],
    )


if __name__ == "__main__":
    main()
