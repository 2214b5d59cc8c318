"""The settings of every command that runs the model, declared once with one default each.

``ModelSettings`` says which model and how its numbers are computed (dtype, residual stream,
mesh); ``ModelRunSettings`` adds how batches are run (batch size, attention kernel);
``GenerationSettings`` whether and how each prompt is continued first (``model.generate``);
``ProfileSettings`` which batches are traced; ``SiteSettings`` which activation sites are stored
(``model.sites``). ``runners.tpu_host``'s ``HostConfig`` and
``runners.ablate``'s ``AblationConfig`` extend ``ModelRunSettings`` and ``ProfileSettings``;
the extraction's ``ExtractConfig`` extends ``ModelRunSettings``; ``runners.verify_model``
extends ``ModelSettings``. Each field is a flag (``common.cli.flag``). This module imports no
JAX: flag parsers read it.
"""

from __future__ import annotations

import dataclasses

from common.cli import AUTO, UserError, flag
from model.config import ATTENTION_KINDS, COMPUTE_DTYPES, MESH_TYPES, MOE_DISPATCHES, RESIDUAL_DTYPES
from model.sites import DEFAULT_SITES, SITES, parse_sites


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSettings:
    model_path: str | None = flag(None, "Hugging Face checkpoint directory or hub id")
    model_revision: str | None = flag(None, "the hub revision of --model_path: a branch, tag or commit (Pythia's "
                                      "training checkpoints: step143000); recorded in metadata.json")
    dtype: str = flag(AUTO, "compute and weight dtype: auto (bfloat16 on TPU/GPU, float32 on CPU) | "
                      + " | ".join(COMPUTE_DTYPES), choices=(AUTO, *COMPUTE_DTYPES))
    residual_dtype: str = flag("float32", "the residual stream's dtype: float32 (with bfloat16 compute, the "
                               "stream, the norms and every residual add stay float32 while matmuls take "
                               "bfloat16 operands and accumulate in float32) | compute (the compute dtype, "
                               "every sum rounded to it, as transformers' bfloat16 forward does)",
                               choices=RESIDUAL_DTYPES)
    mesh_type: str = flag("1d", "1d (data parallel) | 2d (data x model)", choices=MESH_TYPES)
    model_axis_size: int | None = flag(None, "with --mesh_type 2d, the model axis's devices: by default gcd(devices "
                                       "per host, kv heads), every device of the host for a mixture of experts; a "
                                       "divisor of a host's devices, or a multiple of them spanning whole hosts "
                                       "(a model too large for one host: docs/model.md#mixtures-of-experts)")

    def validate_mesh(self) -> None:
        if self.model_axis_size is not None and (self.model_axis_size < 1 or self.mesh_type != "2d"):
            raise UserError(f"--model_axis_size {self.model_axis_size}: a positive size, with --mesh_type 2d")

    def model_dir(self) -> str:
        """The local checkpoint directory: ``model_path``, or the hub's snapshot at ``model_revision``."""
        from model.hub import resolve_model_dir
        return resolve_model_dir(self.model_path, self.model_revision)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRunSettings(ModelSettings):
    batch_size: int = flag(8, "sequences per device per forward (global batch = this x data axis)")
    attention: str = flag(AUTO, "attention kernel: auto (tiled on CPU; on GPU cudnn for bfloat16, else fused; "
                          "fused on TPU; tiled for soft-capped attention, Gemma 2) | tiled (per-row tiles with an "
                          "online softmax) | fused (jax.nn.dot_product_attention, XLA's fusion, with causal "
                          "masking, per-row lengths and the sliding window) | cudnn (the same through cuDNN's "
                          "flash attention: GPU, bfloat16)", choices=ATTENTION_KINDS)
    moe_dispatch: str = flag(AUTO, "how a mixture of experts computes its experts: auto (by the expert count: "
                             "dense where experts <= 2 x experts per token) | dense (every expert on every token, "
                             "masked) | grouped (tokens sorted by expert, a grouped matmul: only the routed "
                             "experts' FLOPs); the same numbers in float32 and with the float32 stream "
                             "(docs/model.md#mixtures-of-experts)",
                             choices=MOE_DISPATCHES)

    def validate_batches(self) -> None:
        if self.batch_size < 1:
            raise UserError(f"--batch_size must be at least 1, got {self.batch_size}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiteSettings:
    sites: tuple[str, ...] = flag(DEFAULT_SITES, "activation sites to store at each layer, named as TransformerLens "
                                  f"names them after blocks.L.: {', '.join(SITES)} (default: hook_resid_post, "
                                  "the block output; docs/sites.md)", parse=parse_sites)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    profile_dir: str | None = flag(None, "write a jax.profiler trace (TensorBoard / Perfetto) here")
    profile_batches: int = flag(3, "batches traced with --profile_dir, after the first (compiling) one")

    def validate_profiling(self) -> None:
        if self.profile_batches < 1:
            raise UserError(f"--profile_batches must be at least 1, got {self.profile_batches}")


def stop_strings(text: str) -> tuple[str, ...]:
    """One ``--stop`` word: a string, its Python escapes decoded (``\\n`` is a newline)."""
    import argparse
    import codecs
    try:
        value = codecs.decode(text, "unicode_escape")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"bad escape in {text!r}: {e.reason}") from None
    if not value:
        raise argparse.ArgumentTypeError("an empty stop string would end every continuation at once")
    return (value,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    generate: int | None = flag(None, "continue each prompt with up to N tokens the model writes (on the device, "
                                "batched), then store prompt + continuation; the continuation's tokens have the "
                                "role generated (docs/runner.md#generation)")
    temperature: float = flag(0.0, "with --generate: 0 picks the most likely token (greedy); above 0 samples "
                              "from the softmax of logits / temperature")
    top_p: float = flag(1.0, "with --generate and a temperature: sample among the fewest tokens whose "
                        "probabilities reach top_p (1: all)")
    top_k: int = flag(0, "with --generate and a temperature: sample among the top_k most likely tokens (0: all)")
    seed: int = flag(0, "with --generate and a temperature: the draws of a sample come from this seed and its "
                     "sample id alone (the same in any batch, machine split or resume)")
    stop: tuple[str, ...] = flag((), "with --generate: strings that end a continuation (after the token that "
                                 "completes one; Python escapes: '\\n\\n'), found in its text (needs a tokenizer)",
                                 parse=stop_strings)
    tokenizer: str | None = flag(None, "with --generate: the tokenizer that writes each continuation's text and "
                                 "finds --stop strings (default: the checkpoint's own, where it has one)")

    def sampling(self):
        """The ``model.sampling.Sampling`` of these flags."""
        from model.sampling import Sampling
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed)

    def validate_generation(self, max_seq_length: int) -> None:
        chosen = [f"--{name}" for name, default in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("seed", 0),
                                                    ("stop", ()), ("tokenizer", None))
                  if getattr(self, name) != default]
        if self.generate is None:
            if chosen:
                raise UserError(f"{', '.join(chosen)} choose how --generate writes: pass --generate N")
            return
        if self.generate < 1:
            raise UserError(f"--generate must be at least 1 (new tokens a prompt), got {self.generate}")
        if self.generate >= max_seq_length:
            raise UserError(f"--generate {self.generate} leaves no room for a prompt in --max_seq_length "
                            f"{max_seq_length} (prompt + continuation)")
        problem = self.sampling().problem()
        if problem:
            raise UserError(f"--{problem}")
