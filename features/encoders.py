"""Features over stored rows: what a trained dictionary, a probe's directions or raw dimensions of
a site make of each token's activations.

A ``FeatureSet`` reads one stored array key (a layer, or a site's hook name: ``model.sites``) and
encodes its rows [n, d] into feature activations [n, F] (``encode``, JAX: on the device where
there is one), with each feature's decoder direction [F, d_out] (what it writes: the residual
stream's space for an SAE of a stream site, the target's for a transcoder), whose logit effects a
dashboard shows. Three sources, named as ``runners.dashboard --features`` names them:

- a SAELens SAE or transcoder directory (``cfg.json`` + ``sae_weights.safetensors``), of the
  architectures ``standard`` (ReLU), ``jumprelu`` and ``topk``, encoded as SAELens' ``encode``
  does: ``(x - b_dec) @ W_enc + b_enc`` (the ``b_dec`` term where ``apply_b_dec_to_input``), then
  the activation (a transcoder, skip or not: ReLU or JumpReLU, its decoder writing its target;
  the skip path is no feature's); anything else (another architecture, activation normalisation)
  refused in one line;
- a cross-layer transcoder directory (circuit-tracer's ``W_enc_{i}`` / ``W_dec_{i}`` files and
  the job's ``clt_sites.json``, ``dictionaries.circuit_tracer_format``): the latents of the layer
  whose input site is the key, each decoder direction its writes into every later layer summed
  (what it adds to the residual stream in all);
- a directions file (``activations.directions``, ``runners.probe``'s): each direction a feature,
  its activation the row's projection on it (signed);
- ``neurons:SITE:LAYER[:DIMS]``: the site's raw dimensions (all, or ``DIMS``: ``0-15,40``), of any
  site of fixed width (``mlp.hook_pre``, ``attn.hook_q``, ...; a pattern site's refused in one line).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from activations.directions import read_directions
from activations.token_plan import check_fixed_width
from common.cli import UserError
from common.files import join, read_optional
from dictionaries.circuit_tracer_format import CLT_SITES_FILE
from model.sites import ArrayKey, array_key, hook_name, key_parts, normalized_key, parse_sites

ACTIVATIONS = ("relu", "jumprelu", "topk", "linear")  # how pre-activations become feature activations
# SAELens cfg.json's architectures -> their activation (a transcoder's decoder writes into its target)
SAE_ARCHITECTURES = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk", "transcoder": "relu",
                     "skip_transcoder": "relu", "jumprelu_transcoder": "jumprelu",
                     "jumprelu_skip_transcoder": "jumprelu"}
SAE_CONFIG, SAE_WEIGHTS = "cfg.json", "sae_weights.safetensors"  # SAELens' file names


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureSet:
    """Features read from one stored key: ``activation(rows - input_bias) @ encoder + encoder_bias``."""
    name: str                   # what they are, for messages and outputs
    key: ArrayKey               # the stored array whose rows they read
    encoder: np.ndarray         # [d, F] float32
    encoder_bias: np.ndarray    # [F]
    input_bias: np.ndarray      # [d]: subtracted from each row first (SAELens' b_dec, where applied)
    decoder: np.ndarray         # [F, d_out]: each feature's direction in what it writes
    activation: str = "relu"    # ACTIVATIONS
    threshold: np.ndarray | None = None  # [F], jumprelu: a feature fires above its threshold
    k: int | None = None        # topk: the k largest pre-activations of a row fire (ReLU'd)
    decoder_scaled: bool = False  # topk: pre-activations times their decoder row's norm first
    output_key: ArrayKey | None = None  # where the decoder writes (a transcoder's target); None: ``key``
    indices: np.ndarray | None = None  # [F] int64: each feature's number (a neuron's dimension); None: 0..F-1
    names: tuple[str, ...] | None = None  # each feature's name, where it has one (a direction's)

    @property
    def size(self) -> int:
        return self.encoder.shape[1]

    @property
    def numbers(self) -> np.ndarray:
        """[F] int64: each feature's number, as outputs name it."""
        return np.arange(self.size, dtype=np.int64) if self.indices is None else self.indices

    def subset(self, columns: Sequence[int]) -> "FeatureSet":
        """Only the features at ``columns`` (positions in this set). A TopK SAE's features compete
        for its k slots, so it keeps them all: ``encode`` then gives every feature (see ``columns_kept``)."""
        columns = np.asarray(columns, np.int64)
        if self.activation == "topk":
            return self
        return dataclasses.replace(
            self, encoder=self.encoder[:, columns], encoder_bias=self.encoder_bias[columns],
            decoder=self.decoder[columns], threshold=None if self.threshold is None else self.threshold[columns],
            indices=self.numbers[columns], names=None if self.names is None else tuple(self.names[c] for c in columns))

    def encode(self, rows: Any) -> jax.Array:
        """Feature activations [n, F] float32 of stored rows [n, d] (any float dtype)."""
        return _encoder(self)(jnp.asarray(rows, jnp.float32))


@functools.lru_cache(maxsize=16)
def _encoder(features: FeatureSet):
    """One jitted encoding per feature set (its weights are constants of the program's arguments)."""
    weights = {"encoder": jnp.asarray(features.encoder), "encoder_bias": jnp.asarray(features.encoder_bias),
               "input_bias": jnp.asarray(features.input_bias)}
    if features.threshold is not None:
        weights["threshold"] = jnp.asarray(features.threshold)
    if features.decoder_scaled:
        weights["decoder_norm"] = jnp.linalg.norm(jnp.asarray(features.decoder), axis=-1)

    def encode(w, rows):
        hidden = (rows - w["input_bias"]) @ w["encoder"] + w["encoder_bias"]  # [n, F]
        if features.activation == "linear":
            return hidden
        if features.activation == "jumprelu":
            return jnp.where(hidden > w["threshold"], jax.nn.relu(hidden), 0.0)
        if features.activation == "topk":
            if features.decoder_scaled:
                hidden = hidden * w["decoder_norm"]
            values, chosen = jax.lax.top_k(hidden, features.k)  # [n, k] each
            rows_of = jnp.arange(hidden.shape[0])[:, None]
            return jnp.zeros_like(hidden).at[rows_of, chosen].set(jax.nn.relu(values))
        return jax.nn.relu(hidden)

    program = jax.jit(encode)
    return functools.partial(program, weights)


def load_features(spec: str, key: ArrayKey | None = None, width: int | None = None) -> FeatureSet:
    """The features ``spec`` names: a SAELens SAE / transcoder directory, a directions file
    (``.npz``) or ``neurons:SITE:LAYER[:DIMS]`` (of a site ``width`` wide, as the store holds it).
    ``key``: the stored array an SAE reads, where its ``cfg.json`` names no hook (``metadata.hook_name``)."""
    if spec.startswith("neurons:"):
        if width is None:
            raise ValueError("neurons: features need the stored site's width")
        return neuron_features(spec, width)
    if spec.endswith(".npz"):
        return direction_features(spec, key)
    if spec.startswith("gs://") or os.path.isdir(spec):
        if read_optional(join(spec, CLT_SITES_FILE)) is not None:
            return clt_features(spec, key)
        return sae_features(spec, key)
    raise UserError(f"--features {spec!r}: not a SAELens SAE directory, a directions file (.npz) or "
                    "neurons:SITE:LAYER[:DIMS]")


def sae_features(directory: str, key: ArrayKey | None = None) -> FeatureSet:
    """A SAELens SAE or transcoder saved by ``save_model`` (``cfg.json``, ``sae_weights.safetensors``)."""
    from safetensors.numpy import load
    files = {name: read_optional(join(directory, name)) for name in (SAE_CONFIG, SAE_WEIGHTS)}
    missing = [name for name, data in files.items() if data is None]
    if missing:
        raise UserError(f"{directory!r} is not a SAELens SAE directory: it has no {missing[0]}")
    try:
        cfg, weights = json.loads(files[SAE_CONFIG]), load(files[SAE_WEIGHTS])
    except Exception as e:  # a JSON or safetensors error: the files are not what SAELens writes
        raise UserError(f"{directory!r} is not a SAELens SAE directory ({SAE_CONFIG} and {SAE_WEIGHTS}): "
                        f"{str(e).splitlines()[0]}") from None
    architecture = cfg.get("architecture")
    if architecture not in SAE_ARCHITECTURES:
        raise UserError(f"{directory!r}: a {architecture!r} SAE; this reads {', '.join(SAE_ARCHITECTURES)}")
    if cfg.get("normalize_activations", "none") != "none":
        raise UserError(f"{directory!r} normalizes its input ({cfg['normalize_activations']}): fold the "
                        "normalization into its weights first (SAELens: fold_activation_norm_scaling_factor)")
    metadata = cfg.get("metadata") or {}
    key = _sae_key(directory, metadata.get("hook_name"), key)
    output = metadata.get("hook_name_out")
    as_float = {name: np.asarray(value, np.float32) for name, value in weights.items()}
    bias = as_float["b_dec"] if cfg.get("apply_b_dec_to_input", True) else np.zeros(cfg["d_in"], np.float32)
    return FeatureSet(
        name=os.path.basename(os.path.normpath(directory)), key=key, encoder=as_float["W_enc"],
        encoder_bias=as_float["b_enc"], input_bias=bias, decoder=as_float["W_dec"],
        activation=SAE_ARCHITECTURES[architecture], threshold=as_float.get("threshold"), k=cfg.get("k"),
        decoder_scaled=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        output_key=normalized_key(output) if output else None)


def clt_features(directory: str, key: ArrayKey | None) -> FeatureSet:
    """The latents of one layer of a cross-layer transcoder the training job wrote: the layer whose
    input site is ``key`` (``clt_sites.json`` names each layer's input and output site)."""
    from safetensors.numpy import load
    sites = json.loads(read_optional(join(directory, CLT_SITES_FILE)))
    inputs = [normalized_key(hook) for hook in sites["input_hooks"]]
    if key is None or normalized_key(key) not in inputs:
        raise UserError(f"{directory!r} is a cross-layer transcoder reading {', '.join(sites['input_hooks'])}: "
                        f"name the layer's input site to show (--key){'' if key is None else f', not {key}'}")
    i = inputs.index(normalized_key(key))
    files = {name: read_optional(join(directory, f"{name}_{i}.safetensors")) for name in ("W_enc", "W_dec")}
    if None in files.values():
        raise UserError(f"{directory!r} lacks {'W_enc' if files['W_enc'] is None else 'W_dec'}_{i}.safetensors")
    weights = {k: np.asarray(v, np.float32) for data in files.values() for k, v in load(data).items()}
    threshold = weights.get(f"threshold_{i}")
    return FeatureSet(
        name=f"{os.path.basename(os.path.normpath(directory))}/{i}", key=inputs[i],
        encoder=weights[f"W_enc_{i}"].T, encoder_bias=weights[f"b_enc_{i}"],
        input_bias=np.zeros(weights[f"W_enc_{i}"].shape[1], np.float32),
        decoder=weights[f"W_dec_{i}"].sum(axis=1),  # [d_sae, d_out]: every later layer's write, summed
        activation="relu" if threshold is None else "jumprelu", threshold=threshold,
        output_key=normalized_key(sites["output_hooks"][i]))


def _sae_key(directory: str, hook: str | None, key: ArrayKey | None) -> ArrayKey:
    """The stored key an SAE reads: its hook, or the one given (they must agree where both are)."""
    if hook is None and key is None:
        raise UserError(f"{directory!r} names no hook (cfg.json metadata.hook_name): pass the stored layer or hook "
                        "name it reads")
    found = normalized_key(hook) if hook else None
    if key is not None and found is not None and normalized_key(key) != found:
        raise UserError(f"{directory!r} reads {hook}, not {key}")
    return found if found is not None else normalized_key(key)


def direction_features(path: str, key: ArrayKey | None = None) -> FeatureSet:
    """Each direction of a directions file (``activations.directions``) at one key as a feature:
    the row's projection on it (``key``: which, where the file holds several keys)."""
    arrays, _ = read_directions(path)
    keys = sorted({name.split("/", 1)[1] for name in arrays})
    if key is None and len(keys) != 1:
        raise UserError(f"{path!r} holds directions at {', '.join(keys)}: name the one to read")
    wanted = hook_name(*key_parts(normalized_key(key))) if key is not None else keys[0]
    names = [name for name in arrays if name.split("/", 1)[1] == wanted]
    if not names:
        raise UserError(f"{path!r} holds no direction at {wanted} (it has {', '.join(keys)})")
    vectors = np.stack([arrays[name] for name in names]).astype(np.float32)  # [F, d]
    width = vectors.shape[1]
    return FeatureSet(name=os.path.basename(path), key=normalized_key(wanted), encoder=vectors.T.copy(),
                      encoder_bias=np.zeros(len(names), np.float32), input_bias=np.zeros(width, np.float32),
                      decoder=vectors, activation="linear", names=tuple(names))


def parse_neurons(spec: str) -> tuple[ArrayKey, list[int] | None]:
    """``neurons:SITE:LAYER[:DIMS]`` -> (its key, its dimensions or None for all); DIMS like ``0-15,40``;
    ``UserError`` for a pattern site (its rows' width is the sample's heads x tokens)."""
    parts = spec.split(":")
    if parts[0] != "neurons" or len(parts) not in (3, 4):
        raise UserError(f"{spec!r}: neurons are named neurons:SITE:LAYER[:DIMS], e.g. neurons:hook_mlp_out:12:0-99")
    site = parse_sites([parts[1]])[0]
    check_fixed_width(spec, site)  # a pattern's rows differ in width by sample: no fixed dimensions
    try:
        layer = int(parts[2])
        dims = None if len(parts) == 3 else spans(parts[3])
    except ValueError:
        raise UserError(f"{spec!r}: LAYER is a number and DIMS numbers or ranges (0-15,40)") from None
    return array_key(site, layer), dims


def spans(text: str) -> list[int]:
    """``0-15,40`` -> [0, ..., 15, 40] (ValueError if not numbers and ranges)."""
    out = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if int(last or first) < int(first):
            raise ValueError(f"a descending range {part}")
        out.extend(range(int(first), int(last or first) + 1))
    if not out:
        raise ValueError("no indices")
    return out


def neuron_features(spec: str, width: int) -> FeatureSet:
    """The raw dimensions ``neurons:SITE:LAYER[:DIMS]`` names of a site ``width`` wide: each
    dimension's value is its activation, its direction the unit vector along it."""
    key, dims = parse_neurons(spec)
    dims = list(range(width)) if dims is None else dims
    bad = [d for d in dims if not 0 <= d < width]
    if bad:
        raise UserError(f"{spec!r}: dimension {bad[0]} is past the site's width ({width})")
    unit = np.eye(width, dtype=np.float32)[dims]  # [F, width]
    return FeatureSet(name=spec, key=key, encoder=unit.T.copy(), encoder_bias=np.zeros(len(dims), np.float32),
                      input_bias=np.zeros(width, np.float32), decoder=unit, activation="linear",
                      indices=np.asarray(dims, np.int64))


ARRAYS = ("encoder", "encoder_bias", "input_bias", "decoder", "threshold", "indices")


def features_bytes(features: FeatureSet) -> bytes:
    """``features`` as one .npz (its arrays, and its other fields as JSON): what a launcher hands
    workers that cannot read its paths (a Dataflow job's)."""
    import io
    arrays = {name: getattr(features, name) for name in ARRAYS if getattr(features, name) is not None}
    fields = {f.name: getattr(features, f.name) for f in dataclasses.fields(features) if f.name not in ARRAYS}
    fields["names"] = list(features.names) if features.names is not None else None
    data = io.BytesIO()
    np.savez(data, fields=np.array(json.dumps(fields)), **arrays)
    return data.getvalue()


def features_from_bytes(data: bytes) -> FeatureSet:
    """The inverse of ``features_bytes``."""
    import io
    with np.load(io.BytesIO(data)) as npz:
        fields = json.loads(str(npz["fields"]))
        arrays = {name: npz[name] for name in ARRAYS if name in npz.files}
    if fields.get("names") is not None:
        fields["names"] = tuple(fields["names"])
    return FeatureSet(**fields, **arrays)
