"""Ahead-of-time export of every FlashFwdSm90 variant to C objects.

    python -m cuda_src.fwd_sm90.export --arch sm_90a --out DIR

writes DIR/<name>.o and DIR/<name>.h per (dtype, head_dim, head_dim_v)
variant (TILE_CONFIG in tile_config.py; named ..._hd<head_dim> or, where V
is narrower, ..._hd<head_dim>v<head_dim_v>), plain
(jf_fwd90_*), packed-document (jf_fwdseg90_*, has_segments=True, compiled
from FlashFwdSm90.call_with_segments, which takes the three segment tensors
after the stream), short-sequence (jf_fwdshort90_*, the head dims of
SHORT_TILE in tile_config.py) and K / V multicast in 2-CTA clusters
(jf_fwdpair90_*, the head dims of KV_MULTICAST), paged K / V (jf_fwdpaged90_*,
the head dims of PAGED, compiled from FlashFwdSm90.call_paged), and
DIR/fwd_sm90_variants_sm_90a.h, which includes them all and defines

    JF_FWD_SM90_VARIANTS_SM_90A(X)        ->  X(arch, JfDtype, head_dim, head_dim_v, prefix) ...
    JF_FWD_SM90_SEG_VARIANTS_SM_90A(X)    ->  the same for the segment variants
    JF_FWD_SM90_SHORT_VARIANTS_SM_90A(X)  ->  X(arch, JfDtype, head_dim, prefix,
                                              max_seqlen_q_causal, max_seqlen_q) ...
    JF_FWD_SM90_PAIR_VARIANTS_SM_90A(X)   ->  X(arch, JfDtype, head_dim, head_dim_v, prefix,
                                              min_seqlen_q) ...
    JF_FWD_SM90_PAGED_VARIANTS_SM_90A(X)  ->  X(arch, JfDtype, head_dim, head_dim_v, prefix) ...
    JF_FWD_SM90_FP8_VARIANTS_SM_90A(X)    ->  the same for the FP8 variants (jf_fwdfp890_*,
                                              compiled from FlashFwdSm90.call_fp8; JfDtype
                                              is the output's)

for launch.cc. The tensor and scalar signature is the sm80 kernel's, so the
generated wrappers take the same descriptors, and then (all but the paged
variants) the sinks right after the stream, before any segment tensors. `--only` and the kernel flags
exist for benchmarking alternatives; the shipped build uses the defaults.
"""

import argparse
import os

from ..common.export_common import (
    ROW_MAJOR_3D,
    ROW_MAJOR_4D,
    SCALAR_ALIGN,
    VECTOR_ALIGN,
    FakeProblem,
    export_variants,
    write_variants_header,
)
from .tile_config import FP8_CACHE_TILE_CONFIG, FP8_TILE_CONFIG, KV_MULTICAST, PAGED, SHORT_TILE, TILE_CONFIG

ARCHES = ("sm_90a",)
DTYPES = (("fp16", "JF_FLOAT16", "Float16"), ("bf16", "JF_BFLOAT16", "BFloat16"))
# Packed-document variants that have passed on an H100 (2026-11-21: bf16 at
# every head dim, fp16 at 64; 2026-11-22: both dtypes at 192 / 128). The
# others are not exported, so those problems run on the sm80 segment kernels,
# which passed for every dtype and head dim. 192 / 128 must be exported for
# both dtypes: the sm80 kernels take it only with V padded, which Python
# does on other GPUs only (configs.BackendSupport.native_value_dims).
SEGMENT_VARIANTS_VERIFIED = ({("bf16", dims) for dims in TILE_CONFIG}
                             | {("fp16", (64, 64)), ("fp16", (192, 128))})


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, choices=ARCHES)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--only", default=None,
        help="comma list of variant names to build (debugging); default all",
    )
    parser.add_argument("--no-conditional-rescale", action="store_true")
    parser.add_argument("--no-pingpong", action="store_true")
    parser.add_argument("--tile-n", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--consumers", type=int, default=None, help="consumer warpgroups (64 rows each)")
    parser.add_argument("--ctas-per-sm", type=int, default=None)
    parser.add_argument("--no-kv-multicast", action="store_true",
                        help="export the pair variants without clusters (the plain kernel)")
    parser.add_argument("--q-operand", choices=("smem", "registers"), default=None,
                        help="where the S GEMM reads Q from (default: tile_config.Q_IN_REGISTERS)")
    parser.add_argument("--reduction-partials", type=int, default=None,
                        help="chains per row in the softmax's max and sum "
                             "(default: tile_config.REDUCTION_PARTIALS)")
    args = parser.parse_args()
    # The DSL picks its target when cutlass is first imported; on a machine
    # without a GPU it would otherwise default to sm_100a.
    os.environ["CUTE_DSL_ARCH"] = args.arch
    return args


def variant_name(arch: str, dtype_tag: str, head_dim: int, head_dim_v: int, has_segments: bool,
                 short: bool = False, pair: bool = False, paged: bool = False,
                 fp8: bool = False, fp8_cache: bool = False) -> str:
    """dtype_tag: the inputs' type; for fp8 (e4m3 inputs) the output's."""
    family = ("fwdshort90" if short else "fwdpair90" if pair else "fwdpagedfp890" if fp8_cache
              else "fwdpaged90" if paged
              else "fwdfp890" if fp8 else "fwdseg90" if has_segments else "fwd90")
    value = "" if head_dim_v == head_dim else f"v{head_dim_v}"
    return f"jf_{family}_{arch}_{dtype_tag}_hd{head_dim}{value}"


def _fake_args(dtype, head_dim, head_dim_v, has_segments):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    fake = FakeProblem(head_dim)
    q = fake.bthd(dtype, fake.seqlen_q, fake.heads_q)
    k = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv)
    v = fake.bthd(dtype, fake.seqlen_k, fake.heads_kv, head_dim_v)
    o = fake.bthd(dtype, fake.seqlen_q, fake.heads_q, head_dim_v)
    lse = fake.per_head_row(assumed_align=SCALAR_ALIGN)
    # scale, softcap, diag_offset, window_left, window_right
    scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(-1), cutlass.Int32(-1))
    # [batch, heads_q, 1 or 0]: the sinks, or none (kernel.py: mSinks).
    sinks = make_fake_compact_tensor(cutlass.Float32, (fake.batch, fake.heads_q, cute.sym_int()),
                                     stride_order=ROW_MAJOR_3D, assumed_align=SCALAR_ALIGN)
    args = (q, k, v, o, lse, fake.lens(), fake.lens(), *scalars, cutlass.runtime.make_fake_stream(),
            sinks)
    if not has_segments:
        return args
    kv_bounds = fake.segment_bounds(fake.seqlen_q)
    return (*args, fake.segment_ids(fake.seqlen_q), fake.segment_ids(fake.seqlen_k), kv_bounds)


def _fake_paged_args(dtype, head_dim, head_dim_v):
    """call_paged's operands: Q and the lengths per sequence, K / V as pages
    (their own extents), O / LSE per (sequence, split) and the page table."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    fake = FakeProblem(head_dim)
    pages, page_size, outputs = cute.sym_int(), cute.sym_int(), cute.sym_int()
    paged = lambda dim: make_fake_compact_tensor(
        dtype, (pages, page_size, fake.heads_kv, dim), stride_order=ROW_MAJOR_4D,
        assumed_align=VECTOR_ALIGN)
    o = make_fake_compact_tensor(dtype, (outputs, fake.seqlen_q, fake.heads_q, head_dim_v),
                                 stride_order=ROW_MAJOR_4D, assumed_align=VECTOR_ALIGN)
    lse = make_fake_compact_tensor(cutlass.Float32, (outputs, fake.heads_q, fake.seqlen_q),
                                   stride_order=(2, 1, 0), assumed_align=SCALAR_ALIGN)
    table = make_fake_compact_tensor(cutlass.Int32, (fake.batch, cute.sym_int()), stride_order=(1, 0),
                                     assumed_align=SCALAR_ALIGN)
    scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(-1), cutlass.Int32(-1))
    return (fake.bthd(dtype, fake.seqlen_q, fake.heads_q), paged(head_dim), paged(head_dim_v), o, lse,
            fake.lens(), fake.lens(), *scalars, cutlass.runtime.make_fake_stream(), table,
            cutlass.Int32(1))


def _fake_paged_fp8_args(dtype, head_dim, head_dim_v):
    """call_paged_fp8's operands: call_paged's with e4m3 pages, and the
    scales [num_pages, heads_kv, page_size] float32."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    args = list(_fake_paged_args(dtype, head_dim, head_dim_v))
    k, v = args[1], args[2]
    pages, page_size, heads_kv = k.shape[:3]
    codes = lambda dim: make_fake_compact_tensor(
        cutlass.Float8E4M3FN, (pages, page_size, heads_kv, dim), stride_order=ROW_MAJOR_4D,
        assumed_align=VECTOR_ALIGN)
    scales = lambda: make_fake_compact_tensor(cutlass.Float32, (pages, heads_kv, page_size),
                                              stride_order=(2, 1, 0), assumed_align=VECTOR_ALIGN)
    args[1], args[2] = codes(head_dim), codes(head_dim_v)
    return (*args, scales(), scales())


def _fake_fp8_args(out_dtype, head_dim, head_dim_v):
    """call_fp8's operands: e4m3 Q / K, V transposed to [batch, heads_kv,
    head_dim_v, keys'] (keys' its own extent, a multiple of 32), O in
    out_dtype, the descales [batch, heads] float32."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    fp8 = cutlass.Float8E4M3FN
    fake = FakeProblem(head_dim)
    v_t = make_fake_compact_tensor(fp8, (fake.batch, fake.heads_kv, head_dim_v, cute.sym_int(divisibility=32)),
                                   stride_order=ROW_MAJOR_4D, assumed_align=VECTOR_ALIGN)
    descale = lambda heads: make_fake_compact_tensor(
        cutlass.Float32, (fake.batch, heads), stride_order=(1, 0), assumed_align=SCALAR_ALIGN)
    # scale, diag_offset, window_left, window_right
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(-1), cutlass.Int32(-1))
    return (fake.bthd(fp8, fake.seqlen_q, fake.heads_q), fake.bthd(fp8, fake.seqlen_k, fake.heads_kv),
            v_t, fake.bthd(out_dtype, fake.seqlen_q, fake.heads_q, head_dim_v),
            fake.per_head_row(assumed_align=SCALAR_ALIGN), fake.lens(), fake.lens(), *scalars,
            cutlass.runtime.make_fake_stream(), descale(fake.heads_q), descale(fake.heads_kv),
            descale(fake.heads_kv))


def main():
    args = _parse_args()
    import cutlass
    import cutlass.cute as cute
    from .kernel import FlashFwdSm90

    def compile_fn(dtype, head_dim, head_dim_v, has_segments, short=None, pair=False):
        kernel = FlashFwdSm90(
            dtype, head_dim, head_dim_v,
            conditional_rescale=not args.no_conditional_rescale,
            pingpong=not args.no_pingpong,
            tile_n=args.tile_n or (short and short.tile_n),
            kv_stages=args.stages or (short and short.kv_stages),
            has_segments=has_segments,
            consumers=args.consumers or (short and short.consumers),
            ctas_per_sm=args.ctas_per_sm or (short.ctas_per_sm if short else 1),
            kv_multicast=pair and not args.no_kv_multicast,
            q_in_registers=None if args.q_operand is None else args.q_operand == "registers",
            reduction_partials=args.reduction_partials or (short and short.reduction_partials),
        )
        entry = kernel.call_with_segments if has_segments else kernel
        return lambda: cute.compile(entry, *_fake_args(dtype, head_dim, head_dim_v, has_segments))

    only = set(args.only.split(",")) if args.only else None
    built = {False: [], True: []}
    variants = []
    for has_segments in (False, True):
        for dtype_tag, enum_name, cutlass_name in DTYPES:
            dtype = getattr(cutlass, cutlass_name)
            for head_dim, head_dim_v in TILE_CONFIG:
                name = variant_name(args.arch, dtype_tag, head_dim, head_dim_v, has_segments)
                if only is not None and name not in only:
                    continue
                if has_segments and (dtype_tag, (head_dim, head_dim_v)) not in SEGMENT_VARIANTS_VERIFIED:
                    continue
                variants.append((name, compile_fn(dtype, head_dim, head_dim_v, has_segments)))
                built[has_segments].append(f"{args.arch}, {enum_name}, {head_dim}, {head_dim_v}, {name}")
    short_built = []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        for head_dim, short in sorted(SHORT_TILE.items()):
            name = variant_name(args.arch, dtype_tag, head_dim, head_dim, False, short=True)
            if only is not None and name not in only:
                continue
            variants.append((name, compile_fn(getattr(cutlass, cutlass_name), head_dim, head_dim, False, short)))
            short_built.append(f"{args.arch}, {enum_name}, {head_dim}, {name}, "
                               f"{short.max_seqlen_q_causal}, {short.max_seqlen_q}")

    pair_built = []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        for (head_dim, head_dim_v), min_seqlen_q in sorted(KV_MULTICAST.items()):
            name = variant_name(args.arch, dtype_tag, head_dim, head_dim_v, False, pair=True)
            if only is not None and name not in only:
                continue
            variants.append((name, compile_fn(getattr(cutlass, cutlass_name), head_dim, head_dim_v,
                                              False, pair=True)))
            pair_built.append(f"{args.arch}, {enum_name}, {head_dim}, {head_dim_v}, {name}, {min_seqlen_q}")

    paged_built = []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        for head_dim, head_dim_v in PAGED:
            name = variant_name(args.arch, dtype_tag, head_dim, head_dim_v, False, paged=True)
            if only is not None and name not in only:
                continue
            dtype = getattr(cutlass, cutlass_name)
            kernel = FlashFwdSm90(dtype, head_dim, head_dim_v, paged_kv=True)
            variants.append((name, lambda kernel=kernel, dtype=dtype, dims=(head_dim, head_dim_v):
                             cute.compile(kernel.call_paged, *_fake_paged_args(dtype, *dims))))
            paged_built.append(f"{args.arch}, {enum_name}, {head_dim}, {head_dim_v}, {name}")

    # The paged variant on an FP8 cache (paged_fp8.py), q and O in each 16-bit type.
    paged_fp8_built = []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        for head_dim, head_dim_v in FP8_CACHE_TILE_CONFIG:
            name = variant_name(args.arch, dtype_tag, head_dim, head_dim_v, False, fp8_cache=True)
            if only is not None and name not in only:
                continue
            dtype = getattr(cutlass, cutlass_name)
            kernel = FlashFwdSm90(dtype, head_dim, head_dim_v, paged_kv=True, fp8_cache=True)
            variants.append((name, lambda kernel=kernel, dtype=dtype, dims=(head_dim, head_dim_v):
                             cute.compile(kernel.call_paged_fp8, *_fake_paged_fp8_args(dtype, *dims))))
            paged_fp8_built.append(f"{args.arch}, {enum_name}, {head_dim}, {head_dim_v}, {name}")

    # FP8 (e4m3) inputs, output in each 16-bit type (fp8_variant.py).
    fp8_built = []
    for dtype_tag, enum_name, cutlass_name in DTYPES:
        for head_dim, head_dim_v in FP8_TILE_CONFIG:
            name = variant_name(args.arch, dtype_tag, head_dim, head_dim_v, False, fp8=True)
            if only is not None and name not in only:
                continue
            out_dtype = getattr(cutlass, cutlass_name)
            kernel = FlashFwdSm90(cutlass.Float8E4M3FN, head_dim, head_dim_v, out_dtype=out_dtype)
            variants.append((name, lambda kernel=kernel, out_dtype=out_dtype, dims=(head_dim, head_dim_v):
                             cute.compile(kernel.call_fp8, *_fake_fp8_args(out_dtype, *dims))))
            fp8_built.append(f"{args.arch}, {enum_name}, {head_dim}, {head_dim_v}, {name}")

    names = export_variants(args.out, variants)
    arch_macro = args.arch.upper()
    write_variants_header(
        os.path.join(args.out, f"fwd_sm90_variants_{args.arch}.h"),
        generator="cuda_src/fwd_sm90/export.py",
        guard=f"JAX_FLASH_FWD_SM90_VARIANTS_{arch_macro}_H_",
        include_names=names,
        macros=[
            (f"X(arch, JfDtype, head_dim, head_dim_v, prefix) for every exported {args.arch} {kind} variant.",
             f"JF_FWD_SM90_{macro}_{arch_macro}", built[has_segments])
            for has_segments, macro, kind in ((False, "VARIANTS", "plain"), (True, "SEG_VARIANTS", "packed-document"))
        ] + [
            (f"X(arch, JfDtype, head_dim, prefix, max_seqlen_q_causal, max_seqlen_q) for every exported "
             f"{args.arch} short-sequence variant.", f"JF_FWD_SM90_SHORT_VARIANTS_{arch_macro}", short_built),
            (f"X(arch, JfDtype, head_dim, head_dim_v, prefix, min_seqlen_q) for every exported "
             f"{args.arch} variant that multicasts K / V in 2-CTA clusters (no window, no segments).",
             f"JF_FWD_SM90_PAIR_VARIANTS_{arch_macro}", pair_built),
            (f"X(arch, JfDtype, head_dim, head_dim_v, prefix) for every exported {args.arch} variant "
             "that reads K / V through a page table (call_paged).",
             f"JF_FWD_SM90_PAGED_VARIANTS_{arch_macro}", paged_built),
            (f"X(arch, JfDtype, head_dim, head_dim_v, prefix) for every exported {args.arch} variant "
             "that reads an FP8 paged cache (call_paged_fp8); JfDtype is q's.",
             f"JF_FWD_SM90_PAGED_FP8_VARIANTS_{arch_macro}", paged_fp8_built),
            (f"X(arch, JfDtype, head_dim, head_dim_v, prefix) for every exported {args.arch} variant "
             "with e4m3 Q / K / V (call_fp8); JfDtype is the output's.",
             f"JF_FWD_SM90_FP8_VARIANTS_{arch_macro}", fp8_built),
        ],
    )


if __name__ == "__main__":
    main()
