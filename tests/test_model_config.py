import json

import pytest

from common.cli import UserError
from model.config import config_from_dict, load_config

# The published config.json of the Qwen2.5 base models (fields that matter here).
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


@pytest.mark.parametrize("size, head_dim, groups", [("0.5B", 64, 7), ("1.5B", 128, 6), ("7B", 128, 7)])
def test_qwen2_5_configs_load(tmp_path, size, head_dim, groups):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5[size]))
    config = load_config(tmp_path)
    assert (config.head_dim, config.kv_groups) == (head_dim, groups)
    assert config.hidden_size == QWEN2_5[size]["hidden_size"]
    assert config.tie_word_embeddings == QWEN2_5[size]["tie_word_embeddings"]


def test_transformers_5_rope_parameters_and_explicit_head_dim():
    raw = {**QWEN2_5["0.5B"], "rope_parameters": {"rope_theta": 5.0, "rope_type": "default"},
           "head_dim": 32}
    del raw["rope_theta"]
    config = config_from_dict(raw)
    assert (config.rope_theta, config.head_dim) == (5.0, 32)


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True}, "sliding-window attention"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
])
def test_unsupported_options_are_errors(change, message):
    with pytest.raises(UserError, match=message):
        config_from_dict({**QWEN2_5["0.5B"], **change})


def test_missing_field_and_missing_file(tmp_path):
    raw = dict(QWEN2_5["0.5B"])
    del raw["hidden_size"]
    with pytest.raises(UserError, match="config.json has no 'hidden_size'"):
        config_from_dict(raw)
    with pytest.raises(UserError, match="no config.json in"):
        load_config(tmp_path)
