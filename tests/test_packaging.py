"""The build's own machinery, without the CuTe DSL or a GPU: the sharded AOT
export (cuda_src/export_kernels.py) must give the same kernels and header as
one process, and its combine step must refuse shards that miss a variant;
cmake/pip_cuda.py must say which CUDA package is missing."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from cuda_src import export_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A family's export.py as the real ones are built: it hands (name, compile)
# pairs to cuda_src.common.export_common.export_variants and writes the
# header of the names that returns. compile() gives an object whose
# export_to_c writes the files the DSL would.
FAKE_EXPORT = textwrap.dedent('''
    import argparse, os, pathlib
    from ..common.export_common import export_variants, write_variants_header

    class Compiled:
      def export_to_c(self, file_path, file_name, function_prefix):
        pathlib.Path(file_path, file_name + ".o").write_bytes(file_name.encode())
        pathlib.Path(file_path, file_name + ".h").write_text(f"// {function_prefix}\\n")

    parser = argparse.ArgumentParser()
    parser.add_argument("--arch")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = export_variants(args.out, [(f"jf_fake_{i}", Compiled) for i in range(7)])
    write_variants_header(os.path.join(args.out, f"fake_variants_{args.arch}.h"), "test", "G",
                          names, [("all", "JF_FAKE", names)])
''')


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
  """A cuda_src package with the real common/ and export tools (linked) and a
  fake/ family."""
  source = tmp_path / "cuda_src"
  (source / "fake").mkdir(parents=True)
  (source / "fake" / "__init__.py").write_text("")
  (source / "fake" / "export.py").write_text(FAKE_EXPORT)
  for name in ("__init__.py", "common", "export_kernels.py", "sass_checks.py"):
    (source / name).symlink_to(ROOT / "cuda_src" / name)
  monkeypatch.setattr(export_kernels, "SOURCE_DIR", source)
  return tmp_path


def test_shards_give_what_one_process_gives(fake_family):
  whole, sharded = fake_family / "whole", fake_family / "sharded"
  export_kernels.export("fake", "sm_80", whole)
  for index in (1, 2, 3):
    export_kernels.export_shard("fake", "sm_80", sharded, index, 3)
  # Every third variant per shard.
  assert sorted(p.stem for p in (sharded / "fake_sm_80.shards" / "2").glob("*.o")) == [
      "jf_fake_1", "jf_fake_4"]
  export_kernels.combine("fake", "sm_80", sharded, 3)
  files = lambda out: {p.name: p.read_bytes() for p in (out / "fake_sm_80").iterdir()
                       if p.name != "ptxas.log"}
  assert files(sharded) == files(whole)
  assert len([name for name in files(whole) if name.endswith(".o")]) == 7
  assert (sharded / "libfake_sm_80.a").is_file()


def test_combine_refuses_a_missing_variant(fake_family):
  out = fake_family / "out"
  for index in (1, 2):
    export_kernels.export_shard("fake", "sm_80", out, index, 2)
  (out / "fake_sm_80.shards" / "2" / "jf_fake_3.o").unlink()
  with pytest.raises(SystemExit, match=r"names 7 variants, the shards exported 6; "
                                       r"missing: \['jf_fake_3'\]"):
    export_kernels.combine("fake", "sm_80", out, 2)


def test_combine_refuses_an_unfinished_shard(fake_family):
  out = fake_family / "out"
  export_kernels.export_shard("fake", "sm_80", out, 1, 2)
  with pytest.raises(SystemExit, match="shard 2/2 has not finished"):
    export_kernels.combine("fake", "sm_80", out, 2)


def test_pip_cuda_names_the_missing_package(tmp_path):
  # A Python that sees no site-packages: none of the CUDA packages.
  proc = subprocess.run([sys.executable, "-S", "-I", str(ROOT / "cmake" / "pip_cuda.py")],
                        capture_output=True, text=True, cwd=tmp_path)
  assert proc.returncode == 1
  assert proc.stderr.strip() == "the pip package nvidia-cuda-runtime is not installed"
