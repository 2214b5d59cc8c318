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


def intervention_hooks(model, intervention, means=None) -> list:
    """Applies an intervention (``model.interventions.Intervention``) to the reference with
    PyTorch forward hooks (heads, sublayers, blocks) and weight edits (norms); returns what
    ``undo`` takes to remove it. ``means``: ``model.interventions.Means``, for mode=mean."""
    import torch
    undo = []
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or head_dim
    for atom in intervention.atoms:
        block = model.model.layers[atom.layer]
        mean = atom.mode == "mean"
        if atom.kind == "head":
            def pre(module, args, h=atom.head, layer=atom.layer, mean=mean):
                x = args[0].clone()
                x[..., h * head_dim:(h + 1) * head_dim] = (torch.from_numpy(means.head[layer, h]) if mean else 0)
                return (x, *args[1:])
            undo.append(block.self_attn.o_proj.register_forward_pre_hook(pre))
        elif atom.kind in ("attn", "mlp"):
            def replace(module, args, output, kind=atom.kind, layer=atom.layer, mean=mean):
                first = output[0] if isinstance(output, tuple) else output
                value = (torch.from_numpy(getattr(means, kind)[layer]).expand_as(first).clone() if mean
                         else torch.zeros_like(first))
                return (value, *output[1:]) if isinstance(output, tuple) else value
            undo.append((block.self_attn if atom.kind == "attn" else block.mlp).register_forward_hook(replace))
        elif atom.kind == "layer":
            def skip(module, args, kwargs, output, layer=atom.layer, mean=mean):
                x = args[0] if args else kwargs["hidden_states"]
                value = x + torch.from_numpy(means.block[layer]) if mean else x
                return (value, *output[1:]) if isinstance(output, tuple) else value
            undo.append(block.register_forward_hook(skip, with_kwargs=True))
        elif atom.kind == "norm":
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                saved = norm.weight.detach().clone()
                with torch.no_grad():
                    norm.weight.fill_(float(saved.mean()) if mean else 1.0)
                undo.append((norm, saved))
    return undo


def remove_hooks(undo: list) -> None:
    import torch
    for item in undo:
        if isinstance(item, tuple):
            norm, saved = item
            with torch.no_grad():
                norm.weight.copy_(saved)
        else:
            item.remove()


def reference_means(model, sequences) -> dict[str, np.ndarray]:
    """Per block, the mean over every token of ``sequences`` (each run alone) of each head's
    output, the attention and MLP outputs and the block's contribution."""
    import torch
    sums: dict = {}

    def add(name, layer, value):
        value = value.detach().double().reshape(-1, *value.shape[2:]).sum(0).numpy()
        sums.setdefault(name, {})[layer] = sums.get(name, {}).get(layer, 0) + value

    handles = []
    for i, block in enumerate(model.model.layers):
        n = model.config.num_attention_heads
        handles.append(block.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, i=i: add("head", i, a[0].reshape(*a[0].shape[:2], n, -1))))
        handles.append(block.self_attn.register_forward_hook(lambda m, a, o, i=i: add("attn", i, o[0])))
        handles.append(block.mlp.register_forward_hook(lambda m, a, o, i=i: add("mlp", i, o)))
        handles.append(block.register_forward_hook(
            lambda m, a, k, o, i=i: add("block", i, (o[0] if isinstance(o, tuple) else o)
                                         - (a[0] if a else k["hidden_states"])), with_kwargs=True))
    try:
        tokens = 0
        for seq in sequences:
            with torch.no_grad():
                model(torch.tensor([seq]))
            tokens += len(seq)
    finally:
        for h in handles:
            h.remove()
    return {name: np.stack([per[i] for i in sorted(per)]) / tokens for name, per in sums.items()}
