"""One stored array, its names: this project's key (layer ``L`` for block outputs, else the hook
name: ``model.sites``), the SAELens / TransformerLens hook, the export's column, and for block
outputs the Hugging Face ``hidden_states`` entry.

This project's layer ``L`` is the residual stream after decoder block ``L`` (0-based), before the
final norm. TransformerLens names that point ``blocks.L.hook_resid_post`` for every ``L`` (it
applies ``ln_final`` outside the blocks), and SAELens trains on TransformerLens hook names; every
other site is named as TransformerLens names its hook (``blocks.L.hook_mlp_out``). Hugging Face's
``output_hidden_states`` holds the embeddings at index 0 and block ``L``'s output at ``L + 1``,
except for the last block: its entry has the final norm applied, so no ``hidden_states`` entry
holds the last block's raw output.
"""

from __future__ import annotations

from typing import Any

from model import sites
from model.sites import ArrayKey, key_parts

# Gives every site its TransformerLens hook name (for block outputs, the names exports always had).
SAELENS_HOOK_TEMPLATE = sites.HOOK_TEMPLATE


def column_name(key: ArrayKey, template: str = SAELENS_HOOK_TEMPLATE) -> str:
    """The export's column of ``key``: ``template`` with ``{layer}`` and ``{site}`` filled in (a
    model-level site's: its name)."""
    site, layer = key_parts(key)
    return site if site in sites.MODEL_SITES else template.format(layer=layer, site=site)


def hf_hidden_states_index(layer: int, num_hidden_layers: int | None) -> int | None:
    """The index of layer ``layer`` in Hugging Face's ``hidden_states``: ``layer + 1``; ``None``
    for the last block (its entry is normed) or when the model's depth is unknown."""
    if num_hidden_layers is None or layer >= num_hidden_layers - 1:
        return None
    return layer + 1


def layer_names(key: ArrayKey, num_hidden_layers: int | None, width: int,
                template: str = SAELENS_HOOK_TEMPLATE) -> dict[str, Any]:
    """The names of one stored array, as recorded per column in an export's metadata."""
    site, layer = key_parts(key)
    names = {"layer": layer, "site": site, "hook_name": column_name(key, template),
             "transformer_lens": sites.hook_name(site, layer), "width": width}
    if site != sites.RESID_POST:
        return {**names, "meaning": sites.SITES[site].meaning}
    return {**names, "hf_hidden_states_index": hf_hidden_states_index(layer, num_hidden_layers),
            "meaning": f"output of decoder block {layer} (0-based), before the final norm"}
