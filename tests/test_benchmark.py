"""The benchmark's pure parts: FLOP counts, result rows and results files
(docs/numerics.md), the sweep and its table, the Pallas tile choices, the plot
and the README's table. Nothing here times anything."""

import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import __main__ as jax_flash_main
from jax_flash import _benchmark as benchmark
from jax_flash import _configs as jax_flash_configs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import add_run  # noqa: E402
import bench_attention  # noqa: E402
import bench_decode  # noqa: E402
import compare_variants  # noqa: E402
import plot_results  # noqa: E402
import readme_table  # noqa: E402

ROW_FIELDS = {"impl", "op", "dtype", "batch", "seq_q", "seq_k", "heads_q", "heads_kv", "head_dim",
              "head_dim_v", "causal", "window", "variant", "tflops", "ms", "gbps", "gpu", "jax",
              "date", "matmul_ceiling_tflops"}


def fake_result(fwd_ms=2.0, bwd_ms=5.0, config=None):
  config = config or benchmark.Config(2, 8192, 16, 128, False)
  result = {"fwd_ms": fwd_ms, "fwd_tflops": config.forward_flops() / fwd_ms / 1e9}
  if bwd_ms is not None:
    result |= {"bwd_ms": bwd_ms, "bwd_tflops": config.backward_flops() / bwd_ms / 1e9}
  return result


def test_flop_counts():
  config = benchmark.Config(batch=2, seq=1024, heads=4, head_dim=64, causal=False)
  assert config.forward_flops() == 4 * 2 * 4 * 1024 * 1024 * 64
  causal = benchmark.Config(2, 1024, 4, 64, causal=True)
  assert causal.forward_flops() == config.forward_flops() / 2
  assert config.backward_flops() == 2.5 * config.forward_flops()


def test_narrower_values_count_their_own_flops_and_shapes():
  # DeepSeek's 192 / 128: Q K^T over 192 columns, P V over 128.
  config = bench_attention.sweep_configs([bench_attention.head_dims_arg("192/128")], [1024],
                                         (False,), 2048, 4, "bfloat16")[0]
  assert (config.head_dim, config.value_dim, config.dims_label) == (192, 128, "192/128")
  assert config.forward_flops() == 2 * 2 * 4 * 1024 * 1024 * (192 + 128)
  q, k, v, dout = jax.eval_shape(lambda: benchmark.inputs(config))
  assert (q.shape, k.shape, v.shape, dout.shape) == (
      (2, 1024, 4, 192), (2, 1024, 4, 192), (2, 1024, 4, 128), (2, 1024, 4, 128))
  assert {row["head_dim_v"] for row in benchmark.rows("jax_flash", config, fake_result(config=config),
                                                      None)} == {128}
  assert bench_attention.head_dims_arg("128") == 128
  with pytest.raises(Exception, match="HEAD_DIM/HEAD_DIM_V"):
    bench_attention.head_dims_arg("192/128/64")
  line = bench_attention.measured_line(config, "cudnn", fake_result(config=config), None, 1.0, 0.0)
  assert line.split()[:3] == ["192/128", "1024", "False"]


def test_rows_carry_the_result_fields():
  config = benchmark.Config(2, 8192, 16, 128, True, "float16")
  rows = benchmark.rows("cudnn", config, fake_result(config=config), 700.04, "deterministic")
  assert [row["op"] for row in rows] == ["fwd", "bwd"]
  for row in rows:
    assert set(row) == ROW_FIELDS
    assert (row["impl"], row["dtype"], row["variant"]) == ("cudnn", "float16", "deterministic")
    assert (row["batch"], row["seq_q"], row["seq_k"], row["heads_q"], row["heads_kv"]) == (
        2, 8192, 8192, 16, 16)
    assert row["causal"] is True and row["matmul_ceiling_tflops"] == 700.0
    assert row["jax"] == jax.__version__ and row["gpu"] == jax.devices()[0].device_kind
  assert rows[0]["ms"] == 2.0 and rows[1]["ms"] == 5.0
  assert rows[0]["tflops"] == round(config.forward_flops() / 2.0 / 1e9, 1)


def test_rows_leave_out_a_failed_backward():
  result = fake_result(bwd_ms=None) | {"bwd_error": "NotImplementedError: causal"}
  rows = benchmark.rows("pallas_mgpu", benchmark.Config(1, 1024, 16, 128, True), result, None)
  assert [row["op"] for row in rows] == ["fwd"]
  assert rows[0]["matmul_ceiling_tflops"] is None


def test_forward_only_measures_and_reports_no_backward():
  assert bench_attention.build_parser().parse_args(["--forward-only"]).forward_only
  config = benchmark.Config(1, 96, 2, 64, True)
  result = benchmark.measure("jax_flash", config, iters=1, backward=False)
  assert set(result) == {"fwd_ms", "fwd_tflops"} and result["fwd_ms"] > 0
  assert [row["op"] for row in benchmark.rows("jax_flash", config, result, None)] == ["fwd"]


def test_attention_fn_rejects_unknown_names_and_stray_options():
  config = benchmark.Config(1, 128, 2, 64, False)
  with pytest.raises(ValueError, match="unknown implementation 'flash3'"):
    benchmark.attention_fn("flash3", config)
  with pytest.raises(ValueError, match="apply to jax_flash only"):
    benchmark.attention_fn("cudnn", config, deterministic=True)


def test_error_summary_keeps_the_first_line():
  error = NotImplementedError("Causal attention not supported\nsecond line")
  assert benchmark.error_summary(error) == "NotImplementedError: Causal attention not supported"
  assert len(benchmark.error_summary(ValueError("x" * 500), width=40)) == 40


def test_pallas_runs_in_float16_on_hopper_only():
  assert benchmark.skip_reason("pallas_mgpu", "bfloat16") == "fp16 only"
  assert benchmark.skip_reason("cudnn", "bfloat16") is None
  if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
    assert "Hopper" in benchmark.skip_reason("pallas_mgpu", "float16")


def test_pallas_tiles_are_valid_tuning_configs():
  attention_mgpu = pytest.importorskip("jax.experimental.pallas.ops.gpu.attention_mgpu")
  for forward in benchmark.PALLAS_MGPU_FORWARD_TILES:
    for backward in benchmark.PALLAS_MGPU_BACKWARD_TILES:
      tuning = attention_mgpu.TuningConfig(**forward, **backward)  # validates in __post_init__
      assert tuning.has_backward_blocks
  widths = [tiles["block_kv"] for tiles in benchmark.PALLAS_MGPU_FORWARD_TILES]
  assert widths == sorted(widths, reverse=True), "widest key block first"


def test_default_sweep_is_the_issue_grid():
  args = bench_attention.build_parser().parse_args([])
  assert args.head_dims == [64, 128, 256]
  assert args.seqs == [1024, 2048, 4096, 8192, 16384, 32768]
  assert (args.causal, args.tokens, args.heads, args.dtype) == ("both", 16384, 16, "bfloat16")
  assert set(args.impls) == {"jax_flash", "cudnn", "pallas_mgpu", "xla"}
  configs = bench_attention.sweep_configs(args.head_dims, args.seqs, (False, True), args.tokens,
                                          args.heads, args.dtype)
  assert len(configs) == 3 * 6 * 2
  assert all(c.batch * c.seq == 16384 for c in configs if c.seq <= 16384)
  assert [c.batch for c in configs if c.seq == 32768] == [1] * 6


def test_measurements_put_cudnn_first_and_add_the_deterministic_variant():
  plan = bench_attention.measurements(["jax_flash", "xla", "cudnn"], deterministic=True)
  assert [(impl, variant) for impl, variant, _ in plan] == [
      ("cudnn", ""), ("jax_flash", ""), ("xla", ""), ("jax_flash", "deterministic")]
  assert plan[-1][2] == {"deterministic": True}
  assert len(bench_attention.measurements(["cudnn"], deterministic=False)) == 1


def test_measurements_label_only_the_jax_flash_rows():
  plan = bench_attention.measurements(["jax_flash", "cudnn"], deterministic=True, label="fwd-n192")
  assert [(impl, variant) for impl, variant, _ in plan] == [
      ("cudnn", ""), ("jax_flash", "fwd-n192"), ("jax_flash", "fwd-n192-deterministic")]


def test_measurements_add_the_softcap_variant_last():
  plan = bench_attention.measurements(["jax_flash", "cudnn"], deterministic=False, label="alt",
                                      softcap=50.0)
  assert [(impl, variant) for impl, variant, _ in plan] == [
      ("cudnn", ""), ("jax_flash", "alt"), ("jax_flash", "alt-softcap-50")]
  assert plan[-1][2] == {"softcap": 50.0}


def test_measurements_add_the_sinks_variant_last():
  plan = bench_attention.measurements(["jax_flash", "cudnn"], deterministic=False, label="alt",
                                      sinks=True)
  assert [(impl, variant) for impl, variant, _ in plan] == [
      ("cudnn", ""), ("jax_flash", "alt"), ("jax_flash", "alt-sinks")]
  assert plan[-1][2] == {"sinks": True}


def test_measured_line_prints_ratios_and_dashes():
  config = benchmark.Config(2, 8192, 16, 128, False)
  anchor = fake_result(fwd_ms=2.0, bwd_ms=4.0)
  ours = fake_result(fwd_ms=4.0, bwd_ms=None)
  ceiling = anchor["fwd_tflops"] * 2
  line = bench_attention.measured_line(config, "pallas_mgpu", ours, anchor, ceiling, 12.3)
  fields = line.split()
  assert fields[:4] == ["128", "8192", "False", "pallas_mgpu"]
  assert fields[4:] == [f"{ours['fwd_tflops']:.1f}", "-", "0.50", "-", "0.25", "-", "12s"]
  no_anchor = bench_attention.measured_line(config, "xla", anchor, None, ceiling, 0.0).split()
  assert no_anchor[6:8] == ["-", "-"]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_bench_refuses_to_run_without_a_gpu(capsys):
  assert bench_attention.main([]) == 2
  assert "needs a GPU" in capsys.readouterr().out


def sweep_rows(impl="jax_flash", variant="", dtype="bfloat16", scale=1.0, **extra):
  rows = []
  for head_dim in (64, 128):
    for seq in (1024, 4096, 16384):
      for causal in (False, True):
        config = benchmark.Config(16384 // seq, seq, 16, head_dim, causal, dtype)
        result = fake_result(fwd_ms=scale * seq / 1024, bwd_ms=scale * seq / 400, config=config)
        rows += [{**row, **extra} for row in benchmark.rows(impl, config, result, 700.0, variant)]
  return rows


def test_collect_points_keeps_the_last_row_of_a_configuration():
  first, second = sweep_rows(run=1), sweep_rows(scale=2.0, run=2)
  points = plot_results.collect_points(first + second)
  curve = points["fwd", (64, 64), "jax_flash", False]
  assert sorted(curve) == [1024, 4096, 16384]
  assert curve[1024] == second[0]["tflops"]
  assert len(points) == 2 * 2 * 2  # op x head dim x causal, one series


def test_collect_points_takes_the_median_of_a_sweeps_rounds():
  rounds = [sweep_rows(scale=scale, round=i) for i, scale in enumerate((1.0, 4.0, 2.0))]
  later = sweep_rows(scale=8.0, round=0)
  curve = lambda points: points["fwd", (64, 64), "jax_flash", False][1024]
  assert curve(plot_results.collect_points(sum(rounds, []))) == rounds[2][0]["tflops"]
  assert curve(plot_results.collect_points(sum(rounds, []) + later)) == later[0]["tflops"]


def test_collect_points_names_variants_and_mixed_dtypes():
  rows = (sweep_rows() + sweep_rows(variant="deterministic")
          + [{**row, "tflops": None} for row in sweep_rows(impl="cudnn", variant="packed-8-docs")])
  names = {key[2] for key in plot_results.collect_points(rows)}
  assert names == {"jax_flash", "jax_flash [deterministic]"}
  fp16_rows = sweep_rows(impl="pallas_mgpu", dtype="float16")
  mixed = plot_results.collect_points(sweep_rows() + fp16_rows)
  assert {key[2] for key in mixed} == {"jax_flash bfloat16", "pallas_mgpu float16"}


def test_plot_writes_a_png(tmp_path):
  pytest.importorskip("matplotlib")
  rows = sweep_rows() + sweep_rows(impl="cudnn", scale=0.8)
  rows = [row for row in rows if not (row["impl"] == "cudnn" and row["op"] == "bwd")]
  path = tmp_path / "sweep.png"
  assert plot_results.plot(rows, path) == 2 * 2 * 2 + 2 * 2
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="no forward or backward rows with TFLOPS"):
    plot_results.plot([{**row, "tflops": None} for row in rows], tmp_path / "empty.png")


def test_plot_script_selects_a_run(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  results = tmp_path / "results.json"
  results.write_text(json.dumps(sweep_rows(run=1) + sweep_rows(impl="cudnn", run=2)))
  assert plot_results.main([str(results), "--run", "2"]) == 0
  assert (tmp_path / "results.png").exists()
  assert "(8 lines)" in capsys.readouterr().out
  assert plot_results.main([str(results), "--run", "7"]) == 1


def test_decode_comparison_turns_packing_and_split_off_and_back():
  default = jax_flash_configs.BACKENDS["gpu"]
  with bench_decode.plain_kernel_calls():
    plain = jax_flash_configs.BACKENDS["gpu"]
    assert plain.query_tile_rows == 1 and plain.kv_split_ctas == 0
  assert jax_flash_configs.BACKENDS["gpu"] is default


def test_decode_benchmark_reads_the_kernel_calls_that_ran():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 1, 8, 64), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 96, 2, 64), jnp.bfloat16) for key in keys[1:])
  step = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                                     implementation="cpu"))
  compiled = step.lower(q, k, v).compile().as_text()
  # Four query heads per kv head, packed into the rows of one call.
  assert bench_decode.kernel_output_shapes(compiled) == ["bf16[2,4,2,64]"]
  assert bench_decode.kernel_output_shapes("%x = f32[2]{0} add(%a, %b)") == []


def test_decode_chain_feeds_each_output_to_the_next_step():
  steps = []
  run = bench_decode.chained(lambda q, k, v: steps.append(q) or q * k + v, 3)
  assert run(1, 2, 1) == 15 and steps == [1, 3, 7]


def test_decode_benchmark_needs_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  assert bench_decode.main([]) == 2


def test_median_results_take_each_op_over_the_rounds_that_measured_it():
  rounds = [
      {"cudnn": {"fwd_tflops": 100.0, "bwd_tflops": 80.0}, "jax_flash": {"fwd_tflops": 120.0}},
      {"cudnn": {"fwd_tflops": 90.0, "bwd_tflops": 70.0},
       "jax_flash": {"fwd_tflops": 110.0, "bwd_tflops": 75.0}},
      {"cudnn": {"fwd_tflops": 95.0, "bwd_tflops": 60.0},
       "jax_flash": {"fwd_tflops": 130.0, "bwd_tflops": 85.0}},
  ]
  medians = bench_attention.median_results(rounds)
  assert list(medians) == ["cudnn", "jax_flash"]
  assert medians["cudnn"] == {"fwd_tflops": 95.0, "bwd_tflops": 70.0}
  assert medians["jax_flash"] == {"fwd_tflops": 120.0, "bwd_tflops": 80.0}
  line = bench_attention.measured_line(
      benchmark.Config(2, 8192, 16, 128, False, "bfloat16"), "jax_flash (median)",
      medians["jax_flash"], medians["cudnn"], 500.0, 1.0)
  assert "1.26" in line and "1.14" in line  # 120 / 95 and 80 / 70



def test_compare_variants_takes_medians_per_library_over_rounds(tmp_path, capsys):
  config = {"head_dim": 64, "head_dim_v": 64, "seq_q": 1024, "causal": True, "op": "fwd"}
  rows = [{**config, "impl": "cudnn", "variant": "", "tflops": 300.0}]
  rows += [{**config, "impl": "jax_flash", "variant": f"shipped-{r}", "tflops": t}
           for r, t in enumerate((310.0, 330.0, 320.0), 1)]
  rows += [{**config, "impl": "jax_flash", "variant": f"tree-4-{r}", "tflops": t}
           for r, t in enumerate((340.0, 350.0), 1)]
  rows.append({**config, "impl": "jax_flash", "variant": "packed", "tflops": None})
  cell = compare_variants.timings(rows)[64, 64, 1024, True, "fwd"]
  assert cell == {"cudnn": [300.0], "shipped": [310.0, 330.0, 320.0], "tree-4": [340.0, 350.0]}
  path = tmp_path / "rows.json"
  path.write_text(json.dumps(rows))
  assert compare_variants.main([str(path)]) == 0
  header, line = capsys.readouterr().out.splitlines()
  assert header.split() == ["configuration", "cudnn", "shipped", "tree-4"]
  assert line.split() == ["hd64", "1024", "causal", "fwd", "300", "320", "[310-330]", "345", "[340-350]"]
  path.write_text("[]")
  assert compare_variants.main([str(path)]) == 1


def test_compare_variants_keeps_option_rows_apart():
  """bench_attention.py --deterministic / --softcap rows of a round are a
  library of their own, not one per round."""
  config = {"head_dim": 128, "head_dim_v": 128, "seq_q": 8192, "causal": False, "op": "bwd"}
  variants = {"shipped-1": 590.0, "shipped-1-deterministic": 530.0, "shipped-2-deterministic": 532.0,
              "x-2-softcap-20": 500.0, "x-2": 600.0, "deterministic": 520.0}
  rows = [{**config, "impl": "jax_flash", "variant": v, "tflops": t} for v, t in variants.items()]
  assert compare_variants.timings(rows)[128, 128, 8192, False, "bwd"] == {
      "shipped": [590.0], "shipped:deterministic": [530.0, 532.0], "x:softcap-20": [500.0], "x": [600.0],
      "deterministic": [520.0]}


def test_kernel_times_reports_every_implementation_and_head_dim(tmp_path):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
  import kernel_times
  out = tmp_path / "times.json"
  assert kernel_times.main(["--impls", "xla", "--head-dims", "32", "64", "--seq", "64", "--tokens", "64",
                            "--heads", "1", "--steps", "1", "--out", str(out)]) == 0
  report = json.loads(out.read_text())
  assert set(report["microseconds_per_step"]) == {"xla hd32", "xla hd64"}
  assert report["config"] == {"seq": 64, "tokens": 64, "heads": 1, "causal": False}
  for times in report["microseconds_per_step"].values():  # GPU activities only: none on a CPU
    assert all(us >= 0 for us in times.values())


def test_sustained_clocks_reports_a_row_per_measurement(tmp_path):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
  import sustained_clocks
  out = tmp_path / "clocks.json"
  assert sustained_clocks.main(["--impls", "xla", "--head-dims", "32", "--ops", "fwd", "step", "--seq", "64",
                                "--tokens", "64", "--heads", "1", "--seconds", "0.05", "--rounds", "2",
                                "--out", str(out)]) == 0
  report = json.loads(out.read_text())
  assert [(row["round"], row["op"]) for row in report["rows"]] == [(0, "fwd"), (0, "step"), (1, "fwd"),
                                                                   (1, "step")]
  config = benchmark.Config(batch=1, seq=64, heads=1, head_dim=32, causal=False)
  for row in report["rows"]:
    flops = config.forward_flops() + (config.backward_flops() if row["op"] == "step" else 0)
    assert row["ms"] > 0 and math.isclose(row["tflops"], flops / row["ms"] / 1e9, rel_tol=1e-9)
    if row["sm_mhz"] is None:  # no NVIDIA GPU here
      assert row["watts"] is None and row["tflops_per_ghz"] is None


def test_sustained_clocks_reads_nvidia_smi_samples():
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
  import sustained_clocks

  class Sampler:
    def terminate(self):
      pass

    def communicate(self):
      # Of seven readable samples the first two and last two are left out.
      return ("1980, 300.5, 40\n1700, 690.0, 60\n1710, 695.0, 62\n[N/A], 1, 1\n1720, 700.0, 63\n"
              "1690, 680.0, 61\n1400, 400.0, 50\n1980, 120.0, 50\n", None)

  assert sustained_clocks.stop_sampler(Sampler()) == dict(sm_mhz=1710.0, watts=695.0, max_temp_c=63.0)
  assert sustained_clocks.stop_sampler(None) == dict(sm_mhz=None, watts=None, max_temp_c=None)


def test_a_run_file_holds_its_header_once_and_reads_back(tmp_path):
  rows = sweep_rows() + sweep_rows(impl="cudnn", scale=0.8)
  header = benchmark.run_header(rows, 7, "abc1234", "bench_attention.py --seqs 1024", "a note")
  assert header["matmul_ceiling_tflops"] == 700.0 and header["number"] == 7
  path = tmp_path / "run.json"
  path.write_text(benchmark.run_document(header, rows))
  loaded = json.loads(path.read_text())
  assert loaded["run"] == header
  assert all(set(row).isdisjoint({"gpu", "jax", "date", "matmul_ceiling_tflops"})
             for row in loaded["rows"])
  assert len(path.read_text().splitlines()) == len(rows) + len(header) + 6  # a row a line
  back = benchmark.read_rows(path)
  assert [{k: row[k] for k in original} for row, original in zip(back, rows)] == rows
  assert {row["run"] for row in back} == {7}
  assert benchmark.read_runs(tmp_path) == [(path, header, loaded["rows"])]


def test_a_run_holds_one_gpu_and_complete_rows():
  rows = sweep_rows()
  with pytest.raises(ValueError, match="one gpu"):
    benchmark.run_header(rows + [{**rows[0], "gpu": "NVIDIA H200"}], 1, None, None, None)
  header = benchmark.run_header(rows, 1, None, None, None)
  with pytest.raises(ValueError, match="lacks"):
    benchmark.run_document(header, [{k: v for k, v in rows[0].items() if k != "ms"}])
  with pytest.raises(ValueError, match="lacks"):
    benchmark.run_document({"gpu": "NVIDIA H100"}, rows)


def test_add_run_numbers_runs_per_gpu(tmp_path, capsys):
  raw = tmp_path / "bench.json"
  raw.write_text(json.dumps(sweep_rows()))
  results = tmp_path / "results"
  results.mkdir()
  (results / "h100-2026-11-01-run041.json").write_text("{}")
  (results / "h200x4-2026-11-01-run077.json").write_text("{}")
  assert add_run.main([str(raw), "--command", "c", "--note", "n", "--results", str(results)]) == 0
  gpu = jax.devices()[0].device_kind
  series = add_run.gpu_series(gpu)
  [written] = [p for p in results.glob(f"{series}-*-run*.json") if p.stat().st_size > 2]
  assert written.name.endswith(f"-run{42 if series == 'h100' else 1:03d}.json")
  assert json.loads(written.read_text())["run"]["note"] == "n"
  assert add_run.gpu_series("NVIDIA H100 80GB HBM3") == "h100"
  assert add_run.gpu_series("NVIDIA H200", 4) == "h200x4"


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_committed_results_are_small_run_files():
  total = sum(path.stat().st_size for path in RESULTS.iterdir())
  assert total <= 2 * 1024 * 1024, f"benchmarks/results holds {total} bytes"
  runs = benchmark.read_runs(RESULTS)
  assert len(runs) >= 50
  for path, header, rows in runs:
    assert set(benchmark.RUN_FIELDS) <= set(header), path
    assert rows and all(set(benchmark.ROW_FIELDS) <= set(row) for row in rows), path
    assert path.name.startswith(add_run.gpu_series(header["gpu"])), path


def test_readme_table_is_the_newest_full_run():
  text = readme_table.table(readme_table.newest_full_run())
  readme = (RESULTS.parents[1] / "README.md").read_text()
  assert f"{readme_table.BEGIN}\n{text}\n{readme_table.END}" in readme, (
      "README's table is stale: python benchmarks/readme_table.py --write")


def test_readme_table_ratios_and_medians(tmp_path):
  rows = []
  for round_, scale in enumerate((1.0, 2.0, 1.5)):
    rows += [{**row, "round": round_} for row in sweep_rows(scale=scale)]
    rows += [{**row, "round": round_} for row in sweep_rows(impl="cudnn", scale=2 * scale)]
  header = benchmark.run_header(rows, 3, None, "git 1234567; bench_attention.py --rounds 3", "n")
  path = tmp_path / "h100-2026-11-30-run003.json"
  path.write_text(benchmark.run_document(header, rows))
  assert readme_table.newest_full_run(tmp_path) == path
  text = readme_table.table(path, seq=4096)
  assert "Medians of 3 rounds" in text and "`python benchmarks/bench_attention.py --rounds 3`" in text
  assert "1234567" not in text
  [line] = [line for line in text.splitlines() if line.startswith("| 64 |")]
  # cuDNN took twice jax_flash's time in every round: ratio 2 both ways.
  assert "(2.00 / 2.00)" in line and "deterministic" not in text


def test_main_reports_the_kernels_that_serve_this_device():
  lines, served = jax_flash_main.kernel_report()
  text = "\n".join(lines)
  assert "CPU kernels: built, usable" in text
  if jax.default_backend() == "cpu":
    assert served and "serving the default device: jax_flash CPU kernels" in text
    assert "GPU kernels:" in text and "not usable" in text


def test_main_checks_the_kernels_and_prints_one_table(monkeypatch, capsys):
  # One small shape and fake timings: the real ones are `python -m jax_flash`'s job.
  monkeypatch.setattr(jax_flash_main, "CHECKS", [(1, 17, 33, 4, 2, 64, True)])
  monkeypatch.setattr(benchmark, "measure", lambda impl, config, iters: fake_result(
      config=config, fwd_ms=1.0 if impl == "jax_flash" else 2.0))
  assert jax_flash_main.main([]) == 0
  out = capsys.readouterr().out
  assert "correctness: forward and backward match the float32 reference" in out
  table = [line for line in out.splitlines() if line.startswith("B")]
  assert len(table) == 4 and all(line.split()[-2] in ("2.00", "1.00") for line in table), out


def test_main_fails_on_a_kernel_error(monkeypatch, capsys):
  monkeypatch.setattr(jax_flash_main, "CHECKS", [(1, 17, 17, 2, 2, 64, False)])
  real = jax_flash.attention
  wrong = lambda q, k, v, **kw: real(q, k, v, **kw) * (1.1 if kw["implementation"] == "flash" else 1)
  monkeypatch.setattr(jax_flash, "attention", wrong)
  assert jax_flash_main.main(["--no-bench"]) == 1
  assert "FAILED" in capsys.readouterr().out
