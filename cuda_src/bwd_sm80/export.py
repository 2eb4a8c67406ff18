"""Ahead-of-time export of every FlashBwdSm80 variant to C objects.

    python -m cuda_src.bwd_sm80.export --arch sm_80 --out build/bwd_sm80/sm_80

writes, per (dtype, head_dim), NAME.o and NAME.h (export_to_c) for the plain
kernel (jf_bwd_*) and the packed-document one (jf_bwdseg_*, has_segments=True,
which takes q_segment_ids, kv_segment_ids and q_bounds after the stream), and
bwd_sm80_variants_<arch>.h with one X-macro per kind for launch.cc.

Runtime scalars are plain kernel parameters: export_to_c supports Float32 and
Int32 arguments and maps them to `float` / `int32_t` parameters of the C
wrapper (verified on 4.8.1), so nothing has to travel through device memory.
The wrapper takes (scale, softcap, key_lo, key_hi, deterministic); launch.cc
derives the key bounds from diag_offset and the window.
"""

import os

from ..common.export_common import (
    VECTOR_ALIGN,
    SM80_HEAD_DIMS as HEAD_DIMS,
    FakeProblem,
    export_variants,
    parse_export_args,
    write_variants_header,
)

ARCHES = ("sm_80", "sm_90a")
DTYPES = (("f16", "Float16", "JF_FLOAT16"), ("bf16", "BFloat16", "JF_BFLOAT16"))


def _arch_tag(arch: str) -> str:
    return arch.replace("_", "")  # sm_90a -> sm90a


def variant_name(arch: str, dtype_tag: str, head_dim: int, has_segments: bool) -> str:
    family = "bwdseg" if has_segments else "bwd"
    return f"jf_{family}_{_arch_tag(arch)}_{dtype_tag}_hd{head_dim}"


def _compile_variant(dtype, head_dim, arch, has_segments):
    import cutlass
    import cutlass.cute as cute
    from .kernel import FlashBwdSm80

    fake = FakeProblem(head_dim)
    q = fake.bthd(dtype, fake.seqlen_q, fake.heads_q)
    k = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    v = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    do = fake.bthd(dtype, fake.seqlen_q, fake.heads_q)
    lse = fake.per_head_row(assumed_align=VECTOR_ALIGN)
    delta = fake.per_head_row(assumed_align=VECTOR_ALIGN)
    q_lens, kv_lens = fake.lens(), fake.lens()
    dq = fake.bthd(cutlass.Float32, fake.seqlen_q, fake.heads_q)
    dk = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    dv = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    stream = cutlass.runtime.make_fake_stream()
    segments = ()
    if has_segments:
        q_bounds = fake.segment_bounds(fake.seqlen_k)
        segments = (fake.segment_ids(fake.seqlen_q), fake.segment_ids(fake.seqlen_k), q_bounds)
    kernel = FlashBwdSm80(dtype, head_dim, arch, has_segments)
    return cute.compile(
        kernel, q, k, v, do, lse, delta, q_lens, kv_lens, dq, dk, dv, fake.dq_semaphore(),
        # scale, softcap, key_lo, key_hi, deterministic
        cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0),
        stream, *segments,
    )


def main(argv=None):
    args = parse_export_args(__doc__, ARCHES, "comma-separated subset, e.g. bf16_128 (development aid)", argv)
    import cutlass

    only = {s for s in args.only.split(",") if s}
    tag = _arch_tag(args.arch)
    rows = {False: [], True: []}
    variants = []
    for has_segments in (False, True):
        for dtype_tag, dtype_name, jf_dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                if only and f"{dtype_tag}_{head_dim}" not in only:
                    continue
                name = variant_name(args.arch, dtype_tag, head_dim, has_segments)
                dtype = getattr(cutlass, dtype_name)
                variants.append((name, lambda d=dtype, h=head_dim, s=has_segments: _compile_variant(d, h, args.arch, s)))
                rows[has_segments].append(f"{tag}, {jf_dtype}, {head_dim}, {name}")

    names = export_variants(args.out, variants)
    write_variants_header(
        os.path.join(args.out, f"bwd_sm80_variants_{args.arch}.h"),
        generator=f"cuda_src/bwd_sm80/export.py --arch {args.arch}",
        guard=f"JAX_FLASH_BWD_SM80_VARIANTS_{tag.upper()}_H_",
        include_names=names,
        macros=[
            (f"X(arch tag, JfDtype, head_dim, prefix), {kind}", f"JF_BWD_SM80_{macro}_{tag.upper()}", rows[has_segments])
            for has_segments, macro, kind in (
                (False, "VARIANTS", "plain"),
                (True, "SEG_VARIANTS", "packed-document (has_segments)"),
            )
        ],
    )


if __name__ == "__main__":
    main()
