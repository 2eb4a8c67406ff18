"""examples/generate.py: continuous batching on a paged cache completes every
request, its greedy tokens are the model's (against a float32 forward of
the whole sequence, by the tolerance principle), the jax.nn baseline agrees
where numerics allow, one prompt gets one completion whatever the batch, and
the same program runs tensor parallel over 8 CPU devices."""

import dataclasses
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example():
  spec = importlib.util.spec_from_file_location("generate", EXAMPLES / "generate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


generate = load_example()
sm = generate.sm

# 8 kv heads: one per device of the 8-device mesh; GQA groups of 2.
MODEL = sm.ModelConfig(layers=2, width=64, heads=16, kv_heads=8, head_dim=8, mlp=128)
SERVE = generate.ServeConfig(slots=3, lanes=1, chunk=8, page_size=16, max_len=64, bucket=32)
# Awkward lengths: a 1-token prompt, prompts of several chunks, one output
# token, requests arriving while others run; more requests than slots.
LENGTHS = [(1, 6), (17, 1), (40, 20), (5, 12), (23, 5), (9, 24), (30, 8), (16, 16)]
ARRIVALS = [0, 0, 0, 2, 2, 5, 9, 30]


def requests_of(lengths=LENGTHS, seed=0):
  rng = np.random.default_rng(seed)
  return [generate.Request(prompt=rng.integers(32, 127, size=n).astype(np.int32),
                           max_tokens=m, temperature=0.0 if i % 3 else 0.9, seed=i,
                           arrival_step=ARRIVALS[i % len(ARRIVALS)])
          for i, (n, m) in enumerate(lengths)]


@pytest.fixture(scope="module")
def params():
  return jax.tree.map(lambda w: w.astype(jnp.bfloat16), sm.init_params(MODEL, seed=3))


def one_device_mesh():
  return jax.make_mesh((1,), (sm.TP,), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def engines(params):
  return {name: generate.Engine(params, MODEL, SERVE, one_device_mesh(), name)
          for name in generate.ATTENTIONS}


def dense_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


_sequence_logits = jax.jit(sm.sequence_logits, static_argnums=(2, 3))


def reference_logits(params, requests, model=MODEL, serve=SERVE):
  """Per request, (float32 logits, the naive bfloat16 model's logits) of
  its served sequence, each row the prediction of the next token, computed
  without a cache (all requests in one padded batch: causal rows never see
  the padding after them)."""
  sequences = [np.concatenate([r.prompt, np.int32(r.tokens[:-1])]) for r in requests]
  tokens = np.zeros((len(requests), serve.max_len), np.int32)
  for row, sequence in zip(tokens, sequences):
    row[:len(sequence)] = sequence
  exact = jax.tree.map(lambda w: w.astype(jnp.float32), params)
  with jax.default_matmul_precision("highest"):
    ref = _sequence_logits(exact, tokens, model, dense_attention)
  naive = _sequence_logits(params, tokens, model, dense_attention)
  return [(np.asarray(ref[i, len(r.prompt) - 1:len(s)], np.float64),
           np.asarray(naive[i, len(r.prompt) - 1:len(s)], np.float64))
          for i, (r, s) in enumerate(zip(requests, sequences))]


def check_greedy_tokens(params, requests, model=MODEL, serve=SERVE):
  """Each greedy token is the float32 model's argmax, or within twice the
  naive bfloat16 model's logit error of it (a near tie that rounding may
  decide either way). Returns each request's (reference logits, tolerance)."""
  checked = []
  for request, (ref, naive) in zip(requests, reference_logits(params, requests, model, serve)):
    tolerance = 2 * np.max(np.abs(naive - ref)) + 1e-3
    if request.temperature == 0:
      chosen = ref[np.arange(len(request.tokens)), request.tokens]
      np.testing.assert_array_less(ref.max(axis=1) - chosen, tolerance)
    checked.append((ref, tolerance))
  return checked


def test_continuous_batching_completes_every_request(engines, params):
  requests = requests_of()
  timing = engines["jax_flash"].run(requests)
  for request in requests:
    assert len(request.tokens) == len(request.fingerprints) == request.max_tokens
    assert all(0 <= t < sm.VOCAB for t in request.tokens)
    assert request.admitted_s <= request.token_s[0] and np.all(np.diff(request.token_s) >= 0)
  check_greedy_tokens(params, requests)
  # Requests joined as others left: fewer steps than one request at a time.
  alone = sum(-(-len(r.prompt) // SERVE.chunk) + r.max_tokens - 1 for r in requests)
  assert timing["steps"] < alone
  summary = generate.summarize(requests, timing)
  assert summary["output_tokens"] == sum(m for _, m in LENGTHS)
  assert summary["ttft_ms_p50"] > 0 and summary["itl_ms_p99"] >= summary["itl_ms_p50"] > 0


@pytest.mark.slow
def test_baseline_agrees_where_numerics_allow(engines, params):
  served = {name: requests_of() for name in generate.ATTENTIONS}
  for name, requests in served.items():
    engines[name].run(requests)
  check_greedy_tokens(params, served["jax_nn"])
  references = check_greedy_tokens(params, served["jax_flash"])
  for flash, baseline, (ref, tolerance) in zip(served["jax_flash"], served["jax_nn"], references):
    if flash.temperature:
      continue
    differ = np.flatnonzero(np.asarray(flash.tokens) != np.asarray(baseline.tokens))
    if differ.size:  # only at a near tie of the float32 model
      top2 = np.sort(ref[differ[0]])[-2:]
      assert top2[1] - top2[0] < tolerance, (flash.tokens, baseline.tokens)


def test_cache_is_donated_and_written_in_place():
  # float32: XLA:CPU makes a float32 copy of a bfloat16 scatter's operand.
  model = dataclasses.replace(MODEL, layers=1, dtype="float32")
  serve = dataclasses.replace(SERVE, pool_tokens=16384)
  params = sm.init_params(model, seed=0)
  engine = generate.Engine(params, model, serve, one_device_mesh(), "jax_flash")
  engine.warm_up()
  cache_bytes = sum(k.nbytes + v.nbytes for k, v in engine.cache)
  memory = engine._compiled[None].memory_analysis()
  assert memory.alias_size_in_bytes >= cache_bytes
  assert memory.temp_size_in_bytes < cache_bytes // 10  # a large pool, a small step


def test_request_that_cannot_fit_is_refused(engines):
  with pytest.raises(ValueError, match="prompt \\+ max_tokens <= max_len=64, got 60 \\+ 5"):
    engines["jax_flash"].run([generate.Request(prompt=np.ones(60, np.int32), max_tokens=5)])


def invariance(engine, mixes, temperature=0.0):
  return generate.invariance(engine, generate.probe_prompt(20), 10, temperature, mixes,
                             prompt_range=(1, 40), output_range=(1, 16), seed=5)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_one_completion_whatever_the_batch(engines, temperature):
  result = invariance(engines["jax_flash"], mixes=5, temperature=temperature)
  assert result["distinct_completions"] == result["distinct_logits"] == 1, result


def test_a_batch_dependent_sampler_is_caught(params, monkeypatch):
  """The experiment can fail: one key for the whole step makes a row's draw
  depend on its slot and step, and the probe's completions differ."""
  def shared_key(logits, temperature, seeds, positions):
    scaled = logits / jnp.maximum(temperature, 1e-3)[:, None]
    drawn = jax.random.categorical(jax.random.key(0), scaled)
    return drawn.astype(jnp.int32)

  monkeypatch.setattr(sm, "sample", shared_key)
  engine = generate.Engine(params, MODEL, SERVE, one_device_mesh(), "jax_flash")
  result = invariance(engine, mixes=5, temperature=1.0)
  assert result["distinct_completions"] > 1, result


@pytest.mark.slow
def test_tensor_parallel_over_8_devices(params, engines):
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, {jax.default_backend()} has {len(jax.devices())}")
  mesh = jax.make_mesh((8,), (sm.TP,), devices=jax.devices()[:8])
  engine = generate.Engine(params, MODEL, SERVE, mesh, "jax_flash")
  assert engine.cache[0][0].sharding.spec == generate.CACHE_SPEC
  assert len(engine.cache[0][0].addressable_shards) == 8
  requests = requests_of()
  engine.run(requests)
  assert [len(r.tokens) for r in requests] == [m for _, m in LENGTHS]
  check_greedy_tokens(params, requests)
  result = invariance(engine, mixes=3)
  assert result["distinct_completions"] == result["distinct_logits"] == 1, result


TINY_CLI = ["--cpu-sizes", "--layers", "1", "--width", "32", "--mlp", "64", "--requests", "6",
            "--prompt-max", "24", "--output-max", "8", "--bucket", "0", "--train-steps", "0",
            "--tp", "1", "--no-progress"]


@pytest.mark.slow
def test_serve_mode_writes_a_results_row(tmp_path, capsys):
  from jax_flash import _benchmark as benchmark
  results = tmp_path / "cpu-serve.json"
  report = generate.main(["--attention", "jax_flash", "--results",
                          str(results), *TINY_CLI])
  printed = capsys.readouterr().out
  assert "jax_flash: 6 requests, " in printed and "inter-token latency" in printed
  (row,) = benchmark.read_rows(results)
  assert (row["impl"], row["op"], row["variant"], row["batch"]) == (
      "jax_flash", "serve", "paged", generate.CPU_SERVE["slots"])
  assert set(benchmark.ROW_FIELDS) <= set(row)
  assert row["output_tokens_per_s"] == report["jax_flash"]["output_tokens_per_s"] > 0
  header = json.loads(results.read_text())["run"]
  assert set(benchmark.RUN_FIELDS) <= set(header)
  assert header["model"]["parameters"] == sm.ModelConfig(
      **sm.CPU_MODEL | {"layers": 1, "width": 32, "mlp": 64}).parameter_count()


@pytest.mark.slow
def test_both_attentions_and_the_speedup(tmp_path, capsys):
  from jax_flash import _benchmark as benchmark
  results = tmp_path / "cpu-serve.json"
  generate.main(["--results", str(results), *TINY_CLI])
  printed = capsys.readouterr().out
  assert "jax_nn: 6 requests, " in printed and "jax_flash / jax.nn output tokens/s" in printed
  rows = benchmark.read_rows(results)
  assert [(r["impl"], r["variant"]) for r in rows] == [("jax_flash", "paged"),
                                                      ("xla", "contiguous-bucket0")]
  assert rows[0]["vs_baseline"] == pytest.approx(
      rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"], rel=1e-2)


@pytest.mark.slow
def test_one_completion_in_100_batch_mixes(engines):
  for temperature in (0.0, 1.0):
    result = invariance(engines["jax_flash"], mixes=100, temperature=temperature)
    assert result["distinct_completions"] == result["distinct_logits"] == 1, result
    baseline = invariance(engines["jax_nn"], mixes=100, temperature=temperature)
    print(f"temperature {temperature}: jax_flash 1 completion in 100 mixes; jax.nn baseline "
          f"{baseline['distinct_completions']} ({baseline['distinct_logits']} logit sequences)")


@pytest.mark.gpu
def test_hopper_kernel_serves_and_is_batch_invariant():
  """On a GPU the paged calls run the Hopper kernel (head dim 64): greedy
  tokens by the tolerance principle, one completion in 20 batch mixes."""
  model = sm.ModelConfig(layers=2, width=256, heads=8, kv_heads=2, head_dim=64, mlp=512)
  serve = generate.ServeConfig(slots=4, lanes=1, chunk=32, page_size=16, max_len=176)
  params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), sm.init_params(model, seed=4))
  engine = generate.Engine(params, model, serve, one_device_mesh(), "jax_flash")
  requests = requests_of([(n * 3, m * 2) for n, m in LENGTHS])
  engine.run(requests)
  assert generate.jax_flash._paged._PAGED_TARGET in engine._compiled[None].as_text()
  assert [len(r.tokens) for r in requests] == [m * 2 for _, m in LENGTHS]
  check_greedy_tokens(params, requests, model, serve)
  for temperature in (0.0, 1.0):
    result = generate.invariance(engine, generate.probe_prompt(60), 24, temperature, 20,
                                 prompt_range=(1, 90), output_range=(1, 32), seed=6)
    assert result["distinct_completions"] == result["distinct_logits"] == 1, result
