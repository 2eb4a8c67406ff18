"""The AOT export's ptxas guard (cuda_src/export_kernels.py): it must read
ptxas's wrapped report per kernel, so that a "Potential Performance Loss"
advisory (WGMMAs serialised, setmaxnreg ignored) fails the build instead of
passing silently."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cuda_src"))

import export_kernels  # noqa: E402

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
