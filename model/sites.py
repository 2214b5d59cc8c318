"""Activation sites: the points of a decoder block a run can store, named as TransformerLens names
its hooks (``blocks.L.<site>``), one name per site wherever it appears (flags, shard keys, index
rows, statistics, exports).

A stored array is keyed by its site and block: block L's output (``hook_resid_post``, the one
site runs stored before sites existed) keeps its key ``L`` (an int), every other site its full
hook name (``blocks.L.hook_mlp_out``), and a site of the whole model (``MODEL_SITES``: the
embeddings, the final norm, the logits and per-token losses) its name alone (``hook_loss``), at
layer ``MODEL_LAYER`` in the index. ``--sites`` also takes interp-engine's point names
(``INTERP_ENGINE_POINTS``). A shard document, an extraction result and a token batch
are dicts over these keys, so a run that stores only block outputs is what it always was.

This module imports no JAX: flag parsers and readers use it. What each site equals in Hugging
Face's modules: ``model.params.hf_site``; the table with examples: docs/sites.md.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Iterable, Sequence

from common.cli import UserError
from model.config import CSA

log = logging.getLogger(__name__)

RESID_PRE, RESID_MID, RESID_POST = "hook_resid_pre", "hook_resid_mid", "hook_resid_post"
ATTN_OUT, MLP_OUT = "hook_attn_out", "hook_mlp_out"
LN2_NORMALIZED, MLP_IN, ATTN_Z, MLP_POST = "ln2.hook_normalized", "mlp.hook_in", "attn.hook_z", "mlp.hook_post"
# A mixture of experts' routing (model.moe), and Qwen2-MoE's shared expert.
ROUTER_LOGITS, EXPERT_INDICES, ROUTING_WEIGHTS = "mlp.hook_router_logits", "mlp.hook_expert_indices", \
    "mlp.hook_routing_weights"
SHARED_EXPERT_GATE, SHARED_EXPERT_OUT = "mlp.hook_shared_expert_gate", "mlp.hook_shared_expert_out"
ROUTING = (ROUTER_LOGITS, EXPERT_INDICES, ROUTING_WEIGHTS)
SHARED_EXPERT = (SHARED_EXPERT_GATE, SHARED_EXPERT_OUT)
# Attention's inside (model.decoder.Attention) and the MLP's pre-activations.
LN1_NORMALIZED, ATTN_IN = "ln1.hook_normalized", "attn.hook_in"
ATTN_Q, ATTN_K, ATTN_V = "attn.hook_q", "attn.hook_k", "attn.hook_v"
Q_NORM_OUT, K_NORM_OUT = "attn.q_norm.hook_out", "attn.k_norm.hook_out"
ROT_Q, ROT_K = "attn.hook_rot_q", "attn.hook_rot_k"
ATTN_SCORES, ATTN_PATTERN = "attn.hook_attn_scores", "attn.hook_pattern"
ATTN_GATE, ATTN_MODULE_OUT = "attn.hook_gate", "attn.hook_out"
DELTA_OUT = "attn.hook_delta_out"  # a Gated DeltaNet mixer's delta-rule output (model.decoder.GatedDeltaNet)
INDEXED_KEYS = "attn.hook_indexed_keys"  # the keys DeepSeek sparse attention's indexer chose (model.indexer)
SSM_MODULE_OUT, SSM_OUT = "ssm.hook_out", "hook_ssm_out"  # a Mamba-2 mixer beside attention (Falcon-H1's)
NGRAM_OUT = "ngram.hook_out"  # what Qwen4-Exp's hashed n-gram embedding adds to the streams (model.ngram)
# Hyper-connections' collapse, write weights and mixing matrix around each sublayer (model.hyper: GLM-5-next's).
HC_ATTN_COLLAPSE, HC_ATTN_WRITE, HC_ATTN_MIX = "hc_attn.hook_collapse", "hc_attn.hook_write", "hc_attn.hook_mix"
HC_MLP_COLLAPSE, HC_MLP_WRITE, HC_MLP_MIX = "hc_mlp.hook_collapse", "hc_mlp.hook_write", "hc_mlp.hook_mix"
HC_ATTN, HC_MLP = (HC_ATTN_COLLAPSE, HC_ATTN_WRITE, HC_ATTN_MIX), (HC_MLP_COLLAPSE, HC_MLP_WRITE, HC_MLP_MIX)
HYPER_SITES = (*HC_ATTN, *HC_MLP)
RESIDUAL = (RESID_PRE, RESID_MID, RESID_POST)  # N streams wide with hyper-connections
MLP_PRE, MLP_PRE_LINEAR, MLP_MODULE_OUT = "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_out"
# Sites of the whole model, stored once per token (not per block): keyed by their name alone.
EMBED, FINAL_NORMALIZED, FINAL_NORM = "hook_embed", "ln_final.hook_normalized", "ln_final.hook_out"
LOGITS, TOP_K_IDS, TOP_K_LOGPROBS = "hook_logits", "logits.hook_top_k_ids", "logits.hook_top_k_logprobs"
LOSS, ENTROPY, RANK = "hook_loss", "hook_entropy", "hook_rank"
TOP_K = (TOP_K_IDS, TOP_K_LOGPROBS)  # stored with --logits_top_k K
HEAD_OUTPUTS = (LOGITS, *TOP_K, LOSS, ENTROPY, RANK)  # what the unembedding gives
AFTER_BLOCKS = (FINAL_NORMALIZED, FINAL_NORM, *HEAD_OUTPUTS)  # need every block and the final norm
MODEL_LAYER = -1  # the layer a model-level site has in the index (and key_parts)
QK_NORM = (Q_NORM_OUT, K_NORM_OUT)
PATTERNS = (ATTN_SCORES, ATTN_PATTERN)  # a row per query token over the sample's keys: its width varies
# Sites of attention heads: none in a Gated DeltaNet block; the keys' and values' none in a block
# attending to another block's (kv sharing).
HEAD_SITES = (ATTN_Q, ATTN_K, ATTN_V, *QK_NORM, ROT_Q, ROT_K, *PATTERNS, ATTN_GATE)
OWN_KV = (ATTN_K, ATTN_V, K_NORM_OUT, ROT_K)
MLP_HIDDEN = (MLP_PRE, MLP_PRE_LINEAR)  # beside mlp.hook_post: returned by the MLP, never by an expert
INSIDE = (LN1_NORMALIZED, ATTN_IN, *HEAD_SITES, DELTA_OUT, INDEXED_KEYS, ATTN_MODULE_OUT,  # inside the sublayers
          *MLP_HIDDEN, MLP_MODULE_OUT)
# A block's sites by its sublayer: none of the one a block of a single sublayer lacks (Nemotron-H's).
PARALLEL_SSM = (SSM_MODULE_OUT, SSM_OUT)
MIXER_SITES = (*HC_ATTN, LN1_NORMALIZED, ATTN_IN, *HEAD_SITES, ATTN_Z, DELTA_OUT, INDEXED_KEYS, ATTN_MODULE_OUT,
               ATTN_OUT,
               *PARALLEL_SSM)
MLP_SITES = (*HC_MLP, LN2_NORMALIZED, MLP_IN, *MLP_HIDDEN, MLP_POST, *ROUTING, *SHARED_EXPERT, MLP_MODULE_OUT, MLP_OUT)
# The families whose configs have each switch (for the refusal naming them).
QK_NORM_FAMILIES = "Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-Next, Gemma 3, Gemma 4, OLMo 2, OLMo 3, OLMoE, GLM-4.5, MiniMax-M2"
GATE_FAMILIES = "Qwen3.5, Qwen3-Next"
# (Granite 4's Mamba-2 blocks: attn.hook_out)
DELTANET_FAMILIES = "Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo hybrid, Kimi Linear"


@dataclasses.dataclass(frozen=True)
class Site:
    name: str
    width: str        # hidden (hidden_size) | resid (hidden_size x hyper-connection streams) | heads
                      # (num_attention_heads x head_dim) | kv_heads
                      # (num_key_value_heads x head_dim) | scores (num_attention_heads x the sample's
                      # tokens) | intermediate | experts (num_experts) | top_k (experts per token) | one |
                      # vocab (vocab_size) | logits_top_k (--logits_top_k) | delta_values (a Gated
                      # DeltaNet's value heads x value_head_dim) | index_topk (an indexer's keys a query) |
                      # streams (hyper-connection streams) | stream_pairs (streams x streams)
    meaning: str
    integer: bool = False  # stored as int32 whatever the activation dtype (expert ids)
    scope: str = "block"   # block: stored at each layer asked for | model: once per token, keyed by its name
    measured: bool = True  # the forward measures its statistics (not: rows of varying width, NaN, token ids)


# In block order (the order of a shard's keys within one layer), the model's own at the ends.
SITES: dict[str, Site] = {s.name: s for s in (
    Site(EMBED, "hidden", "the token embeddings, as the embedding module returns them (scaled by sqrt(hidden) "
                          "in Gemma; GPT-2's learned positions not added): hook_resid_pre of block 0 but for "
                          "those positions", scope="model"),
    Site(RESID_PRE, "resid", "block L's input: block L-1's output (for L = 0 the embeddings: scaled in Gemma, "
                             "plus the learned positions in GPT-2; copied into each stream with hyper-connections)"),
    Site(NGRAM_OUT, "resid", "on Qwen4-Exp's n-gram blocks, what the hashed n-gram embedding adds to every stream "
                             "before attention's collapse reads them: each stream's gated copy of the n-grams' value "
                             "plus its dilated convolution, [streams x hidden] stream-major"),
    Site(HC_ATTN_COLLAPSE, "hidden", "with hyper-connections (GLM-5-next, DeepSeek-V4), what attention's norm reads: "
                                     "the block's input streams collapsed, sum_j pre_j x_j; with Qwen4-Exp's gated "
                                     "residual what attention reads: the mean of the normed streams gated per channel"),
    Site(HC_ATTN_WRITE, "streams", "with hyper-connections, the weight post_k with which attention's output is "
                                   "written into stream k (2 sigmoid, computed in float32; Qwen4-Exp's in the "
                                   "compute dtype)"),
    Site(HC_ATTN_MIX, "stream_pairs", "with hyper-connections, the matrix comb [j, k] (row-major) mixing input "
                                      "stream j into stream k around attention: Sinkhorn-normalised, its columns "
                                      "summing to 1 within hc_eps (computed in float32)"),
    Site(LN1_NORMALIZED, "hidden", "attention's input after its norm, before the norm's gain (and bias): x / rms(x), "
                                   "or (x - mean) / std for a LayerNorm, in float32 (none where attention's input "
                                   "has no norm: OLMo 2)"),
    Site(ATTN_IN, "hidden", "attention's input after its norm with the gain applied (the attention module's input)"),
    Site(ATTN_Q, "heads", "the queries, q_proj's output per head (before a QK-norm and rotary), flattened to "
                          "n_heads * head_dim (head-major)"),
    Site(ATTN_K, "kv_heads", "the keys, k_proj's output per key/value head (before a QK-norm and rotary), "
                             "n_kv_heads * head_dim"),
    Site(ATTN_V, "kv_heads", "the values, v_proj's output per key/value head (before Gemma 4's value norm), "
                             "n_kv_heads * head_dim"),
    Site(Q_NORM_OUT, "heads", "the queries after the QK-norm, its gain applied, before rotary (per head, or over "
                              "the whole projection in OLMo 2)"),
    Site(K_NORM_OUT, "kv_heads", "the keys after the QK-norm, its gain applied, before rotary"),
    Site(ROT_Q, "heads", "the queries the scores are taken from: after the QK-norm and rotary, before the "
                         "1/sqrt(d) scale"),
    Site(ROT_K, "kv_heads", "the keys the scores are taken from: after the QK-norm and rotary"),
    Site(ATTN_SCORES, "scores", "each query token's scores over the sample's keys, [heads, keys] flattened: "
                                "q.k scaled, soft-capped where the family caps (Gemma 2), masked keys -inf "
                                "(the future, and keys past a sliding window), before the softmax; recomputed "
                                "from attn.hook_rot_q and attn.hook_rot_k", measured=False),
    Site(ATTN_PATTERN, "scores", "each query token's attention probabilities over the sample's keys, [heads, "
                                 "keys] flattened: the softmax of attn.hook_attn_scores (with gpt-oss's sink "
                                 "logit joined, its share dropped, so a row sums to 1 less the sink's)",
         measured=False),
    Site(ATTN_GATE, "heads", "gated attention's output gate before its sigmoid: q_proj's gate half per head "
                             "(Qwen3.5, Qwen3-Next: each head's output is multiplied by sigmoid of it)"),
    Site(DELTA_OUT, "delta_values", "a Gated DeltaNet (or Kimi Delta Attention) block's delta-rule output per "
                                    "value head (what its recurrent state gives the query), before the gated output "
                                    "norm, flattened to value heads x value_head_dim (head-major); the state itself, "
                                    "[Dk, Dv] per head and token, is not a site"),
    Site(INDEXED_KEYS, "index_topk", "the keys DeepSeek sparse attention's indexer chose for each query: "
                                     "their positions, highest index score first, -1 past the keys the query "
                                     "sees (int32); at GLM-5's shared blocks, the last full block's choice, which "
                                     "they attend to; at DeepSeek-V4's compressed sparse blocks, the compressed "
                                     "entries chosen (entry w: the window of positions w x rate to (w + 1) x rate - 1, "
                                     "with the window before it)", integer=True, measured=False),
    Site(ATTN_Z, "heads", "attention's output per head before the output projection, flattened to "
                          "n_heads * head_dim (head-major)"),
    Site(ATTN_MODULE_OUT, "hidden", "the attention module's output (o_proj's), before a post-attention norm: "
                                    "hook_attn_out itself where the block has none"),
    Site(ATTN_OUT, "hidden", "what attention adds to the stream (after the post-attention norm where the "
                             "block has one: Gemma 2, 3, OLMo 2; times Falcon-H1's attention_out_multiplier)"),
    Site(SSM_MODULE_OUT, "hidden", "the Mamba-2 mixer's output where it runs beside attention in every block "
                                   "(Falcon-H1's), before its output multiplier"),
    Site(SSM_OUT, "hidden", "what that Mamba-2 mixer adds to the stream (times ssm_out_multiplier); the block's "
                            "mixers add hook_attn_out + hook_ssm_out"),
    Site(RESID_MID, "resid", "resid_pre + attn_out (+ ssm_out in Falcon-H1): the MLP's input before its norm "
                             "(none in a parallel block: GPT-NeoX's MLP reads resid_pre); with hyper-connections "
                             "every stream after attention's write and mix"),
    Site(HC_MLP_COLLAPSE, "hidden", "with hyper-connections, what the MLP's norm reads: hook_resid_mid's streams "
                                    "collapsed"),
    Site(HC_MLP_WRITE, "streams", "with hyper-connections, the weight with which the MLP's output is written into "
                                  "each stream (computed in float32)"),
    Site(HC_MLP_MIX, "stream_pairs", "with hyper-connections, the matrix mixing the streams around the MLP "
                                     "(computed in float32)"),
    Site(LN2_NORMALIZED, "hidden", "the MLP's input after its norm, before the norm's gain (and bias): x / rms(x), "
                                   "or (x - mean) / std for a LayerNorm (none where the MLP's input has no norm: "
                                   "OLMo 2)"),
    Site(MLP_IN, "hidden", "the MLP's input after its norm with the gain applied (the MLP module's input)"),
    Site(ROUTER_LOGITS, "experts", "a mixture of experts' router logits, before the softmax (DeepSeek's: before "
                                   "the sigmoid or softmax and the selection bias; float32) (before an expert "
                                   "ablation masks any)"),
    Site(EXPERT_INDICES, "top_k", "the experts the router chose, most probable first (int32)", integer=True),
    Site(ROUTING_WEIGHTS, "top_k", "the weights scaling the chosen experts' outputs: their softmax probabilities, "
                                   "renormalised over the k where the family does (Mixtral; norm_topk_prob; "
                                   "gpt-oss: the softmax of the k logits; Gemma 4: times per_expert_scale; "
                                   "DeepSeek: the chosen scores, renormalised where norm_topk_prob, times "
                                   "routed_scaling_factor; Llama 4: each chosen logit's sigmoid, scaling the "
                                   "expert's input)"),
    Site(SHARED_EXPERT_GATE, "one", "Qwen2-MoE's shared expert gate: sigmoid(shared_expert_gate(x))"),
    Site(SHARED_EXPERT_OUT, "hidden", "the shared expert's output (Qwen2-MoE's, before its gate scales it; "
                                      "DeepSeek's shared_experts, added as it is)"),
    Site(MLP_PRE, "intermediate", "the MLP's pre-activation: gate_proj's output, or a plain MLP's fc output "
                                  "(the dense MLP's; none in a mixture of experts)"),
    Site(MLP_PRE_LINEAR, "intermediate", "a gated MLP's linear branch: up_proj's output (none in a plain MLP)"),
    Site(MLP_POST, "intermediate", "the MLP's hidden activation, act(gate) * up, or act(fc) in a plain MLP "
                                   "(the down projection's input; the dense MLP's beside Gemma 4's experts)"),
    Site(MLP_MODULE_OUT, "hidden", "the MLP's output before a post-feedforward norm: hook_mlp_out itself where "
                                   "the block has none"),
    Site(MLP_OUT, "hidden", "what the MLP adds to the stream (after the post-feedforward norm where the "
                            "block has one: Gemma 2, 3, OLMo 2)"),
    Site(RESID_POST, "resid", "block L's output, before the final norm (this project's layer L); with "
                              "hyper-connections every stream, [streams x hidden] stream-major as transformers' "
                              "[B, S, N, H] (the final norm reads their mean, or DeepSeek-V4's weighted collapse)"),
    Site(FINAL_NORMALIZED, "hidden", "the last block's output after the final norm, before its gain: x / rms(x), "
                                     "or (x - mean) / std, in float32", scope="model"),
    Site(FINAL_NORM, "hidden", "the final norm's output: what the unembedding reads (the logit lens's input; "
                               "Qwen4-Exp's, which has no final norm: the final gated collapse of the streams)",
         scope="model"),
    Site(LOGITS, "vocab", "the next-token logits, float32 (soft-capped where the family caps: Gemma 2); "
                          "stored with a token selection", scope="model"),
    Site(TOP_K_IDS, "logits_top_k", "the --logits_top_k most probable next tokens, most probable first (int32)",
         integer=True, scope="model", measured=False),
    Site(TOP_K_LOGPROBS, "logits_top_k", "their log-probabilities (log_softmax of the logits, float32)",
         scope="model"),
    Site(LOSS, "one", "the loss at each token: -log p(the next token), float32; NaN at a sample's last token, "
                      "which has no next", scope="model", measured=False),
    Site(ENTROPY, "one", "the entropy of the next-token distribution, in nats", scope="model"),
    Site(RANK, "one", "the next token's rank among the logits: how many tokens score higher (0: the argmax; "
                      "int32); -1 at a sample's last token", integer=True, scope="model", measured=False),
)}
MODEL_SITES = tuple(name for name, site in SITES.items() if site.scope == "model")
UNMEASURED = tuple(name for name, site in SITES.items() if not site.measured)
DEFAULT_SITES = (RESID_POST,)
HOOK_TEMPLATE = "blocks.{layer}.{site}"  # TransformerLens's hook names, SAELens's hook_name
ArrayKey = int | str  # L for block L's output, else the full hook name
_HOOK = re.compile(r"blocks\.(\d+)\.(.+)")


# interp-engine's point names (``interp_engine/points.py``) of the block sites -> ours. A name that
# differs by family in interp-engine (attn_out: before a post-norm) is the module's output here
# too, so the mapping needs no family; docs/sites.md says where the two conventions differ.
INTERP_ENGINE_POINTS = {
    "resid_pre": RESID_PRE, "attn_in": ATTN_IN, "q_norm_in": ATTN_Q, "q_norm_out": Q_NORM_OUT, "k_norm_in": ATTN_K,
    "k_norm_out": K_NORM_OUT, "value": ATTN_V, "attn_scores": ATTN_SCORES, "attn_probs": ATTN_PATTERN,
    "z": ATTN_Z, "attn_gate": ATTN_GATE, "attn_out": ATTN_MODULE_OUT, "attn_out_post": ATTN_OUT,
    "resid_mid": RESID_MID, "mlp_in": MLP_IN, "mlp_pre": MLP_PRE, "mlp_pre_linear": MLP_PRE_LINEAR,
    "mlp_act": MLP_POST, "router_logits": ROUTER_LOGITS, "expert_weights": ROUTING_WEIGHTS,
    "expert_indices": EXPERT_INDICES, "mlp_out": MLP_MODULE_OUT, "mlp_out_post": MLP_OUT, "resid_post": RESID_POST,
    "embeddings": EMBED, "final_norm": FINAL_NORM, "lm_head": LOGITS,
    # a hyper-connection trunk's (interp-engine's conditional points)
    "resid_streams": RESID_POST, "attn_stream_collapse": HC_ATTN_COLLAPSE, "attn_stream_write": HC_ATTN_WRITE,
    "attn_stream_mix": HC_ATTN_MIX, "mlp_stream_collapse": HC_MLP_COLLAPSE, "mlp_stream_write": HC_MLP_WRITE,
    "mlp_stream_mix": HC_MLP_MIX,
}


def parse_sites(text: str | Iterable[str]) -> tuple[str, ...]:
    """``--sites`` (comma- or space-separated site names, ours or interp-engine's point names) ->
    the sites in block order; ``UserError`` names one that does not exist."""
    names = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    if mapped := interp_engine_names(names):  # said once, where the flag is read (a runner's start)
        log.info("--sites: %s", ", ".join(f"{name} (interp-engine) is stored as {site}"
                                          for name, site in mapped.items()))
    names = [INTERP_ENGINE_POINTS.get(n, n) for n in names]
    unknown = [n for n in names if n not in SITES]
    if unknown:
        raise UserError(f"unknown site {unknown[0]!r} (choose from {', '.join(SITES)}; names as in "
                        "TransformerLens, after blocks.L., or interp-engine's point names)")
    if not names:
        raise UserError("no sites to extract")
    return tuple(s for s in SITES if s in names)


def interp_engine_names(text: str | Iterable[str]) -> dict[str, str]:
    """The interp-engine point names among ``--sites`` -> the sites they are stored as."""
    names = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    return {n: INTERP_ENGINE_POINTS[n] for n in names if n in INTERP_ENGINE_POINTS}


def with_top_k(sites: tuple[str, ...], logits_top_k: int | None) -> tuple[str, ...]:
    """``sites`` with the logits' top k (``model.sites.TOP_K``) where ``logits_top_k`` asks for them;
    ``UserError`` for either asked for by name without it, or for k below 1."""
    if logits_top_k is None:
        named = [site for site in sites if site in TOP_K]
        if named:
            raise UserError(f"--sites {named[0]}: its width is the top k's: pass --logits_top_k K")
        return sites
    if logits_top_k < 1:
        raise UserError(f"--logits_top_k must be at least 1, got {logits_top_k}")
    return parse_sites((*sites, *TOP_K))


def missing_reason(site: str, config, layer: int | None = None) -> str | None:
    """Why a model (``DecoderConfig``) has no ``site`` at block ``layer`` (None: at any block),
    or None when it has it."""
    if config.sublayers and (reason := _sublayer_reason(site, config, layer)):
        return reason
    if site in HYPER_SITES and config.hyper is None:
        return (f"{config.model_type} has one residual stream: no hyper-connections (GLM-5-next's, DeepSeek-V4's) "
                "collapse or mix "
                "streams")
    if site in (HC_ATTN_MIX, HC_MLP_MIX) and config.hyper is not None and config.hyper.kind == "gated":
        return (f"{config.model_type}'s gated residual adds a sublayer's output to each stream with its own weight "
                "(hc_*.hook_write): no matrix mixes the streams")
    if site == NGRAM_OUT and (config.ngram is None or layer is not None and layer >= 0
                              and layer not in config.ngram.layers):
        if config.ngram is None:
            return f"{config.model_type} has no hashed n-gram embeddings (Qwen4-Exp's)"
        return f"block {layer} adds no n-gram embedding: the n-gram blocks are {_spans(config.ngram.layers)}"
    if site == FINAL_NORMALIZED and not config.final_norm:
        return (f"{config.model_type} has no final norm: ln_final.hook_out is the final collapse of the streams, "
                "what the LM head reads")
    if site in ROUTING + SHARED_EXPERT and config.moe is None:
        return f"{config.model_type} is a dense model: it has no router"
    if site in SHARED_EXPERT and not config.moe.shared_expert_size:
        return f"{config.model_type} has no shared expert (Qwen2-MoE's, DeepSeek's)"
    if site == SHARED_EXPERT_GATE and not config.moe.shared_expert_gate:
        return f"{config.model_type}'s shared experts are added ungated (mlp.hook_shared_expert_out is their output)"
    if site in ROUTING + SHARED_EXPERT and layer is not None and not config.is_sparse(layer):
        return (f"block {layer} of {config.model_type} has a dense MLP: its "
                f"mixtures of experts are blocks {_spans(config.sparse_layers)}")
    if site == MLP_POST and config.moe is not None and not config.moe.beside_dense and (
            config.is_sparse(layer) if layer is not None else not config.moe.dense_layers):
        where = f"block {layer}'s" if layer is not None else f"every {config.model_type} block's"
        return f"{where} MLP is a mixture of experts: each expert has its own hidden activation"
    if site == RESID_MID and not config.has_resid_mid:
        return (f"{config.model_type} has a parallel residual: attention and the MLP both read the block's input, "
                f"so no stream exists between them (hook_resid_pre, hook_attn_out and hook_mlp_out do)")
    if site == ATTN_Z and (layer is None and not config.attention_layers
                           or layer is not None and config.is_recurrent(layer)):
        where = f"block {layer}" if layer is not None else f"every {config.model_type} block"
        return (f"{where} mixes with {_mixer(config, layer)}: no attention heads (hook_attn_out is what the mixer "
                f"adds); its attention blocks are {_spans(config.attention_layers) or 'none'}")
    if site in PARALLEL_SSM and (config.mamba is None or not config.mamba.parallel):
        return (f"{config.model_type} has no Mamba-2 mixer beside attention (Falcon-H1's; a Mamba-2 block's "
                "mixer output is attn.hook_out)")
    if site == INDEXED_KEYS and config.index_width is None:
        return f"{config.model_type} has no sparse attention indexer (DeepSeek-V3.2's, DeepSeek-V4's)"
    if site == INDEXED_KEYS and config.compressed is not None and layer is not None and layer >= 0 and \
            config.compressed.kind(layer) != CSA:
        sparse = tuple(i for i, kind in enumerate(config.compressed.kinds) if kind == CSA)
        return (f"block {layer}'s attention is {config.compressed.kind(layer)}: no indexer chooses its entries; its "
                f"compressed sparse blocks are {_spans(sparse)}")
    if site == INDEXED_KEYS and layer is not None and layer >= 0 and config.is_recurrent(layer):
        return (f"block {layer} mixes with {config.mixer_name(layer)}: no indexer chooses its keys; its attention "
                f"blocks are {_spans(config.attention_layers)}")
    if site == DELTA_OUT and (config.deltanet is None or layer is not None and not config.is_deltanet(layer)):
        if config.deltanet is None:
            return f"{config.model_type} has no Gated DeltaNet blocks (the families with them: {DELTANET_FAMILIES})"
        return (f"block {layer} mixes with {config.mixer_name(layer)}: the {config.deltanet.name} blocks are "
                f"{_spans(config.deltanet.layers)}")
    if site == LN2_NORMALIZED and not _normed_input(config, layer):
        return f"{_blocks(config, layer)} MLP reads the stream without a norm before it (mlp.hook_in is its input)"
    return _attention_reason(site, config, layer) or _mlp_reason(site, config, layer)


def _sublayer_reason(site: str, config, layer: int | None) -> str | None:
    """Why a model of single-sublayer blocks (``DecoderConfig.sublayers``) has no ``site`` at block
    ``layer`` (None: at any), or None."""
    if site == RESID_MID:
        return (f"{config.model_type}'s blocks have one sublayer each (a mixer or an MLP): no stream between two "
                "(hook_resid_pre and hook_resid_post are each block's input and output)")
    mixers = tuple(i for i in range(config.num_hidden_layers) if config.has_mixer(i))
    mlps = tuple(i for i in range(config.num_hidden_layers) if config.has_mlp(i))
    if site in MIXER_SITES and (not mixers if layer is None else layer >= 0 and not config.has_mixer(layer)):
        return (f"block {layer} of {config.model_type} is an MLP alone: it has no mixer (its blocks with one: "
                f"{_spans(mixers) or 'none'})")
    if site in MLP_SITES and (not mlps if layer is None else layer >= 0 and not config.has_mlp(layer)):
        return (f"block {layer} of {config.model_type} is a mixer alone: it has no MLP (its blocks with one: "
                f"{_spans(mlps) or 'none'})")
    return None


def _attention_reason(site: str, config, layer: int | None) -> str | None:
    """Why a model has no attention-inside site (``HEAD_SITES``, ``ln1.hook_normalized``) at
    ``layer`` (None: at any), or None."""
    if site == LN1_NORMALIZED and not _normed_input(config, layer):
        return (f"{_blocks(config, layer)} attention reads the stream without a norm before it (attn.hook_in is its "
                "input)")
    if site not in HEAD_SITES:
        return None
    if (layer is None and not config.attention_layers) or (layer is not None and config.is_recurrent(layer)):
        where = f"block {layer}" if layer is not None else f"every {config.model_type} block"
        return (f"{where} mixes with {_mixer(config, layer)}: no attention heads; its attention blocks are "
                f"{_spans(config.attention_layers) or 'none'}")
    if config.mla is not None:
        return (f"{config.model_type}'s latent attention expands its keys and values from a shared latent: "
                "its queries, keys, values and patterns are not sites yet (attn.hook_z is)")
    if config.compressed is not None:
        return (f"{config.model_type}'s attention reads one key/value head beside compressed entries: its queries, "
                "keys, values and patterns are not sites yet (attn.hook_z is)")
    if site in QK_NORM and config.qk_l2_norm:
        return (f"{config.model_type}'s QK-norm has no weight and follows rotary (attn.hook_rot_q and "
                "attn.hook_rot_k are its inputs; the scores are taken after it)")
    if site in QK_NORM and not config.qk_norm:
        return f"{config.model_type} has no QK-norm (the families with one: {QK_NORM_FAMILIES})"
    if site == ATTN_GATE and not config.attn_output_gate:
        return f"{config.model_type}'s attention has no output gate (gated attention: {GATE_FAMILIES})"
    if site in (ROT_Q, ROT_K) and config.positions != "learned" and (
            not any(config.rope_of(i) for i in range(config.num_hidden_layers)) if layer is None
            else layer >= 0 and config.rope_of(layer) is None):
        return (f"block {layer if layer is not None else 'none'} does not rotate (NoPE): "
                f"{'attn.hook_q' if site == ROT_Q else 'attn.hook_k'} is what is scored")
    if site in (ROT_Q, ROT_K) and config.positions == "learned":
        return (f"{config.model_type} adds learned positions to the embeddings: no rotary "
                f"({'attn.hook_q' if site == ROT_Q else 'attn.hook_k'} is what is scored)")
    if site in OWN_KV and layer is not None and config.kv_source(layer) is not None:
        return (f"block {layer} attends to block {config.kv_source(layer)}'s keys and values (kv sharing): it has "
                "none of its own")
    return None


def _mixer(config, layer: int | None) -> str:
    """The recurrent mixer of block ``layer`` (None: of the model's recurrent blocks), for messages."""
    if layer is not None:
        return config.mixer_name(layer)
    return config.deltanet.name if config.deltanet is not None else "Mamba-2"


def _normed_input(config, layer: int | None) -> bool:
    """Whether block ``layer``'s sublayers read a normed stream (None: any block's do)."""
    if layer is None:
        return any(config.layer_config(i).pre_norms for i in range(config.num_hidden_layers))
    return config.layer_config(layer).pre_norms


def _blocks(config, layer: int | None) -> str:
    """Whose sublayer a refusal names: ``block 3's`` where blocks differ, else the family's."""
    differ = config.deltanet is not None and config.deltanet.pre_norm_blocks
    return f"block {layer}'s" if layer is not None and differ else f"{config.model_type}'s"


def _mlp_reason(site: str, config, layer: int | None) -> str | None:
    """Why a model has no MLP pre-activation site at ``layer`` (None: at any), or None."""
    if site not in MLP_HIDDEN:
        return None
    if site == MLP_PRE_LINEAR and not config.gated_mlp:
        return f"{config.model_type}'s MLP is not gated: it has one input projection (mlp.hook_pre)"
    return missing_reason(MLP_POST, config, layer)


def check_sites(sites: Sequence[str], config, layers: Sequence[int] = ()) -> None:
    """``UserError`` in one line for a site this model does not have (at one of ``layers``)."""
    for site in sites:
        for layer in (None, *layers):
            if reason := missing_reason(site, config, layer):
                raise UserError(f"--sites {site}: {reason}")


def _spans(layers: Sequence[int]) -> str:
    """``1, 3, 5`` (the first ones and a count past eight)."""
    shown = ", ".join(map(str, layers[:8]))
    return shown + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")


def hook_name(site: str, layer: int) -> str:
    """The TransformerLens hook name of ``site`` at block ``layer``: ``blocks.L.<site>``; a
    model-level site's (``MODEL_SITES``) is its name."""
    return site if SITES[site].scope == "model" else HOOK_TEMPLATE.format(layer=layer, site=site)


def array_key(site: str, layer: int) -> ArrayKey:
    """How a stored array is keyed: ``layer`` for block outputs, else the full hook name (a
    model-level site's name, whatever ``layer``)."""
    return layer if site == RESID_POST else hook_name(site, layer)


def key_parts(key: ArrayKey) -> tuple[str, int]:
    """(site, layer) of an array key, a full hook name included (``blocks.6.hook_resid_post`` is
    key 6; a model-level site's name is at ``MODEL_LAYER``); ``UserError`` for anything else."""
    if isinstance(key, (int,)) and not isinstance(key, bool):
        return RESID_POST, int(key)
    if key in MODEL_SITES:
        return str(key), MODEL_LAYER
    match = _HOOK.fullmatch(str(key))
    if match is None or match.group(2) not in SITES:
        raise UserError(f"{key!r} names no stored array: a layer number, or blocks.L.<site> with a site "
                        f"from {', '.join(SITES)}")
    return match.group(2), int(match.group(1))


def normalized_key(key: ArrayKey) -> ArrayKey:
    """The canonical key of a layer number or a hook name (``blocks.6.hook_resid_post`` -> 6)."""
    return array_key(*key_parts(key))


def site_layers(site: str, layers: Sequence[int]) -> tuple[int, ...]:
    """The layers ``site`` is stored at: each of ``layers``, or a model-level site once."""
    return (MODEL_LAYER,) if SITES[site].scope == "model" else tuple(layers)


def array_keys(sites: Sequence[str], layers: Sequence[int]) -> list[ArrayKey]:
    """The keys of ``sites`` x ``layers`` in storage order: by layer, then by site in block order;
    the model-level sites last."""
    by_layer = [array_key(site, layer) for layer in layers for site in SITES
                if site in sites and site not in MODEL_SITES]
    return by_layer + [site for site in MODEL_SITES if site in sites]


def blocks_needed(sites: Sequence[str], layers: Sequence[int], depth: int | None = None) -> int:
    """Decoder blocks to compute: through the last layer asked for, except that block L's input
    (``hook_resid_pre``) needs only the blocks before it (at least one block: a model without
    blocks has no parameters to load); every block (``depth``) for the final norm and the logits."""
    if any(site in AFTER_BLOCKS for site in sites):
        if depth is None:
            raise ValueError("the final norm's and the logits' sites need the model's depth")
        return depth
    return max(1, *(layer + (site != RESID_PRE) for layer in layers for site in sites if site not in MODEL_SITES))


def site_width(site: str, config, layer: int | None = None, length: int | None = None,
               top_k: int | None = None) -> int:
    """The last dimension of ``site``'s arrays for a ``DecoderConfig`` (at block ``layer``, where
    blocks differ: Gemma 4's full blocks' heads, its kv-sharing blocks' wider MLPs); a pattern's
    for a sample of ``length`` tokens (its keys)."""
    kind = SITES[site].width
    config = config if layer is None or layer == MODEL_LAYER else config.layer_config(layer)
    if kind == "vocab":
        return config.vocab_size
    if kind == "logits_top_k":
        if top_k is None:
            raise ValueError(f"{site}'s width is --logits_top_k's")
        return top_k
    if kind == "scores":
        if length is None:
            raise ValueError(f"{site}'s width grows with the sample: give its length")
        return config.num_attention_heads * length
    if kind in ("heads", "kv_heads"):
        heads = config.num_attention_heads if kind == "heads" else config.num_key_value_heads
        return heads * config.head_dim
    if kind == "delta_values":
        return config.deltanet.value_dim
    if kind == "index_topk":
        return config.index_width
    if kind == "resid":
        return config.residual_width
    if kind in ("streams", "stream_pairs"):
        return config.hyper.streams ** (1 if kind == "streams" else 2)
    if kind in ("experts", "top_k"):
        return config.moe.num_experts if kind == "experts" else config.moe.top_k
    return {"intermediate": config.intermediate_size, "one": 1}.get(kind, config.hidden_size)


def bytes_per_token(sites: Sequence[str], layers: Sequence[int], config, itemsize: int,
                    row_bytes: int = 0, length: int | None = None, top_k: int | None = None) -> dict[str, int]:
    """What each site stores per token over ``layers`` (bytes; a model-level site once), in block
    order; ``row_bytes``: what each row of a layer adds besides its values (float8's scale:
    ``model.quantize.SCALE_BYTES``); a pattern's in a sample of ``length`` tokens; the top-k
    logits' at ``--logits_top_k`` ``top_k``."""
    integer = lambda site: SITES[site].integer
    return {site: sum(site_width(site, config, layer, length, top_k) * (4 if integer(site) else itemsize)
                      + (0 if integer(site) else row_bytes) for layer in site_layers(site, layers))
            for site in SITES if site in sites}


def cost_line(sites: Sequence[str], layers: Sequence[int], config, itemsize: int, row_bytes: int = 0,
              length: int | None = None, top_k: int | None = None) -> str:
    """One line saying what a run stores per token, site by site (printed before a run); a
    pattern's row grows with the sample: its figure is a sample of ``length`` tokens'."""
    per_site = bytes_per_token(sites, layers, config, itemsize, row_bytes, length, top_k)
    resid = config.residual_width * len(layers) * itemsize
    grows = lambda site: f" at {length} tokens: a sample's [S, heads, S]" if SITES[site].width == "scores" else ""
    parts = ", ".join(f"{site} {n / 1024:.1f} KiB ({n / resid:.2g}x resid{grows(site)})"
                      for site, n in per_site.items())
    return (f"storing {len(per_site)} site(s) at {len(layers)} layer(s): {sum(per_site.values()) / 1024:.1f} KiB "
            f"per token ({parts})")


MAX_ROW_KIB = 64.0  # --max_row_kib: a pattern per token at 2048 tokens and 8 heads, in float32, is this wide


def check_row_size(sites: Sequence[str], layers: Sequence[int], config, itemsize: int, length: int,
                   limit_kib: float, selected: bool) -> None:
    """``UserError`` in one line for patterns or scores (``PATTERNS``) or the logits that would
    store more than ``limit_kib`` per token over ``layers`` at ``length`` tokens, unless a token
    selection keeps few rows (``selected``)."""
    wide = [site for site in sites if site in (*PATTERNS, LOGITS)]
    if selected or not wide:
        return
    kib = sum(bytes_per_token(wide, layers, config, itemsize, length=length).values()) / 1024
    if kib <= limit_kib:
        return
    if LOGITS in wide:
        raise UserError(f"--sites {','.join(wide)}: {kib:.0f} KiB per token, past --max_row_kib {limit_kib:g} (the "
                        f"logits are a vocabulary-wide row per token); store a selection (--tokens last), their top "
                        f"k (--logits_top_k K), or raise --max_row_kib")
    raise UserError(f"--sites {','.join(wide)}: {kib:.0f} KiB per token at {length} tokens over {len(layers)} "
                    f"layer(s), past --max_row_kib {limit_kib:g} (a row is [heads, keys] for every token); store a "
                    f"selection (--tokens last), fewer layers, or raise --max_row_kib")


def integers_held(site: str) -> str:
    """What an integer site (``Site.integer``) holds, for messages: expert ids, token ids, ranks or
    key positions."""
    return {TOP_K_IDS: "token ids", RANK: "ranks", INDEXED_KEYS: "key positions"}.get(site, "expert ids")


def describe_key(key: ArrayKey) -> str:
    """``layer 6`` for a block output, else the hook name (for messages)."""
    return f"layer {key}" if isinstance(key, int) else str(key)
