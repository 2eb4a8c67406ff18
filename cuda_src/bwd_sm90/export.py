"""Ahead-of-time export of every FlashBwdSm90 (WGMMA) variant to C objects.

    python -m cuda_src.bwd_sm90.export --arch sm_90a --out build/bwd_sm90/sm_90a

writes, per kind (KINDS: plain, deterministic, packed-document, soft-capped),
dtype and (head_dim, head_dim_v) of TILE_CONFIGS, NAME.o and NAME.h
(export_to_c; named ..._hd<head_dim> or, where V is narrower,
..._hd<head_dim>v<head_dim_v>), and bwd_sm90_variants_<arch>.h with one
X-macro per kind for launch.cc, X(arch tag, JfDtype, head_dim, head_dim_v,
prefix, dq_tile_rows, kv_tile, turn_chains, query_tile) (kernel_api.h:
dq_tile_rows, 0 for dQ in q's layout; the keys per CTA; tile_config.py:
det_turn_chains; the query rows per dQ tile, i.e. per dq_semaphore turn).

Runtime scalars are plain kernel parameters: export_to_c supports Float32 and
Int32 arguments and maps them to `float` / `int32_t` parameters of the C
wrapper (verified on 4.8.1), so nothing has to travel through device memory.
The wrapper takes (scale, softcap, key_lo, key_hi, deterministic); launch.cc
derives the key bounds from diag_offset and the window. Symbols are prefixed
jf_bwd90_ / jf_bwd90det_ / jf_bwdseg90_ so they never clash with the sm80
family's own sm_90a objects (jf_bwd_sm90a_*).
"""

import os

from ..common.export_common import (
    VECTOR_ALIGN,
    FakeProblem,
    export_variants,
    parse_export_args,
    write_variants_header,
)

ARCHES = ("sm_90a",)  # WGMMA, TMA and setmaxnreg need the arch-specific target
DTYPES = (("f16", "Float16", "JF_FLOAT16"), ("bf16", "BFloat16", "JF_BFLOAT16"))


def _arch_tag(arch: str) -> str:
    return arch.replace("_", "")  # sm_90a -> sm90a


# The kinds of variant: (name infix, deterministic, has_segments, has_softcap).
KINDS = (("bwd90", False, False, False), ("bwd90det", True, False, False),
         ("bwdseg90", False, True, False), ("bwdcap90", False, False, True))


def dims_tag(head_dim: int, head_dim_v: int) -> str:
    """192, or 192v128 where V is narrower: in variant names and --only."""
    return f"{head_dim}" if head_dim_v == head_dim else f"{head_dim}v{head_dim_v}"


def variant_name(arch: str, dtype_tag: str, head_dim: int, head_dim_v: int, infix: str) -> str:
    return f"jf_{infix}_{_arch_tag(arch)}_{dtype_tag}_hd{dims_tag(head_dim, head_dim_v)}"


def _compile_variant(dtype, head_dim, head_dim_v, deterministic, has_segments, has_softcap, tile=None):
    import cutlass
    import cutlass.cute as cute
    from .kernel import FlashBwdSm90

    fake = FakeProblem(head_dim)
    q = fake.bthd(dtype, fake.seqlen_q, fake.heads_q)
    k = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    v = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv, head_dim_v)
    do = fake.bthd(dtype, fake.seqlen_q, fake.heads_q, head_dim_v)
    lse = fake.per_head_row(assumed_align=VECTOR_ALIGN)
    delta = fake.per_head_row(assumed_align=VECTOR_ALIGN)
    q_lens, kv_lens = fake.lens(), fake.lens()
    dq = fake.bthd(cutlass.Float32, fake.seqlen_q, fake.heads_q)
    dk = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    dv = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv, head_dim_v)
    stream = cutlass.runtime.make_fake_stream()
    segments = ()
    if has_segments:
        segments = (fake.segment_ids(fake.seqlen_q), fake.segment_ids(fake.seqlen_k),
                    fake.segment_bounds(fake.seqlen_k))
    kernel = FlashBwdSm90(dtype, head_dim, deterministic, has_segments, tile, has_softcap, head_dim_v)
    return cute.compile(
        kernel, q, k, v, do, lse, delta, q_lens, kv_lens, dq, dk, dv, fake.dq_semaphore(),
        # scale, softcap, key_lo, key_hi, deterministic
        cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0),
        stream, *segments,
    )


def main(argv=None):
    args = parse_export_args(
        __doc__, ARCHES, "comma-separated subset, e.g. bf16_128,f16_192v128 (development aid)", argv,
        extra=[("--tile", dict(default=None, help="M,N,STAGES[,split][,instage][,writersW] instead of "
                                                  "TILE_CONFIGS (timing alternatives; use with --only); "
                                                  "split: split_head_dim, instage: dq_in_stage, "
                                                  "writersW: det_dq_writers=W")),
               ("--kinds", dict(default="", help="comma-separated name infixes, e.g. bwd90det "
                                                 "(development aid)"))],
    )
    import cutlass
    from .tile_config import TILE_CONFIGS, TileConfig

    tile = None
    if args.tile:
        fields = args.tile.split(",")
        writers = [int(f[len("writers"):]) for f in fields[3:] if f.startswith("writers")]
        tile = TileConfig(*map(int, fields[:3]), split_head_dim="split" in fields[3:],
                          dq_in_stage="instage" in fields[3:], det_dq_writers=(writers or [2])[0])

    only = {s for s in args.only.split(",") if s}
    tag = _arch_tag(args.arch)
    rows = {infix: [] for infix, _, _, _ in KINDS}
    variants = []
    kinds = {k for k in args.kinds.split(",") if k}
    for infix, deterministic, has_segments, has_softcap in KINDS:
        if kinds and infix not in kinds:
            continue
        for dtype_tag, dtype_name, jf_dtype in DTYPES:
            for head_dim, head_dim_v in TILE_CONFIGS:
                if only and f"{dtype_tag}_{dims_tag(head_dim, head_dim_v)}" not in only:
                    continue
                name = variant_name(args.arch, dtype_tag, head_dim, head_dim_v, infix)
                dtype = getattr(cutlass, dtype_name)
                variants.append((name, lambda d=dtype, h=head_dim, hv=head_dim_v, x=deterministic,
                                 g=has_segments, c=has_softcap: _compile_variant(d, h, hv, x, g, c, tile)))
                cfg = tile or TILE_CONFIGS[head_dim, head_dim_v]
                rows[infix].append(f"{tag}, {jf_dtype}, {head_dim}, {head_dim_v}, {name}, {cfg.dq_tile_rows}, "
                                   f"{cfg.n_block}, {cfg.det_turn_chains}, {cfg.m_block}")

    names = export_variants(args.out, variants)
    write_variants_header(
        os.path.join(args.out, f"bwd_sm90_variants_{args.arch}.h"),
        generator=f"cuda_src/bwd_sm90/export.py --arch {args.arch}",
        guard=f"JAX_FLASH_BWD_SM90_VARIANTS_{tag.upper()}_H_",
        include_names=names,
        macros=[
            ("X(arch tag, JfDtype, head_dim, head_dim_v, prefix, dq_tile_rows, kv_tile, turn_chains, query_tile), plain", f"JF_BWD_SM90_VARIANTS_{tag.upper()}", rows["bwd90"]),
            (
                "X(arch tag, JfDtype, head_dim, head_dim_v, prefix, dq_tile_rows, kv_tile, turn_chains, query_tile), deterministic",
                f"JF_BWD_SM90_DET_VARIANTS_{tag.upper()}",
                rows["bwd90det"],
            ),
            (
                "X(arch tag, JfDtype, head_dim, head_dim_v, prefix, dq_tile_rows, kv_tile, turn_chains, query_tile), packed-document (has_segments)",
                f"JF_BWD_SM90_SEG_VARIANTS_{tag.upper()}",
                rows["bwdseg90"],
            ),
            (
                "X(arch tag, JfDtype, head_dim, head_dim_v, prefix, dq_tile_rows, kv_tile, turn_chains, query_tile), soft-capped (has_softcap)",
                f"JF_BWD_SM90_CAP_VARIANTS_{tag.upper()}",
                rows["bwdcap90"],
            ),
        ],
    )


if __name__ == "__main__":
    main()
