"""Ahead-of-time export of every FlashBwdSm80 variant to C objects.

    python cuda_src/bwd_sm80/export.py --arch sm_80 --out build/bwd_sm80/sm_80

writes, per (dtype, head_dim), NAME.o and NAME.h (export_to_c) for the plain
kernel (jf_bwd_*) and the packed-document one (jf_bwdseg_*, has_segments=True,
which takes q_segment_ids, kv_segment_ids and q_bounds after the stream), and
bwd_sm80_variants_<arch>.h with one X-macro per kind for launch.cc.

Runtime scalars are plain kernel parameters: export_to_c supports Float32 and
Int32 arguments and maps them to `float` / `int32_t` parameters of the C
wrapper (verified on 4.8.1), so nothing has to travel through device memory.
The wrapper takes (scale, key_lo, key_hi); launch.cc derives the key bounds
from diag_offset and the window.
"""

import argparse
import os
import sys
import time

# The DSL picks its target when cutlass is first imported; on a machine
# without a GPU it would otherwise default to sm_100a.
ARCHES = ("sm_80", "sm_90a")
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = (("f16", "Float16", "JF_FLOAT16"), ("bf16", "BFloat16", "JF_BFLOAT16"))


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", required=True, choices=ARCHES)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--only", default="", help="comma-separated subset, e.g. bf16_128 (development aid)")
    return p.parse_args(argv)


def _arch_tag(arch: str) -> str:
    return arch.replace("_", "")  # sm_90a -> sm90a


def variant_name(arch: str, dtype_tag: str, head_dim: int, has_segments: bool) -> str:
    family = "bwdseg" if has_segments else "bwd"
    return f"jf_{family}_{_arch_tag(arch)}_{dtype_tag}_hd{head_dim}"


def _compile_variant(dtype, head_dim, arch, has_segments):
    import cuda.bindings.driver as cuda  # noqa: F401  (stream annotation type)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel import FlashBwdSm80

    batch, seqlen_q, seqlen_k = cute.sym_int(), cute.sym_int(), cute.sym_int()
    heads_q, heads_kv = cute.sym_int(), cute.sym_int()
    row_major4 = dict(stride_order=(3, 2, 1, 0), assumed_align=16)
    row_major3 = dict(stride_order=(2, 1, 0), assumed_align=16)

    def bthd(dt, seqlen, heads):
        return make_fake_compact_tensor(dt, (batch, seqlen, heads, head_dim), **row_major4)

    q = bthd(dtype, seqlen_q, heads_q)
    k = bthd(dtype, seqlen_k, heads_kv)
    v = bthd(dtype, seqlen_k, heads_kv)
    do = bthd(dtype, seqlen_q, heads_q)
    lse = make_fake_compact_tensor(cutlass.Float32, (batch, heads_q, seqlen_q), **row_major3)
    delta = make_fake_compact_tensor(cutlass.Float32, (batch, heads_q, seqlen_q), **row_major3)
    q_lens = make_fake_compact_tensor(cutlass.Int32, (batch,), assumed_align=4)
    kv_lens = make_fake_compact_tensor(cutlass.Int32, (batch,), assumed_align=4)
    dq = bthd(cutlass.Float32, seqlen_q, heads_q)
    dk = bthd(dtype, seqlen_k, heads_kv)
    dv = bthd(dtype, seqlen_k, heads_kv)
    stream = cutlass.runtime.make_fake_stream()
    segments = ()
    if has_segments:
        q_seg = make_fake_compact_tensor(cutlass.Int32, (batch, seqlen_q), stride_order=(1, 0), assumed_align=4)
        kv_seg = make_fake_compact_tensor(cutlass.Int32, (batch, seqlen_k), stride_order=(1, 0), assumed_align=4)
        q_bounds = make_fake_compact_tensor(
            cutlass.Int32, (batch, seqlen_k, 2), stride_order=(2, 1, 0), assumed_align=4
        )
        segments = (q_seg, kv_seg, q_bounds)
    kernel = FlashBwdSm80(dtype, head_dim, arch, has_segments)
    return cute.compile(
        kernel, q, k, v, do, lse, delta, q_lens, kv_lens, dq, dk, dv,
        cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), stream, *segments,
    )


def main(argv=None):
    args = _parse_args(argv)
    os.environ["CUTE_DSL_ARCH"] = args.arch
    import cutlass  # noqa: F401  (after CUTE_DSL_ARCH is set)

    os.makedirs(args.out, exist_ok=True)
    only = {s for s in args.only.split(",") if s}
    rows = {False: [], True: []}
    for has_segments in (False, True):
        for dtype_tag, dtype_name, jf_dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                if only and f"{dtype_tag}_{head_dim}" not in only:
                    continue
                name = variant_name(args.arch, dtype_tag, head_dim, has_segments)
                t0 = time.perf_counter()
                compiled = _compile_variant(getattr(cutlass, dtype_name), head_dim, args.arch, has_segments)
                compiled.export_to_c(file_path=args.out, file_name=name, function_prefix=name)
                print(f"{name}: compiled and exported in {time.perf_counter() - t0:.1f} s", flush=True)
                rows[has_segments].append((name, jf_dtype, head_dim))

    tag = _arch_tag(args.arch)
    header = os.path.join(args.out, f"bwd_sm80_variants_{args.arch}.h")
    with open(header, "w") as f:
        guard = f"JAX_FLASH_BWD_SM80_VARIANTS_{tag.upper()}_H_"
        f.write(f"// Generated by cuda_src/bwd_sm80/export.py --arch {args.arch}. Do not edit.\n")
        f.write(f"#ifndef {guard}\n#define {guard}\n\n")
        for name, _, _ in rows[False] + rows[True]:
            f.write(f'#include "{name}.h"\n')
        for has_segments, macro in ((False, "VARIANTS"), (True, "SEG_VARIANTS")):
            kind = "packed-document (has_segments)" if has_segments else "plain"
            f.write(f"\n// X(arch tag, JfDtype, head_dim, prefix), {kind}\n")
            f.write(f"#define JF_BWD_SM80_{macro}_{tag.upper()}(X)")
            for name, jf_dtype, head_dim in rows[has_segments]:
                f.write(f" \\\n  X({tag}, {jf_dtype}, {head_dim}, {name})")
            f.write("\n")
        f.write(f"\n#endif  // {guard}\n")
    print(f"wrote {header}")


if __name__ == "__main__":
    main()
