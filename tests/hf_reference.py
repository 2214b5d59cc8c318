"""The reference: Hugging Face's PyTorch Qwen2 on the same checkpoint, read through forward hooks."""

from __future__ import annotations

import numpy as np


def load_reference(model_dir: str):
    import torch
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_activations(model, sequences: list[list[int]]) -> list[dict[int, np.ndarray]]:
    """Per sequence (run alone, so only real tokens), the output of every decoder block."""
    import torch
    caught: dict[int, np.ndarray] = {}

    def hook(index):
        def record(module, inputs, output):
            tensor = output[0] if isinstance(output, tuple) else output
            caught[index] = tensor[0].detach().float().numpy().copy()  # [S, H]
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        results = []
        for seq in sequences:
            with torch.no_grad():
                model(torch.tensor([seq]))
            results.append(dict(caught))
        return results
    finally:
        for h in handles:
            h.remove()


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def random_sequences(lengths, seed: int = 0, vocab: int = 151643) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]
