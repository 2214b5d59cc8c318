"""Reading config.json: the published configs of each family in the hub's layout, the same
configs as transformers 5 writes them (``config_class.from_dict(...).to_dict()``: what
transformers itself derives from the hub's file), defaults, and one-line refusals."""

import json

import pytest

from common.cli import UserError
from model.config import FULL, SLIDING, RoPE
from model.families import config_from_dict, load_config

# Published config.json files (the fields that matter here), as the hub serves them.
QWEN2_5 = {
    "0.5B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
             "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
             "tie_word_embeddings": True, "vocab_size": 151936, "max_position_embeddings": 32768,
             "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 24,
             "rope_scaling": None, "torch_dtype": "bfloat16"},
    "1.5B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
             "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
             "tie_word_embeddings": True, "vocab_size": 151936, "max_position_embeddings": 131072,
             "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
             "rope_scaling": None, "torch_dtype": "bfloat16"},
    "7B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
           "tie_word_embeddings": False, "vocab_size": 152064, "max_position_embeddings": 131072,
           "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
           "rope_scaling": None, "torch_dtype": "bfloat16"},
}
LLAMA_3_2_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
                "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
                "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256}
MISTRAL_7B_V0_1 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                   "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                   "tie_word_embeddings": False, "vocab_size": 32000}
MISTRAL_7B_V0_3 = {**MISTRAL_7B_V0_1, "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768}
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
              "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
              "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
GEMMA_2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
              "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid", "final_logit_softcapping": 30.0,
              "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
              "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
              "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
              "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
              "vocab_size": 256000}
# Written by transformers 4.55: layer_types beside the old RoPE keys.
GEMMA_3_270M = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
                "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "intermediate_size": 2048,
                "layer_types": [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)],
                "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 18,
                "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
                "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 512,
                "use_bidirectional_attention": False, "vocab_size": 262144}
# The multimodal wrapper: its text_config leaves most settings to Gemma3TextConfig's defaults.
GEMMA_3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
GPT2_SMALL = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
              "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
              "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
              "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_type": "cls_index",
              "summary_use_proj": True, "vocab_size": 50257}
PYTHIA_160M = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
               "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
               "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 12,
               "num_hidden_layers": 12, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
               "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}
OLMO_2_1B = {"architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
             "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 16,
             "num_hidden_layers": 16, "num_key_value_heads": 16, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
             "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352}
PHI_3_MINI_4K = {"architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                 "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
                 "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
                 "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
                 "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
                 "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
                 "tie_word_embeddings": False, "vocab_size": 32064}
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64, "hidden_act": "silu",
                "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False,
                "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
                "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
                "vocab_size": 49152}
TINYLLAMA_1_1B = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 2048,
                  "intermediate_size": 5632, "max_position_embeddings": 2048, "model_type": "llama",
                  "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4,
                  "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "vocab_size": 32000}
PUBLISHED = {"qwen2.5-0.5b": QWEN2_5["0.5B"], "qwen2.5-7b": QWEN2_5["7B"], "llama-3.2-1b": LLAMA_3_2_1B,
             "mistral-7b-v0.1": MISTRAL_7B_V0_1, "mistral-7b-v0.3": MISTRAL_7B_V0_3, "qwen3-0.6b": QWEN3_0_6B,
             "gemma-2-2b": GEMMA_2_2B, "gemma-3-270m": GEMMA_3_270M, "gemma-3-4b": GEMMA_3_4B, "gpt2": GPT2_SMALL,
             "pythia-160m": PYTHIA_160M, "olmo-2-1b": OLMO_2_1B, "phi-3-mini-4k": PHI_3_MINI_4K,
             "smollm2-135m": SMOLLM2_135M, "tinyllama-1.1b": TINYLLAMA_1_1B}


def transformers_5_layout(raw: dict) -> dict:
    """The config as transformers 5 writes it after reading ``raw`` (layer_types, rope_parameters)."""
    from transformers import AutoConfig
    raw = json.loads(json.dumps(raw))  # transformers may edit nested dicts in place
    return AutoConfig.for_model(raw.pop("model_type"), **raw).to_dict()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_both_layouts_give_the_same_model(name):
    hub = PUBLISHED[name]
    written = transformers_5_layout(hub)
    assert "rope_parameters" in (written.get("text_config") or written) or name == "gpt2"  # no RoPE
    assert config_from_dict(written) == config_from_dict(hub)


@pytest.mark.parametrize("size, head_dim, groups", [("0.5B", 64, 7), ("1.5B", 128, 6), ("7B", 128, 7)])
def test_qwen2_5_configs_load(tmp_path, size, head_dim, groups):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5[size]))
    config = load_config(tmp_path)
    assert (config.head_dim, config.kv_groups) == (head_dim, groups)
    assert config.hidden_size == QWEN2_5[size]["hidden_size"] and config.qkv_bias and not config.o_bias
    assert config.tie_word_embeddings == QWEN2_5[size]["tie_word_embeddings"]
    assert config.layer_types == () and config.rope == RoPE(1_000_000.0)


def test_what_each_family_switches_on():
    llama = config_from_dict(LLAMA_3_2_1B)
    assert llama.rope == RoPE(500_000.0, "llama3", 32.0, 1.0, 4.0, 8192) and llama.tie_word_embeddings
    assert not (llama.qkv_bias or llama.qk_norm or llama.sandwich_norms or llama.norm_unit_offset)
    mistral, newer = config_from_dict(MISTRAL_7B_V0_1), config_from_dict(MISTRAL_7B_V0_3)
    assert mistral.layer_types == (SLIDING,) * 32 and mistral.sliding_window == 4096 and mistral.window(31) == 4096
    assert newer.layer_types == () and newer.sliding_window is None and newer.window(0) is None
    qwen3 = config_from_dict(QWEN3_0_6B)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128 != 1024 // 16
    gemma2 = config_from_dict(GEMMA_2_2B)
    assert gemma2.layer_types[:4] == (SLIDING, FULL, SLIDING, FULL) and gemma2.sliding_window == 4096
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.query_pre_attn_scalar) == (50.0, 30.0, 256)
    assert gemma2.norm_unit_offset and gemma2.sandwich_norms and gemma2.scale_embeddings and not gemma2.qk_norm
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.tie_word_embeddings
    gemma3 = config_from_dict(GEMMA_3_270M)
    assert gemma3.qk_norm and gemma3.attn_logit_softcap is None and gemma3.num_key_value_heads == 1
    assert [i for i, t in enumerate(gemma3.layer_types) if t == FULL] == [5, 11, 17]
    assert gemma3.rope_of(5) == RoPE(1_000_000.0) and gemma3.rope_of(0) == RoPE(10_000.0)
    assert gemma3.window(0) == 512 and gemma3.window(5) is None


def test_what_the_classic_and_newer_families_switch_on():
    gpt2 = config_from_dict(GPT2_SMALL)
    assert (gpt2.positions, gpt2.rope, gpt2.max_position_embeddings, gpt2.intermediate_size) == ("learned", None,
                                                                                                  1024, 3072)
    assert (gpt2.norm, gpt2.gated_mlp, gpt2.hidden_act, gpt2.norm_eps) == ("layer", False, "gelu_new", 1e-5)
    assert gpt2.qkv_bias and gpt2.o_bias and gpt2.mlp_bias and gpt2.tie_word_embeddings and gpt2.head_dim == 64
    pythia = config_from_dict(PYTHIA_160M)
    assert (pythia.rotary_dim, pythia.rope_dim, pythia.rope, pythia.hidden_act) == (16, 16, RoPE(10_000.0), "gelu")
    assert pythia.parallel_residual and not pythia.has_resid_mid and not pythia.tie_word_embeddings
    assert not config_from_dict({**PYTHIA_160M, "use_parallel_residual": False}).parallel_residual
    olmo2 = config_from_dict(OLMO_2_1B)
    assert (olmo2.pre_norms, olmo2.sandwich_norms, olmo2.qk_norm, olmo2.qk_norm_scope) == (False, True, True,
                                                                                           "projection")
    assert not olmo2.has_mlp_norm and olmo2.rope == RoPE(500_000.0)
    phi3 = config_from_dict(PHI_3_MINI_4K)
    assert phi3.window(0) == 2047 and phi3.rotary_dim is None and phi3.gated_mlp
    assert config_from_dict({**PHI_3_MINI_4K, "partial_rotary_factor": 0.75}).rotary_dim == 72
    assert config_from_dict(SMOLLM2_135M).kv_groups == 3 and config_from_dict(TINYLLAMA_1_1B).kv_groups == 8


def test_olmo_3_windows_three_layers_of_four_and_smollm3_leaves_rope_out_of_every_fourth():
    # The hub's layout: rope_scaling is the full layers' alone, as Olmo3Config reads it.
    hub = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "num_hidden_layers": 8,
           "rope_theta": 500_000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    olmo3 = config_from_dict(hub)
    assert olmo3.layer_types == (SLIDING, SLIDING, SLIDING, FULL) * 2 and olmo3.window(0) == 4096
    assert olmo3.rope == RoPE(500_000.0, "linear", 2.0) and olmo3.sliding_rope == RoPE(500_000.0)
    assert (olmo3.pre_norms, olmo3.sandwich_norms, olmo3.qk_norm_scope) == (False, True, "projection")
    assert config_from_dict(transformers_5_layout(hub)) == olmo3
    smol = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "num_hidden_layers": 8}
    smollm3 = config_from_dict(smol)
    assert smollm3.nope_layers == (3, 7) and smollm3.layer_types == () and smollm3.rope == RoPE(2_000_000.0)
    assert [smollm3.rope_of(i) is None for i in range(8)] == [False, False, False, True] * 2
    assert config_from_dict({**smol, "no_rope_layers": [1, 0] * 4}).nope_layers == (1, 3, 5, 7)
    windowed = config_from_dict({**smol, "use_sliding_window": True, "sliding_window": 32})
    assert windowed.layer_types == (FULL, FULL, FULL, SLIDING) * 2  # transformers' rule: the NoPE layers
    assert config_from_dict(transformers_5_layout({**smol, "use_sliding_window": True, "sliding_window": 32})) \
        == windowed


def test_the_text_model_of_a_multimodal_gemma_3_takes_gemma3_text_defaults():
    config = config_from_dict(GEMMA_3_4B)
    assert config.model_type == "gemma3" and config.num_hidden_layers == 34 and config.hidden_size == 2560
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert config.vocab_size == 262_208 and config.tie_word_embeddings and config.sliding_window == 1024
    assert config.rope == RoPE(1_000_000.0, "linear", 8.0) and config.sliding_rope == RoPE(10_000.0)
    assert [i for i, t in enumerate(config.layer_types) if t == FULL] == [5, 11, 17, 23, 29]


def test_olmo_hybrid_7bs_shape_places_its_norms_by_block_kind():
    """Olmo-Hybrid-7B's defaults: DeltaNet on three blocks of four, keys of 0.75 x 3840 / 30 = 96,
    values twice that, beta x 2; its DeltaNet blocks pre-norm, its attention blocks OLMo 2's."""
    config = config_from_dict({"architectures": ["OlmoHybridForCausalLM"], "model_type": "olmo_hybrid"})
    assert config.attention_layers == tuple(range(3, 32, 4)) and len(config.deltanet.layers) == 24
    d = config.deltanet
    assert (d.num_key_heads, d.key_head_dim, d.value_head_dim, d.beta_scale, d.norm_eps) == (30, 96, 192, 2.0, 1e-5)
    assert (config.pre_norms, config.sandwich_norms, config.qk_norm_scope) == (False, True, "projection")
    assert (config.layer_config(0).pre_norms, config.layer_config(0).sandwich_norms) == (True, False)
    assert config.layer_config(3) == config  # an attention block: the model's placement
    kept = config_from_dict({"architectures": ["OlmoHybridForCausalLM"], "model_type": "olmo_hybrid",
                             "linear_allow_neg_eigval": False, "num_hidden_layers": 3})
    assert kept.deltanet.beta_scale == 1.0 and kept.attention_layers == (2,)  # no fourth block: the last


@pytest.mark.parametrize("model_type, architecture", [
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"), ("gemma2", "Gemma2ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
    ("gemma3", "Gemma3ForConditionalGeneration"), ("gpt2", "GPT2LMHeadModel"), ("gpt_neox", "GPTNeoXForCausalLM"),
    ("olmo2", "Olmo2ForCausalLM"), ("phi3", "Phi3ForCausalLM"), ("olmo3", "Olmo3ForCausalLM"),
    ("smollm3", "SmolLM3ForCausalLM"), ("qwen3_5_text", "Qwen3_5ForCausalLM"), ("gemma4_text", "Gemma4ForCausalLM"),
    ("olmo_hybrid", "OlmoHybridForCausalLM")])
def test_left_out_keys_read_as_transformers_defaults(model_type, architecture):
    """A config.json that gives almost nothing: every default is transformers' own."""
    minimal = {"architectures": [architecture], "model_type": model_type, "num_hidden_layers": 2}
    if model_type == "gemma3":
        minimal = {**minimal, "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2}}
    assert config_from_dict(transformers_5_layout(minimal)) == config_from_dict(minimal)


# A Gemma 4 multimodal config.json in the hub's keys, of E2B's text shape (35 blocks of 1536, 4 sliding
# to 1 full, the last 20 sharing keys and values with double-wide MLPs, per-layer embeddings of 256).
GEMMA_4_E2B_SHAPE = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": {
    "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 256,
    "final_logit_softcapping": 30.0, "sliding_window": 512,
    "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}}}}


def test_gemma_4_reads_the_same_from_the_hubs_keys_and_transformers_5s():
    config = config_from_dict(GEMMA_4_E2B_SHAPE)
    assert config_from_dict(transformers_5_layout(GEMMA_4_E2B_SHAPE)) == config
    assert [config.layer_config(i).head_dim for i in (3, 4)] == [256, 512] and config.per_layer_input_size == 256
    from transformers import Gemma4TextConfig
    modes = Gemma4TextConfig(**GEMMA_4_E2B_SHAPE["text_config"]).kv_sharing_modes  # transformers' own reading
    sources = [config.kv_source(i) for i in range(35)]
    assert [i for i, mode in enumerate(modes) if mode == "reuse"] == [i for i, s in enumerate(sources) if s is not None]
    assert {i for i, mode in enumerate(modes) if mode == "store"} == set(sources) - {None} == {13, 14}
    assert config.layer_config(14).intermediate_size == 6144 and config.layer_config(15).intermediate_size == 12288


def test_a_per_layer_config_restating_every_layer_reads_as_the_one_naming_the_full_layers():
    """transformers can write every layer's entry, the sliding ones restating the model's shape."""
    written = transformers_5_layout(GEMMA_4_E2B_SHAPE)
    text = written["text_config"]
    every = {str(i): {"head_dim": 512 if kind == FULL else 256, "num_key_value_heads": 1}
             for i, kind in enumerate(text["layer_types"])}
    restated = {**written, "text_config": {**text, "per_layer_config": every}}
    assert config_from_dict(restated) == config_from_dict(GEMMA_4_E2B_SHAPE)


def test_gemma_4s_experts_read_under_either_name_of_their_width():
    """26B-A4B's shape; the first Gemma 4 config.json files named the experts' width
    expert_intermediate_size, transformers now moe_intermediate_size."""
    text = {**GEMMA_4_E2B_SHAPE["text_config"], "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
            "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8}
    ours = config_from_dict({**GEMMA_4_E2B_SHAPE, "text_config": {**text, "moe_intermediate_size": 704}})
    first = config_from_dict({**GEMMA_4_E2B_SHAPE, "text_config": {**text, "expert_intermediate_size": 704}})
    assert ours == first and ours.moe.expert_size == 704 and ours.moe.beside_dense and ours.moe.top_k == 8


@pytest.mark.parametrize("raw, message", [
    ({**LLAMA_3_2_1B, "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25}},
     "llama config.json: rope_scaling.rope_type = 'proportional' is not supported"),
    ({**LLAMA_3_2_1B, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     "llama config.json: rope_scaling.rope_type = 'longrope' is not supported: the implemented RoPE types are "
     "default, linear, llama3"),
    ({**LLAMA_3_2_1B, "rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_parameters.rope_type = 'dynamic' is not supported"),
    ({**GEMMA_3_270M, "rope_scaling": None, "rope_parameters": {
        FULL: {"rope_type": "longrope", "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
     "gemma3 config.json: rope_parameters.full_attention.rope_type = 'longrope' is not supported"),
    ({**LLAMA_3_2_1B, "partial_rotary_factor": 0.5}, "rope_scaling.partial_rotary_factor = 0.5 is not supported"),
    ({**QWEN2_5["0.5B"], "use_sliding_window": True}, "qwen2 config.json: use_sliding_window = True is not supported"),
    ({**QWEN3_0_6B, "layer_types": [SLIDING] * 28}, "qwen3 config.json: layer_types = 'sliding_attention' is not"),
    ({**MISTRAL_7B_V0_1, "layer_types": [SLIDING] * 32}, "mistral config.json: layer_types = "),
    ({**GEMMA_2_2B, "use_bidirectional_attention": True}, "gemma2 config.json: use_bidirectional_attention = True"),
    ({**GEMMA_2_2B, "sliding_window": None}, "sliding_window = None is not supported: layer_types has"),
    ({**GEMMA_3_270M, "layer_types": ["chunked_attention"] * 18}, "layer_types = 'chunked_attention'"),
    ({**GEMMA_3_270M, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     "gemma3 config.json: rope_parameters = .* Gemma 3 gives one per layer type"),
    ({**LLAMA_3_2_1B, "hidden_act": "relu"}, "llama config.json: hidden_act = 'relu' is not supported"),
    ({**LLAMA_3_2_1B, "quantization_config": {"quant_method": "gptq"}}, "quantization_config \\(gptq\\)"),
    ({**QWEN2_5["0.5B"], "num_key_value_heads": 3}, "num_key_value_heads = 3 is not supported: "
                                                    "num_attention_heads 14 must be a positive multiple"),
    ({**QWEN2_5["0.5B"], "architectures": ["FalconForCausalLM"], "model_type": "falcon"},
     "unsupported architecture 'FalconForCausalLM' in config.json: supported are LlamaForCausalLM, "),
    ({**GPT2_SMALL, "scale_attn_by_inverse_layer_idx": True}, "gpt2 config.json: scale_attn_by_inverse_layer_idx = "
                                                              "True is not supported"),
    ({**GPT2_SMALL, "reorder_and_upcast_attn": True}, "gpt2 config.json: reorder_and_upcast_attn = True"),
    ({**GPT2_SMALL, "scale_attn_weights": False}, "gpt2 config.json: scale_attn_weights = False"),
    ({**PYTHIA_160M, "rotary_pct": 0.3}, "gpt_neox config.json: rope_scaling.partial_rotary_factor = 0.3 is not "
                                         "supported: it rotates 19 of head_dim 64"),
    ({**PYTHIA_160M, "num_attention_heads": 0}, "gpt_neox config.json: num_key_value_heads = 0 is not supported"),
    ({**PYTHIA_160M, "num_attention_heads": 7}, "gpt_neox config.json: num_attention_heads = 7 is not supported: "
                                                "GPT-NeoX's heads split hidden_size 768 evenly"),
    ({**PYTHIA_160M, "rotary_emb_base": "abc"}, "gpt_neox config.json: rope_scaling.rope_theta = 'abc' is not "
                                                "supported: not a number"),
    ({**GPT2_SMALL, "n_head": 7}, "gpt2 config.json: n_head = 7 is not supported: GPT-2's heads split n_embd 768"),
    ({**PHI_3_MINI_4K, "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "phi3 config.json: rope_scaling.rope_type = 'longrope' is not supported"),
    ({**LLAMA_3_2_1B, "architectures": ["LlamaForSequenceClassification"]},
     "unsupported architecture 'LlamaForSequenceClassification'"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "has no 'text_config'"),
    ({"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "num_hidden_layers": 4,
      "no_rope_layers": [1, 1, 2, 0]}, "smollm3 config.json: no_rope_layers = \\[1, 1, 2, 0\\] is not supported: "
                                       "expected 4 entries of 0 or 1"),
])
def test_unsupported_options_are_one_line_errors_naming_the_key(raw, message):
    with pytest.raises(UserError, match=message):
        config_from_dict(raw)


def test_options_that_do_not_change_the_computation_are_ignored():
    noisy = {**GEMMA_2_2B, "use_cache": False, "torch_dtype": "float32", "cache_implementation": "static",
             "transformers_version": "4.42.0", "attention_dropout": 0.1}
    assert config_from_dict(noisy) == config_from_dict(GEMMA_2_2B)
    # Llama's pretraining_tp splits its matmuls in slices: the same sums (transformers 5 ignores it).
    assert config_from_dict({**LLAMA_3_2_1B, "pretraining_tp": 4}) == config_from_dict(LLAMA_3_2_1B)


def test_the_multimodal_wrapper_decides_the_tying_of_the_head():
    """As transformers reads it: the wrapper's tie_word_embeddings (default true), not the
    text_config's."""
    text = {**GEMMA_3_4B["text_config"], "tie_word_embeddings": False}
    assert config_from_dict({**GEMMA_3_4B, "text_config": text}).tie_word_embeddings
    untied = {**GEMMA_3_4B, "tie_word_embeddings": False}
    assert not config_from_dict(untied).tie_word_embeddings
    for raw in ({**GEMMA_3_4B, "text_config": text}, untied):
        assert config_from_dict(transformers_5_layout(raw)) == config_from_dict(raw)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(UserError, match="no config.json in"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        load_config(tmp_path)
