"""One stored layer, three names: this project's layer ``L``, the SAELens / TransformerLens hook,
and the Hugging Face ``hidden_states`` entry.

This project's layer ``L`` is the residual stream after decoder block ``L`` (0-based), before the
final norm. TransformerLens names that point ``blocks.L.hook_resid_post`` for every ``L`` (it
applies ``ln_final`` outside the blocks), and SAELens trains on TransformerLens hook names.
Hugging Face's ``output_hidden_states`` holds the embeddings at index 0 and block ``L``'s output
at ``L + 1``, except for the last block: its entry has the final norm applied, so no
``hidden_states`` entry holds the last block's raw output.
"""

from __future__ import annotations

from typing import Any

SAELENS_HOOK_TEMPLATE = "blocks.{layer}.hook_resid_post"


def hook_name(layer: int, template: str = SAELENS_HOOK_TEMPLATE) -> str:
    """The SAELens / TransformerLens hook name of layer ``layer`` (``template`` may override it)."""
    return template.format(layer=layer)


def hf_hidden_states_index(layer: int, num_hidden_layers: int | None) -> int | None:
    """The index of layer ``layer`` in Hugging Face's ``hidden_states``: ``layer + 1``; ``None``
    for the last block (its entry is normed) or when the model's depth is unknown."""
    if num_hidden_layers is None or layer >= num_hidden_layers - 1:
        return None
    return layer + 1


def layer_names(layer: int, num_hidden_layers: int | None,
                template: str = SAELENS_HOOK_TEMPLATE) -> dict[str, Any]:
    """The names of one stored layer, as recorded in an export's metadata."""
    return {"layer": layer, "hook_name": hook_name(layer, template),
            "transformer_lens": hook_name(layer),
            "hf_hidden_states_index": hf_hidden_states_index(layer, num_hidden_layers),
            "meaning": f"output of decoder block {layer} (0-based), before the final norm"}
