"""Serves a small Llama-style decoder from a paged KV cache with jax_flash.

A stream of requests (different prompt and output lengths, greedy or seeded
sampling) runs through one jitted step over a ragged batch of fixed shape:

* ``slots`` decode rows, one token for each request that is generating;
* ``lanes`` prefill rows of ``chunk`` prompt tokens each (chunked prefill).

Requests join as soon as a slot is free (continuous batching); the step
compiles once. Its attention writes the new tokens' keys and values with
``jax_flash.write_paged_cache`` and runs ``jax_flash.paged_attention`` twice
per layer (the decode rows and the prefill rows) on one page pool. The heads
and the MLP are split over the available devices (tensor parallel,
``jax.shard_map`` over the mesh axis ``tp``).

The baseline (``--attention jax_nn``) is the same model and loop with what a
JAX user writes today: a contiguous cache ``[slots, max_len]`` and
``jax.nn.dot_product_attention`` over its first ``span`` keys, ``span`` the
step's longest sequence rounded up to ``--bucket`` tokens (one compiled step
per span; ``--bucket 0`` attends over the whole cache).

Modes:

    python examples/generate.py --cpu-sizes                  # both attentions, a summary each
    python examples/generate.py --mode invariance --mixes 100  # one prompt in 100 batch mixes
    python examples/generate.py --results benchmarks/results/h100-DATE-serve.json  # op "serve" rows

The GPU default model (8 layers, width 2048, 16 query / 4 kv heads of 128,
MLP 5632: 0.36 B parameters, 0.72 GB in bfloat16) is sized so that attention
matters: a token's keys and values take 16 KB, so 64 requests of 4k tokens
hold 4.3 GB of cache, which a decode step reads against 0.72 GB of weights.
``--cpu-sizes`` serves a 2-layer model (8 kv heads, head dim 16) a CPU
trains and serves in seconds. Weights are trained briefly at start
(``--train-steps``) on generated text, or loaded from ``--weights`` (written
there by an earlier run).
"""

import argparse
import collections
import dataclasses
import datetime
import functools
import math
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import serving_model as sm  # noqa: E402  (this file's folder on the path first)

import jax_flash  # noqa: E402

ATTENTIONS = ("jax_flash", "jax_nn")
IMPLS = {"jax_flash": "jax_flash", "jax_nn": "xla"}  # the results files' impl names
CACHE_SPEC = P(None, None, sm.TP, None)  # both caches: the kv-head axis split over devices


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """The step's shape and the cache; the defaults are the GPU's."""

  slots: int = 64  # requests generating at once: the step's decode rows
  lanes: int = 1  # requests prefilled at once
  chunk: int = 1024  # prompt tokens per lane and step
  page_size: int = 64
  max_len: int = 8704  # tokens of one request at most, prompt and output
  pool_tokens: int = 0  # page pool size; 0: slots * max_len
  bucket: int = 1024  # the baseline's span granularity; 0: the whole cache

  @property
  def max_pages(self) -> int:
    return -(-self.max_len // self.page_size)

  @property
  def num_pages(self) -> int:
    return -(-(self.pool_tokens or self.slots * self.max_len) // self.page_size)


CPU_SERVE = dict(slots=4, lanes=1, chunk=16, page_size=16, max_len=160, bucket=32)


@dataclasses.dataclass(eq=False)  # compared by identity
class Request:
  """One request, and what the engine records about it."""

  prompt: np.ndarray
  max_tokens: int
  temperature: float = 0.0  # 0: greedy
  seed: int = 0  # the sampling key is fold_in(key(seed), position)
  arrival_step: int = 0
  tokens: list = dataclasses.field(default_factory=list)
  fingerprints: list = dataclasses.field(default_factory=list)  # of each token's logits
  token_s: list = dataclasses.field(default_factory=list)  # when the host saw each token
  admitted_s: float = math.nan
  slot: int = -1
  cached: int = 0  # tokens in the cache
  generated: int = 0  # tokens sampled (the host's count: it runs a step ahead of the tokens)
  pages: list = dataclasses.field(default_factory=list)

  @property
  def prefilling(self) -> bool:
    return self.cached < len(self.prompt)


# ----------------------------------------------------------------------------- the step


def split_rows(x, batch):
  """Flat rows -> (decode rows [slots, 1, ...], prefill rows [lanes, chunk, ...])."""
  slots = batch["decode_new"].shape[0]
  return x[:slots, None], x[slots:].reshape(*batch["lane_tokens"].shape, *x.shape[1:])


def join_rows(decode, lanes):
  return jnp.concatenate([decode[:, 0], lanes.reshape(-1, *lanes.shape[2:])])


def lane_slots(batch):
  return jnp.clip(batch["lane_slot"], 0, batch["decode_new"].shape[0] - 1)


def attend_paged(layer, q, k, v, cache, batch, span):
  """jax_flash: write both row groups' keys and values into the page pool,
  then attend, the decode rows in one call (one new token each: the kernel
  packs each GQA group into one tile) and the prefill lanes in another."""
  del layer, span
  k_pages, v_pages = cache
  (qd, ql), (kd, kl), (vd, vl) = (split_rows(x, batch) for x in (q, k, v))
  table = batch["page_table"]
  lane_table = table[lane_slots(batch)]
  decode = (table, batch["decode_lengths"], batch["decode_new"])
  lanes = (lane_table, batch["lane_lengths"], batch["lane_new"])
  k_pages, v_pages = jax_flash.write_paged_cache(k_pages, v_pages, kd, vd, *decode)
  k_pages, v_pages = jax_flash.write_paged_cache(k_pages, v_pages, kl, vl, *lanes)
  out_decode = jax_flash.paged_attention(qd, k_pages, v_pages, decode[0], decode[1],
                                         query_lengths=decode[2])
  out_lanes = jax_flash.paged_attention(ql, k_pages, v_pages, lanes[0], lanes[1],
                                        query_lengths=lanes[2])
  return join_rows(out_decode, out_lanes), (k_pages, v_pages)


def attend_contiguous(layer, q, k, v, cache, batch, span):
  """The baseline: a cache row per slot, jax.nn.dot_product_attention over
  its first ``span`` keys (a mask for the prefill rows' causal diagonal)."""
  del layer
  k_cache, v_cache = cache
  slots, max_len = k_cache.shape[:2]
  (qd, ql), (kd, kl), (vd, vl) = (split_rows(x, batch) for x in (q, k, v))
  chunk = ql.shape[1]
  decode_at = jnp.where(batch["decode_new"] > 0, batch["decode_lengths"] - 1, max_len)
  start = batch["lane_lengths"] - batch["lane_new"]
  row = jnp.arange(chunk)
  lane_at = jnp.where(row < batch["lane_new"][:, None], start[:, None] + row, max_len)
  lanes = lane_slots(batch)

  def write(cache, new_decode, new_lanes):  # rows at max_len are dropped
    cache = cache.at[jnp.arange(slots), decode_at].set(new_decode[:, 0], mode="drop")
    return cache.at[lanes[:, None], lane_at].set(new_lanes, mode="drop")

  k_cache, v_cache = write(k_cache, kd, kl), write(v_cache, vd, vl)
  keys, values = k_cache[:, :span], v_cache[:, :span]
  out_decode = jax.nn.dot_product_attention(qd, keys, values,
                                            key_value_seq_lengths=batch["decode_lengths"])
  key = jnp.arange(span)
  visible = ((key[None, None] <= start[:, None, None] + row[None, :, None])
             & (key[None, None] < batch["lane_lengths"][:, None, None]))
  out_lanes = jax.nn.dot_product_attention(ql, keys[lanes], values[lanes],
                                           mask=visible[:, None])
  return join_rows(out_decode, out_lanes), (k_cache, v_cache)


def step_fn(model: sm.ModelConfig, attend, span, params, cache, previous, batch):
  """One step on one device's heads: the decode rows' tokens are the ones the
  previous step sampled (``previous [slots]``, never copied to the host in
  between), then ``lanes * chunk`` prompt tokens. Returns (the token each
  slot samples [slots], a fingerprint per sampled row, the cache)."""
  slots = previous.shape[0]
  lanes, chunk = batch["lane_tokens"].shape
  tokens = jnp.concatenate([previous, batch["lane_tokens"].reshape(-1)])
  lane_start = batch["lane_lengths"] - batch["lane_new"]
  positions = jnp.concatenate([jnp.maximum(batch["decode_lengths"] - 1, 0),
                               (lane_start[:, None] + jnp.arange(chunk)).reshape(-1)])
  attend = functools.partial(attend, batch=batch, span=span)
  hidden, cache = sm.forward(params, tokens, positions, model, attend, cache,
                             reduce=lambda x: jax.lax.psum(x, sm.TP))
  last_rows = slots + jnp.arange(lanes) * chunk + jnp.maximum(batch["lane_new"] - 1, 0)
  logits = sm.logits_of(params, hidden[jnp.concatenate([jnp.arange(slots), last_rows])])
  owner = jnp.concatenate([jnp.arange(slots), lane_slots(batch)])
  sampled = sm.sample(logits, batch["temperature"][owner], batch["seed"][owner],
                   jnp.concatenate([batch["decode_lengths"], batch["lane_lengths"]]))
  finishing = jnp.where(batch["lane_final"], batch["lane_slot"], slots)
  slot_tokens = sampled[:slots].at[finishing].set(sampled[slots:], mode="drop")
  return slot_tokens, sm.fingerprint(logits), cache


# ----------------------------------------------------------------------------- the engine


class Engine:
  """Continuous batching over one cache: ``run`` serves a list of requests."""

  def __init__(self, params, model: sm.ModelConfig, serve: ServeConfig, mesh, attention: str):
    if attention not in ATTENTIONS:
      raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    self.model, self.serve, self.mesh, self.attention = model, serve, mesh, attention
    tp = mesh.shape[sm.TP]
    if model.kv_heads % tp or model.mlp % tp:
      raise ValueError(f"the mesh's {tp} devices must divide kv_heads={model.kv_heads} and "
                       f"mlp={model.mlp}")
    specs = sm.param_specs(model)
    placed = jax.tree.map(lambda w, spec: jax.device_put(w.astype(model.dtype),
                                                         NamedSharding(mesh, spec)),
                          params, specs)
    self.params = placed
    self.replicated = NamedSharding(mesh, P())
    if attention == "jax_flash":
      shape = (serve.num_pages, serve.page_size, model.kv_heads, model.head_dim)
    else:
      shape = (serve.slots, serve.max_len, model.kv_heads, model.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, model.dtype),
                    out_shardings=NamedSharding(mesh, CACHE_SPEC))
    self.cache = [(zeros(), zeros()) for _ in range(model.layers)]
    self._specs = specs
    self._compiled = {}  # span -> compiled step (held here: jax.clear_caches leaves it)

  def spans(self) -> list:
    """The spans the baseline compiles a step for; [None] for jax_flash."""
    serve = self.serve
    if self.attention == "jax_flash":
      return [None]
    if not serve.bucket:
      return [serve.max_len]
    return sorted({min(b, serve.max_len) for b in range(serve.bucket, serve.max_len
                                                         + serve.bucket, serve.bucket)})

  def span_for(self, longest: int):
    if self.attention == "jax_flash":
      return None
    return next(span for span in self.spans() if span >= longest)

  def _step(self, span, previous, batch):
    if span not in self._compiled:
      attend = attend_paged if self.attention == "jax_flash" else attend_contiguous
      cache_specs = [(CACHE_SPEC, CACHE_SPEC)] * self.model.layers
      body = jax.shard_map(functools.partial(step_fn, self.model, attend, span),
                           mesh=self.mesh, in_specs=(self._specs, cache_specs, P(), P()),
                           out_specs=(P(), P(), cache_specs))
      jitted = jax.jit(body, donate_argnums=(1,))
      self._compiled[span] = jitted.lower(self.params, self.cache, previous, batch).compile()
    return self._compiled[span]

  def warm_up(self) -> None:
    """Compiles every step variant before anything is timed."""
    for span in self.spans():
      self._step(span, self._no_tokens(), self._empty_inputs())

  def _no_tokens(self):
    return jax.device_put(np.zeros(self.serve.slots, np.int32), self.replicated)

  def _empty_inputs(self) -> dict:
    serve, slots, lanes = self.serve, self.serve.slots, self.serve.lanes
    return {"decode_lengths": np.zeros(slots, np.int32), "decode_new": np.zeros(slots, np.int32),
            "lane_tokens": np.zeros((lanes, serve.chunk), np.int32),
            "lane_slot": np.full(lanes, slots, np.int32), "lane_lengths": np.zeros(lanes, np.int32),
            "lane_new": np.zeros(lanes, np.int32), "lane_final": np.zeros(lanes, bool),
            "page_table": np.zeros((slots, serve.max_pages), np.int32),
            "temperature": np.zeros(slots, np.float32), "seed": np.zeros(slots, np.uint32)}

  def check(self, request: Request) -> None:
    serve = self.serve
    total = len(request.prompt) + request.max_tokens
    if len(request.prompt) == 0 or request.max_tokens < 1 or total > serve.max_len:
      raise ValueError(f"a request needs a prompt, max_tokens >= 1 and prompt + max_tokens <= "
                       f"max_len={serve.max_len}, got {len(request.prompt)} + "
                       f"{request.max_tokens}")
    if -(-total // serve.page_size) > serve.num_pages:
      raise ValueError(f"prompt + max_tokens = {total} tokens need more pages than the pool's "
                       f"{serve.num_pages} of {serve.page_size}")

  def run(self, requests, *, slot_order=None, page_seed: int = 0, chunk_limit: int | None = None,
          progress: bool = False) -> dict:
    """Serves ``requests`` (filled in place) until all finish; returns timings.

    A request joins at the first step at or after its ``arrival_step`` that
    finds a free slot (tried in ``slot_order``) and, for the paged cache,
    free pages for its prompt and output (taken from a pool shuffled by
    ``page_seed``); the lanes prefill requests in the order they joined,
    ``chunk_limit`` tokens per step at most (the step's ``chunk`` by
    default). The host never waits for a token to schedule a step: requests
    stop at ``max_tokens``, and each step's tokens are read while the next
    one runs."""
    serve = self.serve
    for request in requests:
      self.check(request)
    state = _RunState(
        queue=collections.deque(sorted(requests, key=lambda r: r.arrival_step)),
        order=list(range(serve.slots)) if slot_order is None else list(slot_order),
        free_pages=[int(p) for p in np.random.default_rng(page_seed).permutation(serve.num_pages)],
        table=np.zeros((serve.slots, serve.max_pages), np.int32), active=[None] * serve.slots,
        chunk=min(chunk_limit or serve.chunk, serve.chunk))
    previous = self._no_tokens()
    bar = tqdm.tqdm(total=sum(r.max_tokens for r in requests), disable=not progress,
                    desc=self.attention, unit="tok")
    pending, step, steps_run, start = None, 0, 0, time.perf_counter()
    while state.queue or any(state.active):
      self._admit(state, step)
      if not any(state.active):  # nothing has arrived yet
        step = state.queue[0].arrival_step
        continue
      batch, lanes, longest = self._inputs(state)
      outputs = self._step(self.span_for(longest), previous, batch)(
          self.params, self.cache, previous, jax.device_put(batch, self.replicated))
      previous, fingerprints, self.cache = outputs
      if pending is not None:
        self._collect(*pending, bar)
      pending = ((previous, fingerprints), self._advance(state, lanes))
      step, steps_run = step + 1, steps_run + 1
    if pending is not None:
      self._collect(*pending, bar)
    bar.close()
    return {"seconds": time.perf_counter() - start, "steps": steps_run}

  def _admit(self, state, step):
    for slot in state.order:
      if not state.queue or state.queue[0].arrival_step > step:
        return
      if state.active[slot] is not None:
        continue
      request = state.queue[0]
      if self.attention == "jax_flash":
        needed = -(-(len(request.prompt) + request.max_tokens) // self.serve.page_size)
        if needed > len(state.free_pages):
          return  # waits for pages (first come, first served)
        request.pages = [state.free_pages.pop() for _ in range(needed)]
        state.table[slot, :needed] = request.pages
      state.queue.popleft()
      request.slot, request.cached, request.generated = slot, 0, 0
      request.tokens, request.fingerprints, request.token_s = [], [], []
      request.admitted_s = time.perf_counter()
      state.active[slot] = request
      state.prefilling.append(request)

  def _inputs(self, state):
    """The step's host inputs: a decode row for each generating request, the
    lanes for the requests that joined first among those still prefilling."""
    batch = self._empty_inputs()
    batch["page_table"] = state.table.copy()
    longest = 0
    for slot, request in enumerate(state.active):
      if request is None:
        continue
      batch["temperature"][slot], batch["seed"][slot] = request.temperature, request.seed
      if not request.prefilling:
        batch["decode_new"][slot], batch["decode_lengths"][slot] = 1, request.cached + 1
        longest = max(longest, request.cached + 1)
    lanes = [(r, min(state.chunk, len(r.prompt) - r.cached))
             for r in state.prefilling[:self.serve.lanes]]
    for lane, (request, new) in enumerate(lanes):
      batch["lane_tokens"][lane, :new] = request.prompt[request.cached:request.cached + new]
      batch["lane_slot"][lane], batch["lane_new"][lane] = request.slot, new
      batch["lane_lengths"][lane] = request.cached + new
      batch["lane_final"][lane] = request.cached + new == len(request.prompt)
      longest = max(longest, request.cached + new)
    return batch, lanes, longest

  def _advance(self, state, lanes):
    """The host's state after the step just dispatched. Returns which
    requests sampled a token in it, with their row of its outputs; requests
    that reach ``max_tokens`` leave, their slot and pages free for the next."""
    sampled = [(request, slot) for slot, request in enumerate(state.active)
               if request is not None and not request.prefilling]
    for request, _ in sampled:
      request.cached += 1
    for lane, (request, new) in enumerate(lanes):
      request.cached += new
      if not request.prefilling:
        state.prefilling.remove(request)
        sampled.append((request, self.serve.slots + lane))
    for request, _ in sampled:
      request.generated += 1
      if request.generated == request.max_tokens:
        state.active[request.slot] = None
        state.free_pages.extend(request.pages)
        request.pages = []
    return sampled

  def _collect(self, outputs, sampled, bar):
    tokens, fingerprints = (np.asarray(x) for x in outputs)
    now = time.perf_counter()
    for request, row in sampled:
      request.tokens.append(int(tokens[request.slot]))
      request.fingerprints.append(int(fingerprints[row]))
      request.token_s.append(now)
    bar.update(len(sampled))


@dataclasses.dataclass
class _RunState:
  queue: collections.deque  # requests not yet admitted, by arrival
  order: list  # slots in the order admission tries them
  free_pages: list
  table: np.ndarray  # [slots, max_pages] page ids
  active: list  # the request in each slot, or None
  chunk: int  # prompt tokens per lane and step
  prefilling: list = dataclasses.field(default_factory=list)  # in the order they joined


# ----------------------------------------------------------------------------- requests, summary


def make_requests(count, prompt_range, output_range, seed, arrival_steps=0):
  """Prompts cut from generated text, lengths uniform in the ranges; every
  other request samples (temperature 0.8, its own seed), the rest are greedy."""
  rng = np.random.default_rng(seed)
  text = sm.encode(sm.corpus(num_lines=max(prompt_range[1] // 8, 200), seed=seed))
  requests = []
  for i in range(count):
    length = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
    offset = int(rng.integers(0, len(text) - length + 1))
    requests.append(Request(prompt=text[offset:offset + length],
                            max_tokens=int(rng.integers(output_range[0], output_range[1] + 1)),
                            temperature=0.8 if i % 2 else 0.0, seed=int(rng.integers(1 << 31)),
                            arrival_step=int(rng.integers(0, arrival_steps + 1))))
  return requests


def percentiles(values, name) -> dict:
  values = np.asarray(values, np.float64) * 1e3
  if values.size == 0:
    return {f"{name}_ms_p{q}": None for q in (50, 90, 99)}
  return {f"{name}_ms_p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)}


def summarize(requests, timing) -> dict:
  """Requests/s and output tokens/s over the run's wall time; time to first
  token from the step a request joined; inter-token latency between a
  request's consecutive tokens, as the host saw them."""
  seconds = timing["seconds"]
  output_tokens = sum(len(r.tokens) for r in requests)
  gaps = [np.diff(r.token_s) for r in requests if len(r.token_s) > 1]
  return {"requests": len(requests), "output_tokens": output_tokens,
          "prompt_tokens": int(sum(len(r.prompt) for r in requests)),
          "seconds": round(seconds, 3), "steps": timing["steps"],
          "step_ms": round(1e3 * seconds / max(timing["steps"], 1), 3),
          "requests_per_s": round(len(requests) / seconds, 3),
          "output_tokens_per_s": round(output_tokens / seconds, 1),
          **percentiles([r.token_s[0] - r.admitted_s for r in requests], "ttft"),
          **percentiles(np.concatenate(gaps) if gaps else [], "itl")}


def print_summary(name, summary) -> None:
  print(f"{name}: {summary['requests']} requests, {summary['output_tokens']} output tokens in "
        f"{summary['seconds']:.2f} s ({summary['steps']} steps, {summary['step_ms']:.2f} ms/step)"
        f": {summary['requests_per_s']:.2f} requests/s, {summary['output_tokens_per_s']:.1f} "
        "output tokens/s")
  for label, key in (("time to first token", "ttft"), ("inter-token latency", "itl")):
    print(f"  {label:<20} ms: " + "  ".join(
        f"p{q} {summary[f'{key}_ms_p{q}']}" for q in (50, 90, 99)))


# ----------------------------------------------------------------------------- batch invariance


PROBE_TASK = "reverse jax = "


def probe_prompt(length: int) -> np.ndarray:
  """``length`` tokens of generated text ending in an open task."""
  text, rng = "", np.random.default_rng(2024)
  while len(text) < length:
    text += sm.corpus_line(rng) + "\n"
  return sm.encode(text + PROBE_TASK)[-length:]


def batch_mixes(serve: ServeConfig, prompt_range, output_range, mixes: int, seed: int):
  """The other requests of each mix and how the engine meets them: how many
  (none to twice the slots), their prompts, lengths, sampling and arrival
  steps, the probe's arrival step and place in the queue, the order slots
  are tried in, the page pool's shuffle and the prefill chunk (so that the
  probe's prompt is cut at other tokens)."""
  rng = np.random.default_rng(seed)
  for mix in range(mixes):
    others = make_requests(int(rng.integers(0, 2 * serve.slots + 1)), prompt_range,
                           output_range, seed=seed * 7919 + mix, arrival_steps=6)
    yield (others, int(rng.integers(0, len(others) + 1)), int(rng.integers(0, 7)),
           {"slot_order": rng.permutation(serve.slots), "page_seed": int(rng.integers(1 << 31)),
            "chunk_limit": int(rng.integers(1, serve.chunk + 1))})


def invariance(engine, prompt, probe_tokens, temperature, mixes, prompt_range, output_range,
               seed=0, progress=False) -> dict:
  """One prompt completed in ``mixes`` batch mixes: how many distinct
  completions, and distinct sequences of logit fingerprints, it got."""
  completions, logits = collections.Counter(), collections.Counter()
  for others, place, arrival, how in tqdm.tqdm(
      batch_mixes(engine.serve, prompt_range, output_range, mixes, seed), total=mixes,
      disable=not progress, desc=f"{engine.attention} mixes"):
    probe = Request(prompt=prompt, max_tokens=probe_tokens, temperature=temperature, seed=7,
                    arrival_step=arrival)
    engine.run(others[:place] + [probe] + others[place:], **how)
    completions[tuple(probe.tokens)] += 1
    logits[tuple(probe.fingerprints)] += 1
  common = completions.most_common(1)[0][0]
  return {"mixes": mixes, "distinct_completions": len(completions),
          "distinct_logits": len(logits), "completion": sm.decode(common),
          "counts": sorted(completions.values(), reverse=True)}


# ----------------------------------------------------------------------------- the program

GPU_STREAM = dict(requests=128, prompt_min=1024, prompt_max=8192, output_min=128, output_max=512,
                  probe_tokens=128)
CPU_STREAM = dict(requests=16, prompt_min=8, prompt_max=96, output_min=4, output_max=48,
                  probe_tokens=32)
MODEL_FLAGS = ("layers", "width", "heads", "kv_heads", "head_dim", "mlp")
SERVE_FLAGS = ("slots", "lanes", "chunk", "page_size", "max_len", "pool_tokens", "bucket")
HELP = {"layers": "decoder layers", "width": "model width", "heads": "query heads",
        "kv_heads": "key / value heads", "head_dim": "head dim", "mlp": "MLP hidden units",
        "slots": "requests generating at once (decode rows per step)",
        "lanes": "requests prefilled at once", "chunk": "prompt tokens per lane and step",
        "page_size": "tokens per page", "max_len": "tokens per request at most (default: the "
        "longest prompt and output)", "pool_tokens": "page pool tokens (default: slots * max_len)",
        "bucket": "the baseline's span rounding (0: the whole cache)",
        "requests": "requests in the stream", "prompt_min": "shortest prompt",
        "prompt_max": "longest prompt", "output_min": "fewest output tokens",
        "output_max": "most output tokens", "probe_tokens": "the probe's output tokens "
        "(invariance mode)"}
DERIVED = ("max_len", "pool_tokens")


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", choices=("serve", "invariance"), default="serve",
                      help="serve a stream and print a summary, or complete one prompt in many "
                           "batch mixes")
  parser.add_argument("--attention", choices=ATTENTIONS + ("both",), default="both")
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="a small model and stream for a CPU (flags given win)")
  for name in MODEL_FLAGS + SERVE_FLAGS + tuple(GPU_STREAM):
    default = {**dataclasses.asdict(sm.ModelConfig()), **dataclasses.asdict(ServeConfig()),
               **GPU_STREAM}[name]
    parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                        help=HELP[name] + ("" if name in DERIVED else f" (GPU default {default})"))
  parser.add_argument("--probe-temperature", type=float, default=0.0,
                      help="the probe's sampling temperature (0: greedy; else seeded)")
  parser.add_argument("--mixes", type=int, default=100, help="batch mixes (invariance mode)")
  parser.add_argument("--tp", type=int, default=None,
                      help="devices to split the heads over (default: as many as divide the "
                           "kv heads)")
  parser.add_argument("--weights", type=pathlib.Path, default=None,
                      help="load weights from this file, or train and write them there")
  parser.add_argument("--train-steps", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--results", type=pathlib.Path, default=None,
                      help="serve mode: write op 'serve' rows to this results file")
  parser.add_argument("--note", default="", help="the results header's note")
  parser.add_argument("--no-progress", action="store_true")
  return parser.parse_args(argv)


def configs_from(args):
  """(ModelConfig, ServeConfig, stream settings): explicit flags over the
  CPU preset over the GPU defaults; max_len fits the longest request."""
  given = lambda names: {n: getattr(args, n) for n in names if getattr(args, n) is not None}
  model = sm.ModelConfig(**(sm.CPU_MODEL if args.cpu_sizes else {}) | given(MODEL_FLAGS))
  stream = (CPU_STREAM if args.cpu_sizes else GPU_STREAM) | given(GPU_STREAM)
  serve = (CPU_SERVE if args.cpu_sizes else {}) | given(SERVE_FLAGS)
  page = serve.get("page_size", ServeConfig.page_size)
  longest = stream["prompt_max"] + max(stream["output_max"], stream["probe_tokens"])
  serve.setdefault("max_len", -(-longest // page) * page)
  return model, ServeConfig(**serve), stream


def make_mesh(model: sm.ModelConfig, tp: int | None):
  devices = jax.devices()
  if tp is None:
    tp = max(d for d in range(1, len(devices) + 1) if model.kv_heads % d == 0
             and model.mlp % d == 0)
  if not 1 <= tp <= len(devices):
    raise ValueError(f"--tp must be in [1, {len(devices)}] on this machine, got {tp}")
  return jax.make_mesh((tp,), (sm.TP,), devices=devices[:tp])


def load_or_train(args, model: sm.ModelConfig):
  if args.weights is not None and args.weights.exists():
    print(f"weights: {args.weights}")
    return sm.load_params(args.weights, model)
  compute = jnp.float32 if jax.default_backend() == "cpu" else model.dtype
  params = sm.train(model, args.train_steps, seed=args.seed, compute_dtype=compute)
  if args.weights is not None:
    sm.save_params(args.weights, params, model)
    print(f"weights written to {args.weights}")
  return params


def serve_stream(engine, stream, seed, progress):
  """Compiles, warms up on a few short requests, then serves the stream;
  returns (requests, summary)."""
  engine.warm_up()
  engine.run(make_requests(min(engine.serve.slots, 4), (stream["prompt_min"],) * 2, (4, 4),
                           seed=seed + 1))
  requests = make_requests(stream["requests"], (stream["prompt_min"], stream["prompt_max"]),
                           (stream["output_min"], stream["output_max"]), seed=seed)
  timing = engine.run(requests, progress=progress)
  return requests, summarize(requests, timing)


def bench_row(attention, model, serve, stream, summary, mesh) -> dict:
  tp = mesh.shape[sm.TP]
  variant = ("paged" if attention == "jax_flash" else
             f"contiguous-bucket{serve.bucket}") + (f"-tp{tp}" if tp > 1 else "")
  return {"impl": IMPLS[attention], "op": "serve", "dtype": model.dtype, "batch": serve.slots,
          "seq_q": serve.chunk, "seq_k": stream["prompt_max"], "heads_q": model.heads,
          "heads_kv": model.kv_heads, "head_dim": model.head_dim, "head_dim_v": model.head_dim,
          "causal": True, "window": None, "variant": variant, "tflops": None,
          "ms": summary["step_ms"], "gbps": None, "num_gpus": tp,
          "prompt_min": stream["prompt_min"], "output_min": stream["output_min"],
          "output_max": stream["output_max"], "page_size": serve.page_size,
          **{k: v for k, v in summary.items() if k != "step_ms"}}


def write_results(path: pathlib.Path, rows, model, serve, argv, note) -> None:
  from jax_flash import _benchmark as benchmark
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=pathlib.Path(__file__).parent).stdout.strip() or None
  run = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
         "date": datetime.date.today().isoformat(), "commit": commit,
         "command": "python examples/generate.py " + " ".join(argv), "note": note,
         "model": model.describe(), "serve": dataclasses.asdict(serve)}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(benchmark.run_document(run, rows))
  print(f"wrote {len(rows)} rows to {path}")


def main(argv=None) -> dict:
  """Runs the example; returns what it printed, as numbers."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  model, serve, stream = configs_from(args)
  mesh = make_mesh(model, args.tp)
  devices = mesh.devices.size
  print(f"model: {model.parameter_count() / 1e6:.1f} M parameters, {model.layers} layers, "
        f"{model.heads} / {model.kv_heads} heads of {model.head_dim}, {model.dtype}, "
        f"{model.kv_bytes_per_token() / 1024:.1f} KB of cache per token; tensor parallel over "
        f"{devices} {jax.devices()[0].device_kind} device(s)")
  print(f"step: {serve.slots} decode rows + {serve.lanes} x {serve.chunk} prefill tokens; "
        f"pages of {serve.page_size}, {serve.max_len} tokens per request at most")
  params = load_or_train(args, model)
  attentions = ATTENTIONS if args.attention == "both" else (args.attention,)
  progress = not args.no_progress
  report = {}
  for attention in attentions:
    engine = Engine(params, model, serve, mesh, attention)
    if args.mode == "invariance":
      result = invariance(engine, probe_prompt(stream["prompt_max"] // 2),
                          stream["probe_tokens"], args.probe_temperature, args.mixes,
                          (stream["prompt_min"], stream["prompt_max"]),
                          (stream["output_min"], stream["output_max"]), args.seed, progress)
      print(f"{attention}: {result['distinct_completions']} distinct completion(s), "
            f"{result['distinct_logits']} distinct logit sequence(s) in {result['mixes']} "
            f"batch mixes; most common: {result['completion']!r}")
    else:
      requests, result = serve_stream(engine, stream, args.seed, progress)
      print_summary(attention, result)
      print(f"  request 0: ...{sm.decode(requests[0].prompt[-24:])!r} -> "
            f"{sm.decode(requests[0].tokens[:48])!r}")
      result["row"] = bench_row(attention, model, serve, stream, result, mesh)
      result["completions"] = [sm.decode(r.tokens) for r in requests]
    report[attention] = result
    del engine  # frees its cache before the next one is made
  if args.mode == "serve" and len(report) == 2:
    speedup = (report["jax_flash"]["output_tokens_per_s"]
               / report["jax_nn"]["output_tokens_per_s"])
    report["jax_flash"]["row"]["vs_baseline"] = round(speedup, 3)
    print(f"jax_flash / jax.nn output tokens/s: {speedup:.2f}x")
  if args.mode == "serve" and args.results is not None:
    write_results(args.results, [r["row"] for r in report.values()], model, serve, argv,
                  args.note)
  return report


if __name__ == "__main__":
  main()
