"""The verification report command, and its one-line errors."""

import json
import os
import shutil

import pytest

from tests.conftest import run_cli, run_in_process

pytestmark = pytest.mark.slow


def test_report_has_continuations_and_layer_statistics(tiny_checkpoints, qwen_tokenizer_dir, tmp_path):
    out = tmp_path / "model_generation_verification.txt"
    result = run_cli("runners.verify_model", "--model_path", tiny_checkpoints["gqa_tied"],
                     "--tokenizer", qwen_tokenizer_dir, "--num_prompts", "2", "--max_new_tokens", "5",
                     "--max_seq_length", "1024", "--layers_to_extract", "1,3", "--dtype", "bfloat16",
                     "--sites", "hook_resid_post,attn.hook_z", "--output", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "NaN/Inf in activations: none" in text
    assert "dtype: bfloat16   residual stream: float32" in text and "--- dtypes used where ---" in text
    assert text.count("=== ") == 2 and text.count("--- greedy continuation (5 tokens") == 2
    table = text.split("--- activation statistics per layer")[1].splitlines()[3:]
    assert [row.split()[0] for row in table] == ["blocks.1.attn.hook_z", "1", "blocks.3.attn.hook_z", "3"]
    # Random weights have no outsized first token (the real models' have: tests/test_real_*.py).
    assert all(float(row.split()[-1]) < 3 for row in table), table


@pytest.mark.parametrize("problem", ["layer 40", "missing file", "architecture", "not a dir", "steering"])
def test_user_errors_are_one_line(tiny_checkpoints, qwen_tokenizer_dir, tmp_path, problem):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["gqa_tied"], model)
    args = ["--model_path", str(model), "--tokenizer", qwen_tokenizer_dir,
            "--output", str(tmp_path / "r.txt")]
    if problem == "layer 40":
        args += ["--layers_to_extract", "2,40"]
        expected = "layer 40 does not exist: the model has 4 layers (0..3)"
    elif problem == "missing file":
        os.remove(model / "model.safetensors")
        expected = "checkpoint file 'model.safetensors' is missing"
    elif problem == "architecture":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"],
                                                       "model_type": "falcon"}))
        expected = "unsupported architecture 'FalconForCausalLM'"
    elif problem == "steering":
        args += ["--ablate", f"steer:1:{tmp_path}/none.npz:alpha=4"]
        expected = "no directions file at"
    else:
        args[1] = str(tmp_path / "nothing_here")
        expected = "is not a checkpoint directory"
    result = run_in_process("runners.verify_model", *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2
    assert lines[-1].startswith("runners.verify_model: error:") and expected in lines[-1], lines
    assert not any("Traceback" in line for line in lines)
    assert not (tmp_path / "r.txt").exists()


def test_a_gemma_model_with_its_own_chat_conventions(family_checkpoints, tmp_path):
    """Gemma 3's text model (inside a multimodal checkpoint) and a Gemma-style tokenizer (BOS
    rendered by the template, no system role): prompts past the window of 16, stopped at the
    model's end-of-turn token as its config lists it."""
    from fixtures.family_tokenizers import build_family_tokenizer
    model = tmp_path / "model"
    shutil.copytree(family_checkpoints["gemma3_multimodal", "transformers5"], model)
    tokenizer = build_family_tokenizer("gemma2", tmp_path / "tokenizer")
    from transformers import AutoTokenizer
    end_of_turn = AutoTokenizer.from_pretrained(str(tokenizer)).convert_tokens_to_ids("<end_of_turn>")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, end_of_turn]}))
    out = tmp_path / "report.txt"
    from model.generate import stop_token_ids
    from runners.verify_model import main
    assert main(["--model_path", str(model), "--tokenizer", str(tokenizer), "--num_prompts", "1",
                 "--max_new_tokens", "6", "--max_seq_length", "2048", "--dtype", "float32",
                 "--output", str(out)]) == 0
    text = out.read_text()
    assert "NaN/Inf in activations: none" in text and "--- greedy continuation (" in text
    prompt_tokens = int(text.split("prompt tokens ")[1].split()[0])
    assert prompt_tokens > 16
    assert end_of_turn in stop_token_ids(str(model), AutoTokenizer.from_pretrained(str(tokenizer)))
