"""The AOT export's guards. The ptxas one (cuda_src/export_kernels.py) must
read ptxas's wrapped report per kernel, so that a "Potential Performance
Loss" advisory (WGMMAs serialised, setmaxnreg ignored) fails the build
instead of passing silently; the SASS one (cuda_src/sass_checks.py) must
find the forward's softmax exp2s on the right side of the wait for the PV
GEMM."""

import pytest

from cuda_src import export_kernels, sass_checks

KERNEL = "'kernel_cutlass_kernel_kernelFlashBwdSm90_object_at__tensor0000o6411101213_0'"
# Two kernels as the CuTe DSL prints them with remarks{ptx}: indented, with
# the advisories wrapped over several lines, each report before the
# export's "compiled and exported" line.
LOG = f"""remark[ptxas info]: ptxas output: ptxas info    : 0 bytes gmem
          ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to
          determine register count at entry.
          ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are
          serialized due to insufficient register resources for the function
          {KERNEL}
          ptxas info    : Function properties for {KERNEL}
          ptxas         .     48 bytes stack frame, 48 bytes spill stores, 60 bytes spill loads
          ptxas info    : Used 168 registers, used 5 barriers
jf_bwd90_sm90a_bf16_hd64: compiled and exported in 3.4 s
remark[ptxas info]: ptxas output: ptxas info    : 0 bytes gmem
          ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
          ptxas info    : Used 168 registers, used 5 barriers
jf_bwd90_sm90a_bf16_hd128: compiled and exported in 3.1 s
"""


def test_summary_reads_each_kernels_report():
  assert export_kernels.ptxas_summary(LOG) == [
      ("jf_bwd90_sm90a_bf16_hd64", 168, 48, [
          "'setmaxnreg' ignored; unable to determine register count at entry.",
          "wgmma.mma_async instructions are serialized due to insufficient register resources",
      ]),
      ("jf_bwd90_sm90a_bf16_hd128", 168, 0, []),
  ]


def test_unknown_advisories_are_flagged():
  flagged = export_kernels.unexpected_advisories(LOG)
  assert len(flagged) == 2
  assert all(line.startswith("jf_bwd90_sm90a_bf16_hd64: ") for line in flagged)


def test_known_advisory_is_only_reported(monkeypatch, capsys):
  advisory = "wgmma.mma_async instructions are serialized due to insufficient register resources"
  monkeypatch.setitem(export_kernels.KNOWN_ADVISORIES, "jf_bwd90_sm90a_bf16_hd64", advisory)
  flagged = export_kernels.unexpected_advisories(LOG)
  assert flagged == ["jf_bwd90_sm90a_bf16_hd64: 'setmaxnreg' ignored; unable to determine "
                     "register count at entry."]
  assert "known ptxas advisory" in capsys.readouterr().out


def sass(*instructions):
  """cuobjdump -sass lines, one per instruction."""
  return "\n".join(f"        /*{16 * i:04x}*/  {op} ;  /* 0x0 */" for i, op in enumerate(instructions))


PEELED = ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
          "MUFU.EX2 R24, R24")
LOOP_TOP = ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0",
            "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8].tnspB, R88, gsb0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1")
AFTER_LOOP = ("F2FP.BF16.F32.PACK_AB R120, R25, R24", "@P0 BRA 0x100",
              "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8].tnspB, R88, gsb0", "MUFU.LG2 R3, R3")


def test_softmax_before_the_pv_wait_passes():
  code = sass(*PEELED, *LOOP_TOP, "MUFU.EX2 R24, R24", "MUFU.EX2 R25, R25",
              "WARPGROUP.DEPBAR.LE gsb0, 0x0", *AFTER_LOOP)
  assert sass_checks.exps_after_pv_wait(code) == (2, 0)


def test_a_hoisted_pv_wait_is_counted():
  code = sass(*PEELED, *LOOP_TOP, "FMNMX R21, R24, R25, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
              "MUFU.EX2 R24, R24", "MUFU.EX2 R25, R25", *AFTER_LOOP)
  assert sass_checks.exps_after_pv_wait(code) == (0, 2)


def test_code_without_the_loop_is_not_judged():
  assert sass_checks.exps_after_pv_wait(sass(*PEELED)) is None


def test_cuda_images_are_carved_out_of_an_object_file():
  def elf(machine, payload):
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[18:20] = machine.to_bytes(2, "little")
    header[40:48] = (64 + len(payload)).to_bytes(8, "little")  # e_shoff: sections after it
    return bytes(header) + payload
  cubin = elf(190, b"cuda code")
  host = elf(62, b"host code" + cubin + b"trailing")
  assert sass_checks.embedded_cubins(host) == [cubin]


def test_hopper_backward_named_barriers_do_not_collide():
  """Every named barrier a variant of bwd_sm90 uses has an id of its own
  below 16 (cuda_src/bwd_sm90/barriers.py). The staggered variant has a dQ
  writer per consumer WG at most and no dq_in_stage, whose ids it reuses."""
  from cuda_src.bwd_sm90 import barriers as b
  writers = range(b.MAX_DQ_WRITERS)
  in_step = ([b.BAR_PDS, b.BAR_EPI, b.BAR_STAGE_READ, b.BAR_STATS]
             + [b.bar_dq_empty(w) for w in writers] + [b.bar_dq_full(w) for w in writers])
  wgs = range(2)
  staggered = ([b.BAR_ALONE, b.BAR_EPI] + [f(wg) for f in (b.bar_stats_of_wg, b.bar_dq_empty, b.bar_dq_full) for wg in wgs]
               + [f(wg, buf) for f in (b.bar_ds_full, b.bar_ds_free) for wg in wgs for buf in range(2)])
  for ids in (in_step, staggered):
    assert len(set(ids)) == len(ids), sorted(ids)
    assert all(0 <= i < 16 for i in ids), ids
  # Barrier 0 (__syncthreads) serves BAR_ALONE only because no role uses it.
  assert b.BAR_ALONE not in in_step


def test_gpu_head_dims_are_the_exported_ones():
  """configs.GPU.head_dims, by which calls are routed, are those the sm80
  families export (cuda_src/common/export_common.py)."""
  from cuda_src.common import export_common
  from jax_flash import _configs as configs
  assert configs.GPU.head_dims == export_common.SM80_HEAD_DIMS


def test_sm80_shared_memory_table_matches_the_kernels():
  """configs.SM80_SHARED_MEMORY, by which GPUs with 99 KiB per block are
  routed (jax_flash/_gpu_support.py), is what the sm_80 kernels allocate."""
  pytest.importorskip("cutlass")
  from jax_flash import _configs as configs
  from cuda_src.bwd_sm80 import kernel as backward
  from cuda_src.fwd_sm80 import kernel as forward
  int32 = 4
  assert configs.SM80_SHARED_MEMORY["forward"] == {
      hd: 2 * hd * (rows + 2 * cols) + 2 * warps * int32
      for hd, (rows, cols, warps) in forward.TILE_CONFIG.items()}
  assert configs.SM80_SHARED_MEMORY["backward"] == {
      hd: backward.FlashBwdSm80.smem_bytes(hd) for hd in backward.TILE_CONFIGS}
