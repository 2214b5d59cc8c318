"""One decoder configuration for every supported family, read from a Hugging Face ``config.json``.

``DecoderConfig`` holds the shapes and the switches by which the families differ (positions,
partial rotary, biases, q/k norms and their scope, query scale, soft-capping, sliding windows,
RoPE per layer type, the norm's kind, form and placement, the parallel residual, the MLP's form
and activation, a mixture of experts in place of the MLP, embedding scaling); each switch's
default is Llama's. The
family files in ``model/families/`` map a ``config.json`` onto it, in either layout users have
(the hub's, written by transformers 4.4x, and transformers 5's), and refuse with one line any
option that would change the computation and is not implemented. Nothing outside the config
reading and the weight loading knows which family a model is.

This module imports no JAX: flag parsers read its constants.
"""

from __future__ import annotations

import dataclasses
import math


# The attention kernels of a forward without a cache (``model.attention.attention_for``).
ATTENTION_KINDS = ("auto", "tiled", "fused", "cudnn")
# How a mixture of experts sends tokens to its experts (``model.moe``): auto picks by the expert count.
MOE_DISPATCHES = ("auto", "dense", "grouped")
MESH_TYPES = ("1d", "2d")  # data parallel | data x model (``model.sharding.make_mesh``)
COMPUTE_DTYPES = ("float32", "bfloat16")  # weights and matmuls; ``auto`` picks one by backend
STORED_DTYPES = ("float32", "float16", "bfloat16")  # activations as stored or handed to a trainer
FLOAT8 = "float8_e4m3fn"  # stored only, each row with its own scale (model.quantize); read back as float32
QUANTIZED_DTYPES = (FLOAT8,)
RESIDUAL_DTYPES = ("float32", "compute")  # the residual stream's: see model.extract.resolve_residual_dtype
FULL, SLIDING = "full_attention", "sliding_attention"  # layer types, named as transformers names them
CHUNKED = "chunked_attention"  # a layer attending within chunks of positions (Llama 4)
ROPE_KINDS = ("default", "linear", "llama3", "yarn")  # and Gemma 4's "proportional" (model.families.gemma4)
# The MLP activations, by transformers' names: gelu_pytorch_tanh and gelu_new are the same tanh
# approximation (Gemma's name, GPT-2's); gelu is the exact (erf) one (GPT-NeoX).
# relu2 is the squared ReLU (Nemotron-H's).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu", "relu2")
POSITIONS = ("rope", "learned")          # rotary | a learned absolute table added to the embeddings (GPT-2)
NORMS = ("rms", "layer")                 # RMSNorm | LayerNorm with a bias (GPT-2, GPT-NeoX)
QK_NORM_SCOPES = ("head", "projection")  # q/k normed per head over head_dim | over the whole projection (OLMo 2)
MIXER_ONLY, MLP_ONLY = "mixer", "mlp"    # a block of one sublayer (``DecoderConfig.sublayers``: Nemotron-H's)


@dataclasses.dataclass(frozen=True)
class RoPE:
    """The rotary embedding of one layer type (transformers' ``rope_parameters``)."""
    theta: float
    kind: str = "default"               # default | linear | llama3 | yarn | proportional
    factor: float = 1.0                 # linear, llama3, yarn, proportional: frequencies divided by it
    low_freq_factor: float = 1.0        # llama3: wavelengths past context/low are divided by factor
    high_freq_factor: float = 4.0       # llama3: wavelengths under context/high are kept
    original_max_position_embeddings: int = 8192  # llama3, yarn: the context the factors refer to
    beta_fast: float = 32.0             # yarn: pairs turning more than this often over that context are kept
    beta_slow: float = 1.0              # yarn: pairs turning less than this often are divided by factor
    truncate: bool = True               # yarn: the ramp between them starts and ends on whole pairs
    attention_factor: float = 1.0       # cos and sin multiplied by it (yarn's 0.1 ln(factor) + 1, by default)
    fraction: float = 1.0               # proportional: the share of each head's pairs that rotate, at the
                                        # frequencies of the whole head's; the others get frequency 0 (Gemma 4)


@dataclasses.dataclass(frozen=True)
class Chunked:
    """A chunked layer's locality (``DecoderConfig.window`` of a ``chunked_attention`` block: Llama
    4's): a query sees the earlier keys of its own chunk of ``size`` positions (positions
    [c * size, (c + 1) * size)), none before it."""
    size: int


@dataclasses.dataclass(frozen=True)
class QueryTemperature:
    """Queries scaled up by position before the scores: a query at position p times
    1 + beta * log(1 + floor((p + offset) / span)) (Llama 4's attention temperature tuning: offset 1,
    on the blocks without RoPE only; Mistral 4's ``llama_4_scaling_beta``: offset 0, every block)."""
    beta: float
    span: int
    offset: int = 0
    nope_only: bool = False   # only on the blocks that do not rotate (``DecoderConfig.nope_layers``)


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP (``DecoderConfig.moe``), as transformers' Mixtral, OLMoE,
    Qwen2-MoE and Qwen3-MoE compute it: a linear router without bias gives ``num_experts`` logits
    per token; their softmax (float32) picks the ``top_k`` experts, whose gated MLPs' outputs are
    summed, each scaled by its probability (renormalised over the k where ``normalize_top_k``).
    The switches below the first four give Gemma 4's, gpt-oss's and DeepSeek's variants."""
    num_experts: int
    top_k: int                          # experts per token (num_experts_per_tok)
    expert_size: int                    # each expert's intermediate width (moe_intermediate_size)
    normalize_top_k: bool               # the k probabilities divided by their sum (Mixtral; norm_topk_prob)
    weights_in_float32: bool = False    # the k weights stay float32 as they scale the experts' outputs
                                        # (Mixtral); off: rounded to the compute dtype first (Qwen, OLMoE)
    shared_expert_size: int | None = None  # a gated MLP of this width every token goes through, scaled by
                                           # sigmoid(shared_expert_gate(x)) and added (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # blocks with a dense MLP of intermediate_size instead (Qwen's
                                        # mlp_only_layers and decoder_sparse_step)
    beside_dense: bool = False          # the experts add to a dense MLP of intermediate_size instead of
                                        # replacing it, each output through a norm of its own; the experts
                                        # (through theirs) and the router read the stream after attention (Gemma 4)
    router_norm: bool = False           # the router reads x / rms(x) * its learned scale / sqrt(H) (Gemma 4)
    per_expert_scale: bool = False      # each chosen expert's weight, after the renormalisation, times that
                                        # expert's learned scale (Gemma 4)
    router_bias: bool = False           # the router's linear layer has a bias (gpt-oss)
    top_k_before_softmax: bool = False  # the k largest logits chosen first, their softmax the weights (gpt-oss;
                                        # with scoring "sigmoid": each one's sigmoid, Llama 4)
    input_scaled: bool = False          # each chosen expert reads x times its weight and the outputs are summed
                                        # as they are (Llama 4); off: the outputs are scaled by the weights
    expert_bias: bool = False           # the experts' projections have biases (gpt-oss)
    swiglu_limit: float | None = None   # the clamped SwiGLU: gate <= limit, |up| <= limit,
    swiglu_alpha: float | None = 1.702  # (up + 1) * gate * sigmoid(alpha * gate) (gpt-oss); None: act(gate) * up
                                        # (GLM-5-next)
    shared_expert_gate: bool = True     # the shared expert's output scaled by its sigmoid gate (Qwen2-MoE);
                                        # off: added as it is (DeepSeek's shared_experts)
    # DeepSeek's routers (``model.moe.route_grouped``): the router's weights, input and logits in float32,
    # scores by sigmoid (V3) or softmax (V2), the top k chosen within the best groups, the chosen
    # scores (not renormalised unless normalize_top_k) times routed_scaling.
    router_in_float32: bool = False     # the router's kernel kept and applied in float32 (x cast to it)
    scoring: str = "softmax"            # softmax | sigmoid | sqrtsoftplus (sqrt(softplus(x)): DeepSeek-V4's): the
                                        # scores from the logits (with grouped routing)
    hash_layers: tuple[int, ...] = ()   # blocks whose experts a token's id chooses (a table [V, k], tid2eid:
                                        # DeepSeek-V4's hash routing); their weights still the chosen scores
    selection_bias: bool = False        # a learned bias (e_score_correction_bias) added to the scores to
                                        # choose the experts, not to weight them (V3)
    groups: int = 0                     # > 0: the grouped router: experts in this many groups (n_group),
    top_groups: int = 1                 # the k chosen among the experts of these best groups (topk_group),
    group_score: str = "top2"           # a group's score: the sum of its 2 best (V3) or its best (V2: max)
    routed_scaling: float = 1.0         # the chosen experts' weights times this (routed_scaling_factor)
    normalize_epsilon: float = 0.0      # added to the sum when normalize_top_k divides by it (V3: 1e-20)
    latent_size: int | None = None      # the routed experts read and write a latent of this width: x projected
                                        # down (latent_in), their weighted sum back up (latent_out); the router
                                        # and the shared MLP read x (Nemotron 3 Super's moe_latent_size)


@dataclasses.dataclass(frozen=True)
class Indexer:
    """DeepSeek sparse attention's lightning indexer (``LatentAttention.indexer``: DeepSeek-V3.2), as
    transformers' ``DeepseekV32Indexer`` computes it (``model.indexer``): ``num_heads`` index queries
    of ``head_dim`` from the normed low-rank query (``wq_b``), one index key per position from x
    (``wk``, then a LayerNorm), the first ``qk_rope_head_dim`` dims of each rotated (rotate-half;
    none without RoPE); a key's score for a query is sum_h w_h relu(q_h . k / sqrt(head_dim)),
    w = weights_proj(x) / sqrt(num_heads), and the query attends to its ``topk`` best earlier keys
    only (all of them while it has no more). With ``pool`` > 1 (GLM-5-next's k-pool, as
    ``Glm5NextTextIndexer``): keys are scored in pools of ``pool`` consecutive positions from
    position 0, a pool's key their sum weighted by a softmax over its positions of per-position gate
    scores (``index_kpool_compress_gate``) plus a per-slot bias (``index_kpool_compress_ape``); a
    query may choose only pools it sees whole, keeps its ``topk // pool`` best, and with
    ``pool_tail`` also the keys it sees past its last whole pool."""
    num_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False  # its rotated dims pair as (0, 1), (2, 3), ... (GLM-5's): reordered at load time
    shared_layers: tuple[int, ...] = ()  # blocks without an indexer of their own: each attends to the keys the
                                         # last block before it with one chose (GLM-5's indexer_types shared)
    pool: int = 1                  # keys scored and chosen in pools of this many consecutive positions (index_kpool;
                                   # a divisor of topk); 1: one key at a time (DeepSeek-V3.2, GLM-5)
    pool_tail: bool = False        # with pools: a query also attends to the up to pool - 1 keys it sees past its
                                   # last whole pool (index_kpool_always_select_tail)
    mean_pool: bool = False        # Qwen4-Exp's QSA (``DecoderConfig.attention_indexer``, as
                                   # ``Qwen4ExpTextQSAIndexer``): queries and one raw key per position from x
                                   # (``index_qk_proj``), the queries (1 + w) RMS-normed per head and rotated; a
                                   # pool's key the mean of its raw keys, (1 + w) RMS-normed and rotated at the
                                   # pool's first position; scores sum_h relu(q_h . k) / sqrt(head_dim), no weights

    def owns(self, layer: int) -> bool:
        """Whether block ``layer`` runs an indexer of its own (else it reuses an earlier block's choice)."""
        return layer not in self.shared_layers

    @property
    def width(self) -> int:
        """The chosen keys' positions per query (``attn.hook_indexed_keys``' last dimension): the
        ``topk // pool`` chosen pools' positions, then with ``pool_tail`` ``pool - 1`` tail slots."""
        return self.topk + self.pool - 1 if self.pool_tail else self.topk


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (``DecoderConfig.mla``; DeepSeek-V2/V3, Kimi, GLM-4.7-Flash), as
    transformers' ``DeepseekV3Attention`` computes it: the query from x (``q_proj``) or through a
    low rank (``q_a_proj`` [H, q_lora_rank], its RMSNorm, ``q_b_proj``); keys and values from one
    compressed latent (``kv_a_proj_with_mqa``: [H, kv_lora_rank + rope dims], the latent through its
    RMSNorm, ``kv_b_proj`` to every head's key part without rotation and its value) and one rotated
    key part shared by every head. A head's query and key: qk_nope_head_dim dims without rotation,
    then qk_rope_head_dim rotated; its value: ``DecoderConfig.head_dim`` (v_head_dim) dims. A cache
    holds the normed latent and the rotated shared key part, not per-head keys and values."""
    kv_lora_rank: int
    q_lora_rank: int | None              # None: q_proj straight from x (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    rope_interleave: bool = True         # the rotated dims pair as (0, 1), (2, 3), ... in the checkpoint's rows:
                                         # reordered to rotate-half's halves at load time (q . k is unchanged)
    rope_in_float32: bool = False        # rotated in float32 and rounded once (V2's complex product); off: in
                                         # the compute dtype (V3)
    norm_eps: float = 1e-6               # the q and latent RMSNorms' (transformers builds them with its default,
                                         # whatever rms_norm_eps)
    indexer: Indexer | None = None       # DeepSeek sparse attention: each query's keys chosen by an indexer

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class DeltaNet:
    """Gated DeltaNet mixers (``DecoderConfig.deltanet``) in place of attention on ``layers``, as
    transformers' Qwen3.5 computes them (``model.deltanet``): projections of q, k, v (one fused
    ``in_proj_qkv`` in checkpoints, taken apart at load time), a causal depthwise convolution of
    ``conv_kernel`` taps with SiLU over them,
    L2-normalised q and k, per value head a decay g = -exp(A_log) softplus(a + dt_bias) and a
    rate beta = sigmoid(b), the gated delta rule, an RMSNorm of each head's output gated by
    SiLU(z), and ``out_proj``."""
    layers: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int     # a multiple of num_key_heads: each q/k head serves that many value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    beta_scale: float = 1.0  # beta = scale x sigmoid(b): 2 lets the delta rule's eigenvalues go negative
                             # (OLMo hybrid's linear_allow_neg_eigval)
    norm_eps: float | None = None  # the gated output norm's epsilon (None: the model's norm_eps)
    pre_norm_blocks: bool = False  # its blocks norm the sublayers' inputs and not their outputs, whatever the
                                   # attention blocks do (OLMo hybrid: OLMo 2's attention blocks)
    channel_decay: bool = False  # Kimi Delta Attention: the decay per key channel (dt_bias per channel, A_log per
                                 # head), its rows of the state decayed apart; off: one decay a value head
    gate_rank: int | None = None  # the decay's and the output gate's projections through this rank (Kimi's f_a/f_b
                                  # and g_a/g_b, key_head_dim wide); None: each straight from x (in_proj_a, _z)
    output_gate: str = "silu"  # the gated output norm's gate: silu (Qwen3.5) or sigmoid (Kimi)
    norm_in_float32: bool = False  # the gated output norm's weight applied to the float32 normed output, not to
                                   # it rounded to the compute dtype (Kimi's "strict fp32" norm)
    decay_lower_bound: float | None = None  # the decay bounded below: g = bound x sigmoid(exp(A_log) x (f + dt_bias))
                                            # in place of -exp(A_log) softplus(f + dt_bias) (GLM-5-next's
                                            # linear_lower_bound)
    float32_params: tuple[str, ...] = ()  # its parameters held in float32 whatever the dtype, as transformers keeps
                                          # them (Kimi's dt_bias; GLM-5-next's dt_bias, A_log, conv_q, conv_k, conv_v)

    @property
    def name(self) -> str:
        """The mixer's name, for messages."""
        return "Kimi Delta Attention" if self.channel_decay else "Gated DeltaNet"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class Mamba2:
    """Mamba-2 mixers (``DecoderConfig.mamba``) in place of attention on ``layers``, as transformers'
    ``GraniteMoeHybridMambaLayer`` computes them (``model.decoder.Mamba2Mixer``; the recurrence:
    ``model.mamba2``): ``in_proj`` writes the gate z, the convolution's input (x | B | C) and dt; a
    causal depthwise convolution of ``conv_kernel`` taps (with a bias where ``conv_bias``) and SiLU
    over x | B | C; per head (``num_heads`` of ``head_dim``) the selective scan with B and C shared
    by the heads of each of ``num_groups`` groups (``state_size`` each), D's skip; an RMSNorm per
    group of SiLU(z)-gated outputs, and ``out_proj``."""
    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    state_size: int           # N: a head's state is [head_dim, state_size]
    num_groups: int           # B and C groups (a divisor of num_heads)
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False   # in_proj and out_proj have biases
    time_step_limit: tuple[float, float] = (0.0, math.inf)  # dt clamped to it
    parallel: bool = False    # beside attention on its blocks, reading the same normed input, the two outputs
                              # added (Falcon-H1's); off: in place of attention
    gated_norm: bool = True   # the gated RMSNorm per group; off: the output times SiLU(z) alone (Falcon-H1's
                              # mamba_rms_norm false)
    norm_before_gate: bool = False  # the gated norm normalises the output, then multiplies by SiLU(z) (Falcon-H1's
                                    # mamba_norm_before_gate); off: it normalises output x SiLU(z)
    projection_multipliers: tuple[float, ...] = ()  # in_proj's z, x, B, C and dt parts times these (Falcon-H1's
                                                    # ssm_multipliers: its mup_vector); (): none

    @property
    def inner(self) -> int:
        """The mixer's width: heads x head_dim (z's, x's)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: x | B | C."""
        return self.inner + 2 * self.num_groups * self.state_size


@dataclasses.dataclass(frozen=True)
class Multipliers:
    """Falcon-H1's μP multipliers (``DecoderConfig.multipliers``), each a scalar on one tensor of the
    block, as transformers' ``FalconH1DecoderLayer`` applies them."""
    attention_in: float = 1.0   # attention reads the normed input times it
    attention_out: float = 1.0  # what attention adds, times it
    key: float = 1.0            # the keys (k_proj's output) times it, before RoPE
    ssm_in: float = 1.0         # the parallel Mamba-2 mixer reads the normed input times it
    ssm_out: float = 1.0        # what it adds, times it
    mlp_gate: float = 1.0       # the MLP's gate projection's output times it, before the activation
    mlp_down: float = 1.0       # the MLP's output times it
    lm_head: float = 1.0        # the logits times it


@dataclasses.dataclass(frozen=True)
class HyperConnections:
    """Manifold-constrained hyper-connections (``DecoderConfig.hyper``: GLM-5-next's; ``model.hyper``),
    as transformers' ``DeepseekV4HyperConnection`` computes them: the residual is ``streams`` streams
    per token ([B, S, N x H], stream-major), the embeddings copied into each. Before each sublayer a
    projection of the RMS-normed (unweighted) streams gives per token a collapse ``pre`` [N]
    (sigmoid), a write ``post`` [N] (2 sigmoid) and a mixing matrix ``comb`` [N, N] (a softmax made
    doubly stochastic by ``sinkhorn_iters`` Sinkhorn steps); the sublayer reads sum_j pre_j x_j
    and the streams become post_k out + sum_j comb_jk x_j. After the last block the streams are
    averaged (``head`` mean) before the final norm."""
    streams: int                 # hc_mult
    sinkhorn_iters: int = 20     # hc_sinkhorn_iters
    eps: float = 1e-6            # hc_eps: added to pre and comb, and to each Sinkhorn sum
    norm_eps: float = 1e-6       # the unweighted RMSNorm of the flattened streams (the model's rms_norm_eps)
    head: str = "mean"           # how the last block's streams become one before the final norm: their mean
                                 # (GLM-5-next's) or weighted (DeepSeek-V4's hc_head: sigmoid(scale (fn @
                                 # rms-normed streams) + base) + eps per stream); gated: the gated kind's
                                 # collapse with its own weights (hyper_connection_mixer), no final norm after
    kind: str = "mhc"            # mhc (above) | gated: Qwen4-Exp's gated residual (transformers'
                                 # Qwen4ExpTextGatedResidual): each stream RMS-normed apart with a (1 + w) weight,
                                 # the sublayer reads the streams' mean gated per channel by sigmoid(up(silu(
                                 # down(normed) / N))) through ``rank``, and each stream k becomes x_k + inj_k out,
                                 # inj = 2 sigmoid(inject(normed) / N): no mixing matrix
    rank: int = 0                # gated: the gate's low rank (hc_lowrank)


@dataclasses.dataclass(frozen=True)
class NGram:
    """Qwen4-Exp's hashed n-gram embeddings (``DecoderConfig.ngram``; ``model.ngram``; transformers'
    ``Qwen4ExpTextPLELayer``, its "PLE"): on ``layers`` each token's n-grams of orders 2 to ``order``
    (within its segment: an ``eos`` token ends one) are hashed into ``heads_per_order`` tables each
    (prime-sized, consecutive primes from ``vocab_base`` on, one series across the layers), the rows
    concatenated [``embed_dim``]; a key and a value projection of it gate, per stream, a copy of the
    value by the signed square root of its match with the RMS-normed stream; that plus a dilated
    causal convolution (dilation ``order``, ``conv_kernel`` taps) of it is added to the streams
    before the block's attention collapse."""
    layers: tuple[int, ...]      # the blocks with one (transformers' 1-based ple_layer_ids, minus 1)
    embed_dim: int               # ple_embed_dim: the concatenated rows' width
    order: int = 3               # ngram_size: the largest n-gram order (orders 2..order)
    heads_per_order: int = 8     # heads_per_ngram: tables per order
    conv_kernel: int = 4         # ple_conv_kernel_size
    vocab_base: int = 20_000_000  # ngram_vocab_size_base: each table's size is a prime from here on
    rows_multiple: int = 128     # make_ngram_vocab_size_divisible_by: a layer's table rows rounded up to it
    seed: int = 1234             # the hash multipliers' seed
    eos: int = 0                 # eos_token_id: ends an n-gram's segment (and stands for positions before it)
    parts: int = 512             # split_ngram_parts: the row shards a checkpoint holds each table in

    @property
    def heads(self) -> int:
        """Tables a layer looks up per token: (order - 1) x heads_per_order."""
        return (self.order - 1) * self.heads_per_order

    def rank(self, layer: int) -> int:
        """Block ``layer``'s place among the n-gram blocks (its hash constants depend on it)."""
        return self.layers.index(layer)


# DeepSeek-V4's attention kinds per block (transformers' layer_types): the sliding window alone, or beside it
# the compressed entries every query sees (heavily compressed) or an indexer chooses (compressed sparse).
SLIDING_ONLY, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclasses.dataclass(frozen=True)
class CompressedAttention:
    """DeepSeek-V4's attention (``DecoderConfig.compressed``; ``model.compressed``), as transformers'
    ``DeepseekV4Attention`` computes it: the query through a low rank (``q_a_proj``, its RMSNorm,
    ``q_b_proj``, then each head RMS-normed without a weight); one key/value head (``kv_proj``, its
    RMSNorm), read as key and as value; the last ``rope_dim`` dims of each head rotated by
    interleaved pairs, and the output's rotated back at the query's position; gpt-oss's sinks; a
    sliding window (``DecoderConfig.sliding_window``) over the keys; the heads' outputs projected in
    ``output_groups`` groups to ``output_rank`` each (``o_a_proj``), then together (``o_b_proj``).
    Beside the window, a block of kind CSA or HCA (``kinds``) attends to compressed entries: one per
    window of ``rate`` positions, a softmax(gate + position bias)-weighted sum of the window's
    ``kv_proj`` rows per channel, RMS-normed and rotated at the window's first position; an HCA
    block's query sees each entry whose window has closed, a CSA block's (whose windows overlap the
    previous one: 2 rate slots, two series of its projections) only the ``indexer``'s ``topk`` of
    them (its own compressor at the indexer's head size, scored as DeepSeek-V3.2's indexer scores)."""
    q_lora_rank: int
    rope_dim: int                        # the rotated last dims of each head (qk_rope_head_dim)
    output_groups: int                   # o_groups
    output_rank: int                     # o_lora_rank
    kinds: tuple[str, ...]               # per block: SLIDING_ONLY, CSA or HCA
    csa_rate: int                        # positions per compressed entry of a CSA block
    hca_rate: int                        # of an HCA block
    rope: RoPE                           # the CSA and HCA blocks' rotary and their compressors' (the sliding
                                         # blocks': ``DecoderConfig.rope``)
    indexer: Indexer | None = None       # the CSA blocks' indexer (num_heads, head_dim, topk)

    def kind(self, layer: int) -> str:
        return self.kinds[layer]

    def rate(self, kind: str) -> int:
        """Positions per compressed entry of a block of ``kind`` (0: a sliding block has none)."""
        return {CSA: self.csa_rate, HCA: self.hca_rate}.get(kind, 0)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder: embedding, blocks of attention and an MLP, final norm, LM head.

    A block is pre-norm and sequential by default (``x + attn(norm(x))``, then the same with the
    MLP); the switches below change the norms' kind and placement, make the two sublayers read
    the same input (``parallel_residual``) and the MLP plain. Names as in Hugging Face's configs
    where one exists."""
    model_type: str                      # the family, as config.json names it (for reports)
    vocab_size: int
    hidden_size: int                     # residual stream width
    intermediate_size: int               # MLP width (its hidden activation's)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int             # < num_attention_heads for grouped-query attention
    head_dim: int                        # may differ from hidden_size // num_attention_heads
    norm_eps: float                      # every norm's epsilon (rms_norm_eps, layer_norm_eps, ...)
    tie_word_embeddings: bool            # LM head = the embedding matrix
    max_position_embeddings: int         # with learned positions, the table's size: the longest sequence
    rope: RoPE | None                    # RoPE of full-attention layers (of every layer unless sliding_rope);
                                         # None with learned positions
    # The switches; each default is Llama's.
    positions: str = "rope"              # rope | learned: a [max_position_embeddings, H] table added to the
                                         # token embeddings, and no rotation (GPT-2)
    rotary_dim: int | None = None        # RoPE on the first rotary_dim of each head's dims only, the rest passed
                                         # through, frequencies over rotary_dim (GPT-NeoX's rotary_pct, Phi-3's
                                         # partial_rotary_factor); None: the whole head
    norm: str = "rms"                    # rms | layer: LayerNorm with a bias (GPT-2, GPT-NeoX); every norm of the model
    pre_norms: bool = True               # norms on the sublayers' inputs; off: only on their outputs (OLMo 2,
                                         # with sandwich_norms)
    parallel_residual: bool = False      # x + attn(norm1(x)) + mlp(norm2(x)): both sublayers read the block's
                                         # input, so there is no resid_mid (GPT-NeoX's use_parallel_residual)
    gated_mlp: bool = True               # down(act(gate(x)) * up(x)); off: the plain down(act(up(x))) (GPT-2, NeoX)
    qkv_bias: bool = False               # q, k, v projections have biases (Qwen2; Llama's attention_bias)
    o_bias: bool = False                 # the output projection has one (Llama's attention_bias)
    mlp_bias: bool = False               # gate, up and down projections have biases (Llama's mlp_bias)
    qk_norm: bool = False                # RMSNorm on q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
    qk_norm_scope: str = "head"          # head: over each head's head_dim | projection: over all heads at once,
                                         # before the split into heads (OLMo 2)
    query_pre_attn_scalar: float | None = None  # scores scaled by its 1/sqrt (Gemma); None: head_dim's
    query_temperature: QueryTemperature | None = None  # queries scaled up by position (Mistral 4, Llama 4)
    attn_logit_softcap: float | None = None     # scores -> tanh(scores / c) * c before the mask (Gemma 2)
    final_logit_softcap: float | None = None    # the same on the LM head's logits (Gemma 2)
    sliding_window: int | None = None    # keys a sliding layer's query sees, itself included
    attention_chunk_size: int | None = None  # a chunked layer's chunk of positions (Llama 4: ``Chunked``)
    layer_types: tuple[str, ...] = ()    # per block, FULL, SLIDING or CHUNKED; () is every block FULL
    sliding_rope: RoPE | None = None     # RoPE of sliding layers when it differs (Gemma 3's local base)
    nope_layers: tuple[int, ...] = ()    # blocks that do not rotate q and k at all (SmolLM3's no_rope_layers)
    rope_interleaved: bool = False       # RoPE rotates dims (2i, 2i + 1) together (Llama 4's complex product);
                                         # off: (i, i + D/2), Hugging Face's rotate_half
    qk_l2_norm: bool = False             # q and k divided by their rms per head, no weight, after rotary, on the
                                         # blocks that rotate (Llama 4's use_qk_norm; epsilon norm_eps)
    norm_unit_offset: bool = False       # RMSNorm scales by (1 + w), in float32 (Gemma)
    norm_weight_in_float32: bool = False  # RMSNorm's w multiplies the float32 normalised x, one rounding after
                                         # (OLMo 2); off: x is rounded to the dtype first, then scaled (Llama)
    sandwich_norms: bool = False         # norms on the attention and MLP outputs too (Gemma 2, 3, OLMo 2)
    hidden_act: str = "silu"             # the MLP's activation: one of ACTIVATIONS
    swiglu_limit: float | None = None    # the dense MLP's (and shared experts') gate <= limit and |up| <= limit
                                         # before act(gate) * up (GLM-5-next's; its experts': MoE.swiglu_limit)
    moe: MoE | None = None               # a mixture of experts in place of the MLP (of every block but
                                         # moe.dense_layers); None: a dense model
    clip_qkv: float | None = None        # q, k and v clamped to [-c, c] after their projections (and q/k
                                         # norms) (OLMoE)
    scale_embeddings: bool = False       # embeddings x sqrt(hidden_size), rounded to the dtype (Gemma)
    attn_output_gate: bool = False       # q_proj writes each head's query and a gate; the head's output is
                                         # multiplied by sigmoid(gate) before o_proj (Qwen3.5)
    deltanet: DeltaNet | None = None     # Gated DeltaNet mixers in place of attention on deltanet.layers
    mamba: Mamba2 | None = None          # Mamba-2 mixers in place of attention on mamba.layers (Granite 4)
    multipliers: Multipliers = Multipliers()  # Falcon-H1's μP multipliers (each 1: none)
    sublayers: tuple[str, ...] = ()      # per block, MIXER_ONLY or MLP_ONLY: its one sublayer, x + mixer(norm(x))
                                         # or x + mlp(norm(x)) (Nemotron-H's); () is every block both
    embedding_multiplier: float = 1.0    # the embeddings times it (Granite's)
    residual_multiplier: float = 1.0     # what each sublayer adds to the stream times it (Granite's)
    logits_scaling: float = 1.0          # the logits divided by it (Granite's)
    global_head_dim: int | None = None   # full-attention blocks' head size where it differs (Gemma 4)
    global_key_value_heads: int | None = None  # and their kv heads where those differ
    attention_k_eq_v: bool = False       # full-attention blocks have no v_proj: the values are k_proj's output
                                         # (before k's norm and RoPE), through the value norm (Gemma 4)
    value_norm: bool = False             # values divided by their rms per head, without a weight (Gemma 4)
    kv_shared_layers: int = 0            # the last N blocks compute no keys/values: each attends to those of
                                         # the last earlier block of its layer type (Gemma 4)
    double_wide_mlp: bool = False        # those N blocks' MLPs are 2 x intermediate_size wide (Gemma 4)
    per_layer_input_size: int = 0        # per-layer embeddings of this width, one slice per block, gating an
                                         # addition after the MLP (Gemma 4's PLE); 0: none
    per_layer_vocab_size: int = 0        # the per-layer embedding table's rows
    layer_scalar: bool = False           # each block's output multiplied by its learned scalar (Gemma 4)
    attention_sinks: bool = False        # a learned logit per head joins every query's softmax, and its
                                         # share is dropped (gpt-oss's sinks)
    mla: LatentAttention | None = None   # multi-head latent attention in place of q/k/v projections; head_dim
                                         # is then the values' (v_head_dim), rotary_dim the rotated key part's
    hyper: HyperConnections | None = None  # the residual as several streams mixed around each sublayer (GLM-5-next)
    compressed: CompressedAttention | None = None  # DeepSeek-V4's attention in place of q/k/v projections
    ngram: NGram | None = None           # hashed n-gram embeddings added to the streams on ngram.layers (Qwen4-Exp)
    attention_indexer: Indexer | None = None  # each attention block's keys chosen by this indexer (its mean_pool
                                         # kind: Qwen4-Exp's QSA); a latent attention's is ``mla.indexer``
    final_norm: bool = True              # the final norm before the LM head; off: none (Qwen4-Exp, whose gated
                                         # streams' collapse normalises)
    weight_block_size: tuple[int, int] | None = None  # FP8 checkpoints: the [rows, columns] of weight each
                                         # scale entry scales, or ``model.fp8.FROM_SCALES`` (each weight's from
                                         # its scales' grid: per-tensor or per-channel scales)

    def layer_config(self, layer: int) -> "DecoderConfig":
        """The config as block ``layer`` sees it: its head size, kv heads and MLP width where
        blocks differ (Gemma 4's full-attention and kv-sharing blocks), its norms' placement
        (OLMo hybrid's DeltaNet blocks); this config elsewhere."""
        changes = {}
        if self.is_deltanet(layer) and self.deltanet.pre_norm_blocks:
            changes.update(pre_norms=True, sandwich_norms=False)
        if self.window(layer) is None:  # a full-attention block
            if self.global_head_dim:
                changes["head_dim"] = self.global_head_dim
            if self.global_key_value_heads:
                changes["num_key_value_heads"] = self.global_key_value_heads
        if self.double_wide_mlp and self.kv_source(layer) is not None:
            changes["intermediate_size"] = 2 * self.intermediate_size
        return dataclasses.replace(self, **changes) if changes else self

    def kv_source(self, layer: int) -> int | None:
        """The block whose keys and values block ``layer`` attends to instead of its own (the
        last block before the shared ones with its layer type), or None: its own."""
        first_shared = self.num_hidden_layers - self.kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer] if self.layer_types else FULL
        return max(i for i in range(first_shared) if (self.layer_types[i] if self.layer_types else FULL) == kind)

    @property
    def max_head_dim(self) -> int:
        """The widest head of any block (what per-head arrays over blocks are padded to)."""
        return max(self.layer_config(i).head_dim for i in range(self.num_hidden_layers))

    @property
    def attention_head_dim(self) -> int:
        """The head size of the attention kernels' queries and keys (a latent attention's qk
        head size; its values are padded to it for the fused kernels)."""
        return self.mla.qk_head_dim if self.mla else self.head_dim

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def query_scale_divisor(self) -> float:
        """What q . k is divided by: sqrt(head_dim) (a latent attention's query and key head size),
        or sqrt(query_pre_attn_scalar)."""
        return math.sqrt(self.query_pre_attn_scalar or self.attention_head_dim)

    @property
    def rope_dim(self) -> int:
        """The dims of each head that RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    def has_mixer(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixer (attention or a recurrence): all but MLP_ONLY blocks."""
        return not self.sublayers or self.sublayers[layer] != MLP_ONLY

    def has_mlp(self, layer: int) -> bool:
        """Whether block ``layer`` has an MLP (or a mixture of experts): all but MIXER_ONLY blocks."""
        return not self.sublayers or self.sublayers[layer] != MIXER_ONLY

    @property
    def index_width(self) -> int | None:
        """A sparse attention indexer's choice per query (``attn.hook_indexed_keys``' width), None without one."""
        if self.mla is not None and self.mla.indexer is not None:
            return self.mla.indexer.width
        if self.compressed is not None and CSA in self.compressed.kinds:
            return self.compressed.indexer.topk
        if self.attention_indexer is not None:
            return self.attention_indexer.width
        return None

    @property
    def residual_width(self) -> int:
        """The residual stream's width per token: hidden_size, times the streams of hyper-connections."""
        return self.hidden_size * (self.hyper.streams if self.hyper else 1)

    @property
    def has_resid_mid(self) -> bool:
        """Whether a residual stream exists between attention and the MLP (in any block)."""
        return not self.parallel_residual and not self.sublayers

    @property
    def has_mlp_norm(self) -> bool:
        """Whether the MLP's input is normed (not in OLMo 2's block)."""
        return self.pre_norms

    @property
    def num_experts(self) -> int:
        """Experts per mixture-of-experts block (0 for a dense model)."""
        return self.moe.num_experts if self.moe is not None else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is a mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_layers and self.has_mlp(layer)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The blocks whose MLP is a mixture of experts."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The blocks whose mixer is attention."""
        return tuple(i for i in range(self.num_hidden_layers) if self.has_mixer(i) and not self.is_recurrent(i))

    def is_deltanet(self, layer: int) -> bool:
        """Whether block ``layer``'s mixer is Gated DeltaNet (else attention)."""
        return self.deltanet is not None and layer in self.deltanet.layers

    def is_mamba(self, layer: int) -> bool:
        """Whether block ``layer``'s mixer is Mamba-2 (in place of attention)."""
        return self.mamba is not None and layer in self.mamba.layers and not self.mamba.parallel

    def has_parallel_mamba(self, layer: int) -> bool:
        """Whether block ``layer`` runs a Mamba-2 mixer beside its attention (Falcon-H1's)."""
        return self.mamba is not None and layer in self.mamba.layers and self.mamba.parallel

    def is_recurrent(self, layer: int) -> bool:
        """Whether block ``layer``'s mixer is a recurrence (Gated DeltaNet, Mamba-2), not attention."""
        return self.is_deltanet(layer) or self.is_mamba(layer)

    def mixer_name(self, layer: int) -> str:
        """Block ``layer``'s mixer, for messages."""
        return self.deltanet.name if self.is_deltanet(layer) else "Mamba-2" if self.is_mamba(layer) else "attention"

    def window(self, layer: int) -> int | Chunked | None:
        """Block ``layer``'s locality: its sliding window (keys), its chunk (``Chunked``), or None:
        it attends to every earlier key."""
        kind = self.layer_types[layer] if self.layer_types else FULL
        if kind == CHUNKED:
            return Chunked(self.attention_chunk_size)
        return self.sliding_window if kind == SLIDING else None

    def rope_of(self, layer: int) -> RoPE | None:
        """Block ``layer``'s rotary embedding (None: the block does not rotate)."""
        if layer in self.nope_layers:
            return None
        if self.compressed is not None and self.compressed.kind(layer) != SLIDING_ONLY:
            return self.compressed.rope
        return self.sliding_rope if self.window(layer) is not None and self.sliding_rope else self.rope
