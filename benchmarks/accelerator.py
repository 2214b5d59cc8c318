"""The accelerator path measured: the extraction forward against the chip's peak, the store path
against the forward, transformers against us, float32 against float64; on whatever JAX backend
is there (a GPU, a TPU, or the CPU with ``--tiny``).

Random bfloat16 weights of real shapes (Qwen2.5-1.5B and Qwen2.5-7B) are drawn on the device
itself (no checkpoint is written or read), and random token ids fill every position (a forward's
cost depends on shapes, not on which ids). Printed in one run:

1. the chip and its peak: the datasheet's dense bfloat16 FLOP/s (``PEAK_BF16``) beside the
   measured rate of a large bfloat16 matmul on it;
2. the attention kernels (``--attention tiled | fused | cudnn``) on the 7B shape's first blocks at
   the longest length: tokens/s of each (what ``--attention auto`` picks is printed beside);
3. per shape and length: forward-only tokens/s at each batch tried (rows of ``--batch_tokens`` /
   length, doubling while it pays) and MFU = 2 x non-embedding parameters x tokens/s over the
   datasheet peak, and over the measured matmul peak; four layers (1/4, 1/2, 3/4, last) returned
   in float32, not copied back (compute only); compile seconds apart;
4. the same four layers stored by the runner itself (``host.run.run_process``, its shard writer,
   statistics and index; the model handed over already compiled): raw and gzip shards to the
   local disk, raw to memory (``/dev/shm``), as a fraction of forward-only; the disk's durable
   write speed beside (``--store_modes`` chooses, ``--write_threads`` repeats them per count;
   ``--copy_back``: the same forward copied back to the host and nothing stored, into pageable and
   into pinned memory; ``--host_copy_gb``: one device array copied into each; ``--sample_stacks``:
   where each of the runner's threads spent its time);
5. transformers' own bfloat16 forward (the base model, ``output_hidden_states=True``, its default
   attention) on the same device, batch and length, and our forward-only over it;
6. fidelity: a tiny odd Qwen2 (3 heads over 1 kv head, head_dim 32 != hidden / heads) in float32
   with ``--attention auto`` and ``tiled`` against transformers float64 on the CPU and float32 on
   the device; and in bfloat16 with each kernel (a sliding-window Mistral too) against float64,
   over mixed-length (padded) batches.

Targets (issue 48): 7B at 2048 forward MFU >= 50% of the measured matmul peak; stored raw >= 0.9 of
forward-only; float32 within 1e-5 (relative, ``fixtures.hf_reference.relative_error``) of
transformers float64; faster than transformers' bfloat16 forward.

Each part runs in a process of its own (JAX and PyTorch each keep the memory they take); the
figures go to ``--out`` as JSON as they come, so a run cut short keeps what it measured.

    python benchmarks/accelerator.py [--out DIR] [--shapes 1.5b,7b] [--lengths 512,2048]
    python benchmarks/accelerator.py --tiny     # the CPU, tiny shapes: the whole script in seconds
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5's shapes, as their config.json files give them.
QWEN2_5 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", rope_theta=1_000_000.0,
               rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False, attention_dropout=0.0,
               torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151643)
SHAPES = {
    "1.5b": dict(QWEN2_5, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(QWEN2_5, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    # --tiny: the same code on the CPU in seconds
    "tiny": dict(QWEN2_5, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
NAMES = {"1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B", "tiny": "tiny"}
# Dense bfloat16 FLOP/s per chip by the vendors' datasheets (SXM parts), by device_kind prefix.
PEAK_BF16 = {"NVIDIA H100": 989.4e12, "NVIDIA H200": 989.4e12, "NVIDIA A100": 312e12, "NVIDIA L4": 121e12,
             "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12}
KERNELS = ("tiled", "fused", "cudnn")
KERNEL_BLOCKS = 4  # blocks of the 7B shape the kernel comparison computes


def peak_of(kind: str) -> float | None:
    return next((peak for prefix, peak in PEAK_BF16.items() if kind.startswith(prefix)), None)


# The run's start, shared with the parts' processes (their deadline counts from it).
START = float(os.environ.setdefault("ACCELERATOR_BENCH_START", str(time.time())))


def log(line: str) -> None:
    """``line``, after the seconds since the run began (where the device time goes)."""
    print(f"[{time.time() - START:6.1f} s] {line}", flush=True)


def save(out: str, name: str, value) -> None:
    """Adds ``value`` under ``name`` to ``out``/results.json (written whole each time)."""
    path = os.path.join(out, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    results[name] = value
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def load(out: str) -> dict:
    path = os.path.join(out, "results.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def median_seconds(run, repeats: int) -> float:
    """Median seconds of ``run()`` (which blocks until its work is done), after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# JAX: the matmul peak, the kernels, forward-only, the store path.

def matmul_tflops(size: int) -> float:
    """Measured bfloat16 TFLOP/s of a [size, size] x [size, size] matmul (random operands)."""
    import jax
    import jax.numpy as jnp
    a, b = (jax.random.normal(jax.random.key(i), (size, size), jnp.bfloat16) for i in (1, 2))
    matmul = jax.jit(lambda x, y: x @ y)
    steps = 20

    def run():
        out = None
        for _ in range(steps):
            out = matmul(a, b)
        out.block_until_ready()

    return 2 * size ** 3 * steps / median_seconds(run, 5) / 1e12


def random_params(config, mesh, dtype, seed: int = 0) -> dict:
    """The decoder's parameter tree (embedding and blocks, as ``model.params.load_params`` gives
    it), drawn on the devices by one program: N(0, 0.02) matrices and biases, norm weights 1."""
    import flax
    import jax
    import jax.numpy as jnp
    from model.attention import causal_mask
    from model.decoder import Decoder
    from model.sharding import param_sharding
    ids = jnp.zeros((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: Decoder(config, dtype, mesh).init(
        jax.random.key(0), ids, ids, causal_mask(jnp.full((1,), 8), 8), config.num_hidden_layers))
    flat = sorted(flax.traverse_util.flatten_dict(shapes["params"]).items())

    @functools.lru_cache(maxsize=None)
    def drawer(shape, sharding, norm):  # one small program per distinct shape (a few): quick to compile
        if norm:
            return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
        return jax.jit(lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype),
                       out_shardings=sharding)

    keys = jax.random.split(jax.random.key(seed), len(flat))
    params = {path: drawer(leaf.shape, param_sharding(path, leaf.shape, mesh, config), "norm" in path[-2])(key)
              for key, (path, leaf) in zip(keys, flat)}
    return flax.traverse_util.unflatten_dict(params)


def non_embedding_parameters(params: dict) -> int:
    import jax
    return sum(x.size for name, tree in params.items() if name != "embed_tokens"
               for x in jax.tree.leaves(tree))


def quarter_layers(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({num_layers // 4, num_layers // 2, 3 * num_layers // 4, num_layers - 1}))


def extractor_for(config, mesh, params, layers, rows: int, length: int, attention: str,
                  residual_dtype: str = "float32"):
    """An ``Extractor`` of the random model: ``rows`` per batch, one bucket ``length``, bfloat16
    compute, float32 outputs and by default the float32 residual stream (the runner's defaults)."""
    import jax.numpy as jnp
    from model.extract import Extractor
    from model.loading import LoadedModel
    return Extractor.from_loaded(LoadedModel(config, mesh, params, jnp.bfloat16), layers, rows, length, length,
                                 activation_dtype="float32", attention=attention, residual_dtype=residual_dtype)


def forward_rate(extractor, rows: int, length: int, seconds: float) -> tuple[float, float]:
    """(compile seconds, forward-only tokens/s) of ``extractor`` on full batches of random ids:
    dispatched back to back, nothing copied back."""
    import jax
    import numpy as np
    from model.extract import placed
    from model.sharding import batch_sharding
    start = time.perf_counter()
    forward = extractor.executable(rows, length)
    compile_s = time.perf_counter() - start
    sharding = batch_sharding(extractor.mesh)
    rng = np.random.default_rng(0)
    ids = placed(rng.integers(0, extractor.config.vocab_size, (rows, length), dtype=np.int32), sharding)
    lengths = placed(np.full((rows,), length, np.int32), sharding)
    call = lambda: forward(extractor.params, ids, lengths, None)
    jax.block_until_ready(call())  # warm-up
    once = median_seconds(lambda: jax.block_until_ready(call()), 1)
    steps = max(2, min(50, int(seconds / max(once, 1e-6))))

    def run():
        for _ in range(steps):  # one output alive at a time: each is freed once the next is dispatched
            out = call()
        jax.block_until_ready(out)

    return compile_s, steps * rows * length / median_seconds(run, 2)


def kernel_profile(extractor, rows: int, length: int, steps: int = 3) -> dict:
    """A ``jax.profiler`` trace of ``steps`` forwards, read back: the device's busy time over the
    wall time, and the kernels that took the most of it (name, seconds, share), summed over the
    device's streams (on the CPU: XLA's client threads)."""
    import collections
    import glob
    import jax
    import numpy as np
    from jax.profiler import ProfileData
    from model.extract import placed
    from model.sharding import batch_sharding
    sharding = batch_sharding(extractor.mesh)
    ids = placed(np.random.default_rng(0).integers(0, extractor.config.vocab_size, (rows, length), dtype=np.int32),
                 sharding)
    lengths = placed(np.full((rows,), length, np.int32), sharding)
    forward = extractor.executable(rows, length)
    jax.block_until_ready(forward(extractor.params, ids, lengths, None))
    folder = tempfile.mkdtemp(prefix="trace.")
    with jax.profiler.trace(folder):
        start = time.perf_counter()
        for _ in range(steps):
            out = forward(extractor.params, ids, lengths, None)
        jax.block_until_ready(out)
        wall = time.perf_counter() - start
    data = ProfileData.from_file(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)[0])
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    lines = ([line for p in planes[:1] for line in p.lines if line.name.startswith("Stream")]
             or [line for p in planes[:1] for line in p.lines]
             or [line for p in data.planes if p.name.startswith("/host:CPU") for line in p.lines
                 if line.name.startswith("tf_XLAPjRtCpuClient")])
    busy = collections.Counter()
    for line in lines:
        for event in line.events:
            busy[event.name] += event.duration_ns / 1e9
    shutil.rmtree(folder, ignore_errors=True)
    total = sum(busy.values())
    return {"wall_s": wall, "busy_s": total, "lines": sorted({line.name for line in lines}),
            "top": [(name, seconds, seconds / total) for name, seconds in busy.most_common(15)]}


def late(args) -> bool:
    """Past ``--jax_deadline_s`` since the run began: what is left of the JAX part is skipped, so
    that the parts after it still run within the device's time."""
    if time.time() - START > args.jax_deadline_s:
        log("past --jax_deadline_s: skipping the rest of this shape's searches and store runs")
        return True
    return False


def is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def write_stream(path: str, count: int, length: int, vocab: int) -> None:
    """``count`` records of ``length`` random token ids, in the stream format."""
    import numpy as np
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for i in range(count):
            ids = rng.integers(0, vocab, length).tolist()
            f.write(json.dumps({"sample_id": i, "input_ids": ids, "num_tokens": length, "source": "random",
                                "text_preview": ""}) + "\n")


def stored_extractor(extractor):
    """``extractor``'s weights and shapes with the forward the runner compiles by default: the one
    that also measures each stored array's statistics."""
    from host.config import HostConfig
    from host.run import statistics_spec
    from model.extract import measured_statistics
    spec = statistics_spec(HostConfig(machine_id=0, dataset_stream="-", model_path="-", output_dir="-"))
    return dataclasses.replace(extractor, statistics=measured_statistics(spec, extractor.config))


def stored_rate(extractor, model_dir: str, work: str, output_dir: str, rows: int, length: int,
                samples: int, compress: bool, write_threads: int | None = None, sample_stacks: bool = False) -> dict:
    """Tokens/s of the runner storing ``extractor``'s layers of ``samples`` random records (the
    extractor's forward with the runner's statistics, compiled before the clock starts), from the
    call to the last shard committed; and the run's store figures (how long the forward waited for
    the store path)."""
    from host.config import HostConfig
    from host.run import run_process, statistics_spec
    from transforms.extraction import ExtractConfig, OrderedExtraction
    stream = os.path.join(work, f"stream_{length}_{samples}.jsonl")
    if not os.path.exists(stream):
        write_stream(stream, samples, length, extractor.config.vocab_size)
    shutil.rmtree(output_dir, ignore_errors=True)
    layers = ",".join(map(str, extractor.layers))
    config = HostConfig(machine_id=0, dataset_stream=stream, model_path=model_dir,
                        layers_to_extract=extractor.layers, batch_size=rows, max_seq_length=length,
                        dtype="bfloat16", attention=extractor.attention, output_dir=output_dir,
                        compress_shards=compress, compilation_cache_dir="", heartbeat_s=3600.0)
    if write_threads:
        config = dataclasses.replace(config, write_threads=write_threads)
    extraction = OrderedExtraction(ExtractConfig(model_path=model_dir, layers=extractor.layers, batch_size=rows,
                                                 max_seq_length=length, dtype="bfloat16",
                                                 attention=extractor.attention, statistics=statistics_spec(config)))
    extraction.extractor = stored_extractor(extractor)
    extraction.extractor.executable(rows, length)
    sampler = StackSampler() if sample_stacks else None
    start = time.perf_counter()
    with sampler or contextlib.nullcontext():
        code = run_process(config, extraction=extraction)
    seconds = time.perf_counter() - start
    status = json.load(open(os.path.join(output_dir, "machine_000", "status.json")))
    metadata = json.load(open(os.path.join(output_dir, "machine_000", "metadata.json")))
    stored_gb = sum(s["file_size_mb"] for s in metadata["shards"]) * 2**20 / 1e9
    shutil.rmtree(output_dir, ignore_errors=True)
    store = status.get("store") or {}
    # Before the final flush: the rate the forward kept while storing, which a long run converges to
    # (a short one also waits for its last shards to be written).
    steady = seconds - store.get("final_flush_s", 0.0)
    return {"exit": code, "layers": layers, "seconds": seconds, "tokens_per_s": samples * length / seconds,
            "steady_tokens_per_s": samples * length / steady, "stored_gb": stored_gb, "store": store,
            "write_threads": config.write_threads, **({"stacks": sampler.top()} if sampler else {})}


def copy_back_rate(extractor, length: int, samples: int) -> float:
    """Tokens/s of ``extractor`` (the store runs' forward, statistics measured) over ``samples``
    random records of ``length`` with every output copied back to the host and split per sample,
    as the runner's forward loop does, and nothing stored: the most a store run can reach here."""
    import numpy as np
    rng = np.random.default_rng(2)
    items = [(i, rng.integers(0, extractor.config.vocab_size, length).tolist()) for i in range(samples)]
    start = time.perf_counter()
    for _ in extractor.extract_measured(items):
        pass
    return samples * length / (time.perf_counter() - start)


def host_copy_gbps(gigabytes: float) -> dict:
    """GB/s of copying a device array of ``gigabytes`` to host memory: into pageable numpy memory
    (``copy_to_host_async`` then ``np.asarray``, as ``Extractor.collect`` does) and, where the
    backend has the memory kind, into pinned host memory (``device_put`` to ``pinned_host``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    device = jax.devices()[0]
    source = jnp.ones((int(gigabytes * 1e9) // 4,), jnp.float32)  # [elements]
    rates: dict = {}

    def timed(copy) -> float:
        times = []
        for i in range(4):
            fresh = jax.block_until_ready(source + i)  # a new array: no host copy cached
            start = time.perf_counter()
            copy(fresh)
            times.append(time.perf_counter() - start)
        return source.nbytes / 1e9 / statistics.median(times[1:])

    def pageable(array):
        array.copy_to_host_async()
        np.asarray(array)
    rates["pageable"] = timed(pageable)
    try:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        rates["pinned_host"] = timed(lambda array: np.asarray(jax.block_until_ready(jax.device_put(array, pinned))))
    except Exception as e:  # noqa: BLE001 - a backend without the memory kind: reported
        rates["pinned_host_error"] = str(e)[:300]
    return rates


class StackSampler(threading.Thread):
    """Samples every thread's Python stack every ``interval`` seconds while in its ``with``: per
    thread (names without their numbers), the share of samples at each innermost line of this
    project's code, to say where a store run's threads spend their time."""

    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval, self.counts, self.total = interval, collections.Counter(), collections.Counter()
        self._stop_event = threading.Event()
        self._root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def __enter__(self) -> "StackSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_event.set()
        self.join()

    def run(self) -> None:
        me = threading.get_ident()
        while not self._stop_event.wait(self.interval):
            names = {t.ident: t.name.rstrip("0123456789_") for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, "?")
                innermost = f"{frame.f_code.co_name}"
                while frame is not None and not (frame.f_code.co_filename.startswith(self._root)
                                                 and "/.venv/" not in frame.f_code.co_filename):
                    frame = frame.f_back
                where = (f"{os.path.relpath(frame.f_code.co_filename, self._root)}:{frame.f_lineno} "
                         f"{frame.f_code.co_name}" if frame is not None else "-")
                self.counts[(name, f"{where} > {innermost}")] += 1
                self.total[name] += 1

    def top(self, per_thread: int = 6) -> dict:
        """{thread name: [(share of its samples, innermost project line > innermost function)]}."""
        out: dict = {}
        for (name, where), n in self.counts.most_common():
            if len(out.setdefault(name, [])) < per_thread:
                out[name].append((round(n / self.total[name], 3), where))
        return out


def jax_part(args) -> None:
    """Child process: the JAX figures, saved as they come."""
    from host.allocator import one_malloc_arena
    one_malloc_arena()  # as the runner does
    import jax
    import jax.numpy as jnp
    from model.attention import attention_for
    from model.families import config_from_dict
    from model.sharding import make_mesh
    out, work = args.out, tempfile.mkdtemp(prefix="accelerator.")
    device = jax.devices()[0]
    save(out, "device", {"backend": jax.default_backend(), "kind": device.device_kind, "count": jax.device_count(),
                         "jax": jax.__version__, "cores": len(os.sched_getaffinity(0))})
    log(f"device: {jax.device_count()} x {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    save(out, "matmul_tflops", matmul_tflops(args.matmul_size))
    log(f"bfloat16 matmul {args.matmul_size}^3: {load(out)['matmul_tflops']:.1f} TFLOP/s")

    if args.host_copy_gb:
        copies = host_copy_gbps(args.host_copy_gb)
        save(out, "host copy gbps", copies)
        log(f"device to host, {args.host_copy_gb:g} GB: " + ", ".join(
            f"{k} {v:.2f} GB/s" if isinstance(v, float) else f"{k}: {v}" for k, v in copies.items()))
    from benchmarks.store_path import durable_write_gbps
    save(out, "disk_gbps", durable_write_gbps(work, args.disk_gb, streamed=True))
    for name in args.shapes:
        config = config_from_dict(SHAPES[name])
        mesh = make_mesh("1d", config)
        start = time.perf_counter()
        params = jax.block_until_ready(random_params(config, mesh, jnp.bfloat16))
        n_params = non_embedding_parameters(params)
        log(f"{NAMES[name]}: {n_params / 1e9:.2f}B non-embedding parameters drawn on the device in "
              f"{time.perf_counter() - start:.1f} s")
        longest = max(args.lengths)
        if name == args.shapes[0] and args.attention == "best":
            kernels = {"auto": attention_for(mesh, "auto", config, jnp.bfloat16)}
            rows = max(1, args.batch_tokens[0] // longest)
            for kernel in KERNELS:
                if kernel == "cudnn" and jax.default_backend() != "gpu":
                    continue
                try:
                    extractor = extractor_for(config, mesh, params, tuple(range(KERNEL_BLOCKS)), rows, longest,
                                              kernel)
                    compile_s, rate = forward_rate(extractor, rows, longest, args.seconds)
                except Exception as e:  # noqa: BLE001 - a kernel that fails here is reported, not fatal
                    kernels[kernel] = {"error": str(e)[:500]}
                    log(f"  attention {kernel:5s}: failed: {str(e)[:300]}")
                    continue
                kernels[kernel] = {"tokens_per_s": rate, "compile_s": compile_s, "rows": rows}
                log(f"  attention {kernel:5s}: {rate:10.0f} tokens/s ({KERNEL_BLOCKS} blocks, {rows} x {longest})")
            save(out, f"kernels {name}", kernels)
            if args.attention == "best":
                args.attention = max((k for k in KERNELS if "tokens_per_s" in kernels.get(k, {})),
                                     key=lambda k: kernels[k]["tokens_per_s"])
                log(f"  the forward and store runs use --attention {args.attention}")
        attention = "auto" if args.attention == "best" else args.attention
        model_dir = os.path.join(work, name)
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(SHAPES[name], f)
        layers = quarter_layers(config.num_hidden_layers)
        for length in args.lengths:
            tries, best = [], None
            for tokens in args.batch_tokens:
                rows = max(1, tokens // length)
                if (tries and rows == tries[-1]["rows"]) or (best is not None and late(args)):
                    continue
                extractor = extractor_for(config, mesh, params, layers, rows, length, attention)
                try:
                    compile_s, rate = forward_rate(extractor, rows, length, args.seconds)
                except Exception as e:  # noqa: BLE001 - a batch past the memory ends the search
                    if not is_out_of_memory(e):
                        raise
                    tries.append({"rows": rows, "out_of_memory": True})
                    log(f"  {length:5d} x {rows:3d}: out of memory")
                    break
                tries.append({"rows": rows, "tokens_per_s": rate, "compile_s": compile_s,
                              "tflops": 2 * n_params * rate / 1e12})
                log(f"  {length:5d} x {rows:3d}: {rate:10.0f} tokens/s, {2 * n_params * rate / 1e12:6.1f} "
                      f"TFLOP/s (compiled in {compile_s:.1f} s)")
                if best is not None and rate < 1.03 * best[1]:
                    break  # doubling the batch no longer pays
                if best is None or rate > best[1]:
                    best = (extractor, rate, rows)
            entry = {"tries": tries, "rows": best[2], "tokens_per_s": best[1], "attention": best[0].attention_kind,
                     "non_embedding_parameters": n_params, "layers": list(layers)}
            save(out, f"forward {name} {length}", entry)
            if name == args.shapes[0] and length == longest and not args.no_extras:
                compute = extractor_for(config, mesh, params, layers, best[2], length, attention, "compute")
                compile_s, rate = forward_rate(compute, best[2], length, args.seconds)
                save(out, f"residual compute {name} {length}", {"tokens_per_s": rate, "compile_s": compile_s})
                log(f"  {length:5d} x {best[2]:3d}: {rate:10.0f} tokens/s with --residual_dtype compute")
                del compute
                profile = kernel_profile(best[0], best[2], length)
                save(out, f"profile {name} {length}", profile)
                log(f"  profile: device busy {profile['busy_s']:.3f} s of {profile['wall_s']:.3f} s; top kernels:")
                for kernel, seconds, share in profile["top"][:10]:
                    log(f"    {share:6.1%} {seconds:8.4f} s  {kernel[:110]}")
            if (name, length) in args.store and not late(args):
                extractor, rate, rows = best
                samples = max(1, round(rate * args.store_seconds / length / rows)) * rows
                runs = {}
                token_bytes = len(extractor.layers) * extractor.config.hidden_size * 4  # float32 outputs
                # Issue 56's bounds: to disk, the lesser of forward-only and the disk's durable rate over
                # the bytes a token; to memory, forward-only. Targets: raw 0.9, gzip 0.8 of them.
                disk_bound = min(rate, load(out)["disk_gbps"] * 1e9 / token_bytes)
                if args.copy_back:
                    measuring = stored_extractor(extractor)
                    measured_rate = forward_rate(measuring, rows, length, args.seconds)[1]
                    runs["forward measuring statistics"] = {"tokens_per_s": measured_rate,
                                                            "fraction": measured_rate / rate}
                    log(f"  forward-only, statistics measured: {measured_rate:10.0f} tokens/s = "
                        f"{measured_rate / rate:.2f} of forward-only")
                    for memory, in_flight in (("pageable", 2), ("auto", 2), ("auto", 4)):
                        variant = dataclasses.replace(measuring, host_memory=memory, batches_in_flight=in_flight)
                        variant.executable(rows, length)  # the same jitted forward: no compile in the timing
                        kind = variant.host_memory_kind or "pageable"
                        copied = copy_back_rate(variant, length, samples)
                        runs[f"copy back {kind} {in_flight}"] = {"tokens_per_s": copied, "fraction": copied / rate,
                                                                 "gb_per_s": copied * token_bytes / 1e9}
                        log(f"  copied back to {kind} memory ({in_flight} batches in flight), not stored: "
                            f"{copied:10.0f} tokens/s = "
                            f"{copied / rate:.2f} of forward-only ({copied * token_bytes / 1e9:.2f} GB/s of float32 "
                            f"activations to the host)")
                    del measuring
                modes = [(mode, root, compress) for mode, root, compress in
                         (("raw", work, False), ("gzip", work, True), ("raw memory", args.memory_dir, False))
                         if root is not None and mode.replace(" ", "_") in args.store_modes]
                for (mode, root, compress), threads in itertools.product(modes, args.write_threads):
                    result = stored_rate(extractor, model_dir, work, os.path.join(root, "acc_store"), rows, length,
                                         samples, compress, threads, args.sample_stacks)
                    result["fraction"] = result["tokens_per_s"] / rate
                    result["steady_fraction"] = result["steady_tokens_per_s"] / rate
                    result["bound_tokens_per_s"] = rate if mode == "raw memory" else disk_bound
                    if threads:
                        mode = f"{mode} {threads} writers"
                    result["of_bound"] = result["tokens_per_s"] / result["bound_tokens_per_s"]
                    runs[mode] = result
                    store = result["store"]
                    log(f"  stored {mode:10s}: {result['tokens_per_s']:10.0f} tokens/s = "
                        f"{result['fraction']:.2f} of forward-only, {result['of_bound']:.2f} of its bound "
                        f"({result['bound_tokens_per_s']:.0f} tokens/s; target {0.8 if compress else 0.9}), "
                        f"{result['steady_fraction']:.2f} before the final "
                        f"flush ({samples} x {length}, {result['stored_gb']:.1f} GB in {result['seconds']:.1f} s; "
                        f"forward waited {store.get('forward_waited_fraction', float('nan')):.0%}; busy s: "
                        + ", ".join(f"{k} {v:.1f}" for k, v in store.get("stage_s", {}).items() if v >= 0.05) + ")")
                    for thread, places in result.get("stacks", {}).items():
                        log(f"    thread {thread}: " + "; ".join(f"{share:.0%} {where}" for share, where in places))
                save(out, f"stored {name} {length}", runs)
        del params
    shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# PyTorch: transformers' forward; fidelity.

def hf_seconds(model, ids) -> float:
    """Median seconds of transformers' forward of ``ids`` with every hidden state."""
    import torch

    def run():
        with torch.no_grad():
            model(input_ids=ids, output_hidden_states=True)
        if ids.is_cuda:
            torch.cuda.synchronize()

    return median_seconds(run, 3)


def torch_part(args) -> None:
    """Child process: transformers' bfloat16 forward (base model, every hidden state) at our
    best batch of each shape and length."""
    import torch
    from transformers import AutoConfig, AutoModel
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = load(args.out)
    for name in args.shapes:
        config = AutoConfig.for_model(**SHAPES[name])
        with torch.device(device):
            model = AutoModel.from_config(config, dtype=torch.bfloat16).eval()
        attention = model.config._attn_implementation
        for length in args.lengths:
            ours = results.get(f"forward {name} {length}")
            if ours is None:
                continue
            rows = ours["rows"]
            ids = torch.randint(0, config.vocab_size, (rows, length), device=device)
            entry = {"rows": rows, "attention": attention}
            try:
                entry["tokens_per_s"] = rows * length / hf_seconds(model, ids)
            except torch.OutOfMemoryError:
                entry["out_of_memory"] = True
                torch.cuda.empty_cache()
            save(args.out, f"transformers {name} {length}", entry)
            log(f"transformers {NAMES[name]} {length} x {rows}: "
                  f"{entry.get('tokens_per_s', float('nan')):10.0f} tokens/s ({attention})")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


FIDELITY_LENGTHS = [5, 64, 17, 1, 40, 64, 33, 2]  # mixed in each batch of 4: every batch is padded


def fidelity_part(args) -> None:
    """Child process: our float32 and bfloat16 forwards against transformers' float64 (CPU) and
    float32 (on the device), on tiny checkpoints written here by transformers."""
    import jax
    import torch
    from fixtures.hf_reference import load_reference, random_sequences, reference_activations, relative_error
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    from model.extract import Extractor
    work = tempfile.mkdtemp(prefix="fidelity.")
    odd = write_checkpoint(os.path.join(work, "odd"), "qwen2", seed=2, vocab_size=SMALL_VOCAB, hidden_size=48,
                           num_attention_heads=3, num_key_value_heads=1, head_dim=32, intermediate_size=100,
                           num_hidden_layers=3, rope_theta=50_000.0)
    windowed = write_checkpoint(os.path.join(work, "mistral"), "mistral", seed=3)
    sequences = random_sequences(FIDELITY_LENGTHS, vocab=SMALL_VOCAB)
    on_gpu = torch.cuda.is_available()
    found = {}

    def worst(path, dtype, attention, refs) -> float:
        extractor = Extractor.load(path, dtype=dtype, max_seq_length=64, min_bucket=64, batch_size_per_device=4,
                                   devices=jax.devices()[:1], attention=attention)
        out = dict(extractor.extract(enumerate(sequences)))
        return max(relative_error(out[i][layer], ref[layer]) for i, ref in enumerate(refs) for layer in ref)

    for label, path in (("odd qwen2", odd), ("mistral, window 16", windowed)):
        float64 = reference_activations(load_reference(path, "float64"), sequences)
        rows = {}
        if label == "odd qwen2":
            device32 = load_reference(path, "float32").to("cuda" if on_gpu else "cpu")
            float32 = reference_activations(device32, sequences)
            rows["transformers float32 (device) vs float64"] = max(
                relative_error(a[layer], b[layer]) for a, b in zip(float32, float64) for layer in b)
            for attention in ("auto", "tiled"):
                rows[f"ours float32 {attention} vs float64"] = worst(path, "float32", attention, float64)
                rows[f"ours float32 {attention} vs transformers float32"] = worst(path, "float32", attention, float32)
        for attention in ("tiled", "fused") + (("cudnn",) if jax.default_backend() == "gpu" else ()):
            try:
                rows[f"ours bfloat16 {attention} vs float64"] = worst(path, "bfloat16", attention, float64)
            except Exception as e:  # noqa: BLE001 - reported, the other rows still count
                log(f"fidelity {label}: bfloat16 {attention} failed: {str(e)[:300]}")
        found[label] = rows
        for row, err in rows.items():
            log(f"fidelity {label}: {row}: {err:.2e}")
    save(args.out, "fidelity", found)
    shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------

def fraction(stored: dict, mode: str) -> str:
    """``end to end/before the final flush`` fractions of forward-only of a store run."""
    if mode not in stored:
        return f"{'-':>9s}"
    return f"{stored[mode]['fraction']:.2f}/{stored[mode].get('steady_fraction', float('nan')):.2f}"


def summary(out: str, args) -> None:
    """The table printed last."""
    r = load(out)
    device = r.get("device", {})
    peak = peak_of(device.get("kind", ""))
    measured = r.get("matmul_tflops")
    print(f"\n=== {device.get('count')} x {device.get('kind')} ({device.get('backend')}, jax {device.get('jax')}, "
          f"{device.get('cores')} cores) ===")
    print(f"peak bfloat16: datasheet {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s, measured matmul "
          f"{measured or float('nan'):.4g} TFLOP/s; disk durable write {r.get('disk_gbps', float('nan')):.2f} GB/s")
    for name in args.shapes:
        kernels = r.get(f"kernels {name}")
        if kernels:
            rates = ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in kernels.items() if isinstance(v, dict))
            print(f"attention kernels ({NAMES[name]}, {KERNEL_BLOCKS} blocks, tokens/s): {rates}; auto = "
                  f"{kernels['auto']}")
    print(f"{'shape':14s} {'len':>5s} {'rows':>4s} {'tokens/s':>9s} {'MFU':>6s} {'of mm':>6s} {'HF tok/s':>9s} "
          f"{'x HF':>5s} {'raw':>9s} {'gzip':>9s} {'raw shm':>9s}")
    for name in args.shapes:
        for length in args.lengths:
            f = r.get(f"forward {name} {length}")
            if f is None:
                continue
            flops = 2 * f["non_embedding_parameters"] * f["tokens_per_s"]
            hf = r.get(f"transformers {name} {length}", {}).get("tokens_per_s")
            stored = r.get(f"stored {name} {length}", {})
            print(f"{NAMES[name]:14s} {length:5d} {f['rows']:4d} {f['tokens_per_s']:9.0f} "
                  f"{flops / peak if peak else float('nan'):6.1%} {flops / (measured * 1e12):6.1%} "
                  f"{hf or float('nan'):9.0f} {f['tokens_per_s'] / hf if hf else float('nan'):5.2f} "
                  + " ".join(fraction(stored, mode) for mode in ("raw", "gzip", "raw memory")))
    for label, rows in r.get("fidelity", {}).items():
        for row, err in rows.items():
            print(f"fidelity {label:18s} {row:45s} {err:.2e}")


def child(part: str, args, argv: list[str]) -> None:
    """Runs ``part`` in a process of its own; its output streams through."""
    code = subprocess.call([sys.executable, os.path.abspath(__file__), "--part", part, *argv])
    if code != 0:
        log(f"[{part} ended with exit status {code}; its figures so far are kept]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where results.json goes (default: a new temp dir)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and sizes: the CPU, in seconds")
    parser.add_argument("--shapes", default=None, help="of 7b, 1.5b (default: both; the kernels are compared on "
                        "the first)")
    parser.add_argument("--lengths", default=None, help="default 512,2048")
    parser.add_argument("--batch_tokens", default=None, help="tokens per batch tried, in order (default "
                        "16384,32768,65536)")
    parser.add_argument("--attention", default="best", help="the kernel of the forward and store runs: best "
                        "(the fastest of the comparison) or one of auto, tiled, fused, cudnn")
    parser.add_argument("--store", default=None, help="shape:length pairs the store path runs on "
                        "(default 1.5b:512,7b:2048)")
    parser.add_argument("--seconds", type=float, default=None, help="forward timing per batch tried")
    parser.add_argument("--store_seconds", type=float, default=None, help="forward time each store run covers")
    parser.add_argument("--memory_dir", default="/dev/shm", help="the memory-backed directory ('' for none)")
    parser.add_argument("--parts", default="fidelity,jax,torch")
    parser.add_argument("--jax_deadline_s", type=float, default=1e9,
                        help="seconds into the run after which the JAX part stops searching and storing")
    parser.add_argument("--store_modes", default="raw,gzip,raw_memory", help="the store runs: of raw, gzip, "
                        "raw_memory")
    parser.add_argument("--write_threads", default="", help="the runner's --write_threads of each store run, "
                        "comma-separated (default: the runner's default)")
    parser.add_argument("--copy_back", action="store_true", help="also time the store runs' forward with every "
                        "output copied back and split per sample, nothing stored")
    parser.add_argument("--host_copy_gb", type=float, default=0.0, help="also time copying a device array of "
                        "this many GB to pageable and to pinned host memory")
    parser.add_argument("--sample_stacks", action="store_true", help="sample the threads' Python stacks in each "
                        "store run and print where each thread spends its time")
    parser.add_argument("--no_extras", action="store_true", help="skip the --residual_dtype compute forward and "
                        "the kernel profile")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tiny = args.tiny
    argv = [a for a in sys.argv[1:]]
    args.shapes = (args.shapes or ("tiny" if tiny else "7b,1.5b")).split(",")
    args.lengths = [int(x) for x in (args.lengths or ("32,64" if tiny else "512,2048")).split(",")]
    args.batch_tokens = [int(x) for x in (args.batch_tokens or ("64,128" if tiny else "16384,32768,65536"))
                         .split(",")]
    store = args.store or ("tiny:64" if tiny else "1.5b:512,7b:2048")
    args.store = {(pair.split(":")[0], int(pair.split(":")[1])) for pair in store.split(",") if pair}
    args.seconds = args.seconds or (0.2 if tiny else 1.5)
    args.store_seconds = args.store_seconds or (0.5 if tiny else 8.0)
    args.matmul_size = 512 if tiny else 8192
    args.disk_gb = 0.1 if tiny else 1.0
    args.store_modes = args.store_modes.split(",")
    args.write_threads = [int(x) for x in args.write_threads.split(",") if x] or [None]
    args.memory_dir = args.memory_dir if args.memory_dir and os.path.isdir(args.memory_dir) else None
    if args.part:
        {"jax": jax_part, "torch": torch_part, "fidelity": fidelity_part}[args.part](args)
        return
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="accelerator_out.")
        argv += ["--out", args.out]
    os.makedirs(args.out, exist_ok=True)
    for part in args.parts.split(","):
        child(part, args, argv)
    summary(args.out, args)
    print(f"\nfigures: {os.path.join(args.out, 'results.json')}")


if __name__ == "__main__":
    main()
