"""Stream records in, one record per sample with its activations out, in input order: the
framework-neutral core of ``ExtractActivations`` (``transforms/extract.py`` wraps it in a Beam DoFn;
the host runner drives it directly, without importing Beam).

``OrderedExtraction`` loads the model once (``setup``), collects up to ``window`` records, runs them
through the bucketed, sharded forward and emits the results **in input order**, so that a consumer
(the host runner) can cut shards that each hold a contiguous run of the stream. Records longer than
``max_seq_length`` follow ``long_samples`` (``transforms/long_samples.py``); a skipped one is
emitted in its place as ``Tagged(REJECTED, its rejection)``. With a token selection (``tokens``,
``activations.selection``), each record's selected positions are worked out from its roles and
only those rows (or their mean) come back from the devices. With ``statistics``, each record
also carries its arrays' statistics, measured on the devices (``model.statistics``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator, Sequence

import numpy as np

from activations.selection import Selection, parse_selection
from common.roles import missing_roles, role_codes
from model.hub import resolve_model_dir
from interventions.resolve import ablation_for, ablation_source, steered_positions, steers_written_tokens
from model.settings import GenerationSettings, ModelRunSettings, SiteSettings
from model.statistics import StatisticsSpec
from transforms.generation import Continuing, generation_tokenizer, thinking_ids
from transforms.long_samples import fit_record, rejection

log = logging.getLogger(__name__)

REJECTED = "rejected"  # the tag of records that were not computed
# The tag of records another process of a multi-host machine computed and stores:
# ``{"sample_id": ...}``, so that each process still sees every stream position.
ELSEWHERE = "elsewhere"


@dataclasses.dataclass(frozen=True)
class Tagged:
    """An output that is not an activation record: ``tag`` says which (``REJECTED``, ``ELSEWHERE``)."""
    tag: str
    value: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtractConfig(ModelRunSettings, SiteSettings, GenerationSettings):
    """The model settings (``model.settings``; ``batch_size`` is per device) and what to extract:
    ``sites`` (``model.sites``) at ``layers``; with ``generate``, of each prompt continued first
    (``transforms.generation``)."""
    model_path: str
    layers: tuple[int, ...] | None = None  # None: every layer
    max_seq_length: int = 2048
    activation_dtype: str = "float32"
    window: int | None = None              # records reordered at once; default 8 x global batch
    long_samples: str = "truncate"         # records over max_seq_length: truncate | skip | error
    batches_in_flight: int = 2             # dispatched before the oldest is copied back
    ablation: str | None = None            # an intervention to extract under (interventions.spec)
    ablation_means: str | None = None      # its means file, for mode=mean
    tokens: str | None = None              # store only these tokens (activations.selection); None: all
    logits_top_k: int | None = None        # store the logits' top k too (model.sites.TOP_K)
    statistics: StatisticsSpec | None = None  # measured per sample on the devices (model.statistics); None: none


def activation_record(record: dict[str, Any], activations: dict[Any, Any],
                      positions: np.ndarray | None = None, statistics: dict[Any, Any] | None = None,
                      scales: dict[Any, Any] | None = None) -> dict[str, Any]:
    """The output of one sample (as computed, see ``fit_record``): its identity, whether it was
    truncated, what its tokens are (``roles``, ``special``: None for a stream from before them),
    its kept ``columns``, and ``{key: array [rows, width]}`` (keys: ``model.sites.array_keys``):
    a row per token, or with a selection a row per selected token (``positions``, None for every
    token), or one pooled row; ``statistics``: ``{key: model.statistics.KeyStatistics}`` of those
    rows (None where none were measured); ``scales``: ``{key: [rows] float32}`` of rows stored as
    float8 (``model.quantize``; None otherwise)."""
    return {"sample_id": record["sample_id"], "source": record["source"],
            "text_preview": record["text_preview"], "num_tokens": record["num_tokens"],
            "truncated": record["truncated"], "original_num_tokens": record["original_num_tokens"],
            "roles": record.get("roles"), "special": record.get("special"), "columns": record.get("columns"),
            "generation": record.get("generation"), "positions": positions, "activations": activations,
            "statistics": statistics, "scales": scales}


def extract_in_order(extractor, records: Sequence[dict[str, Any]], long_samples: str = "truncate",
                     selection: Selection | None = None,
                     continuing: Continuing | None = None) -> Iterator[dict[str, Any] | Tagged]:
    """For each record in input order: its activation record, ``Tagged(REJECTED, ...)`` if
    ``long_samples`` skips it, or ``Tagged(ELSEWHERE, ...)`` if another process computed it.
    Computed bucket by bucket; with a ``selection``, only its rows leave the devices. With
    ``continuing``, each prompt is continued first; ``long_samples`` then applies to the prompt,
    which must leave room for the continuation."""
    new_tokens = continuing.max_new_tokens if continuing else 0
    limit = extractor.buckets[-1] - new_tokens
    fitted = [fit_record(r, limit, long_samples, new_tokens) for r in records]  # None: skipped
    if continuing:
        computed = [i for i, r in enumerate(fitted) if r is not None]
        for i, record in zip(computed, continuing.continued([fitted[i] for i in computed])):
            fitted[i] = record
    kept = {i: selection.positions(r.get("roles"), r.get("special"), r["num_tokens"])
            for i, r in enumerate(fitted) if r is not None} if selection else {}
    steer = extractor.steer_tokens
    by_role = extractor.statistics is not None and extractor.statistics.by_role
    items = ((i, r["input_ids"], kept.get(i),
              steered_positions(steer, r.get("roles"), r["num_tokens"], r["sample_id"]) if steer else None)
             + ((token_roles(r),) if by_role else ())
             for i, r in enumerate(fitted) if r is not None)
    results = {i: (arrays, measured, scales) for i, arrays, measured, scales in extractor.extract_measured(items)}
    for i, (record, fit) in enumerate(zip(records, fitted)):
        if fit is None:
            yield Tagged(REJECTED, rejection(record, limit, new_tokens))
            continue
        arrays, measured, scales = results.pop(i)
        if arrays is None:
            yield Tagged(ELSEWHERE, {"sample_id": record["sample_id"]})
        else:
            yield activation_record(fit, arrays, kept.get(i), measured, scales)


def token_roles(record: dict[str, Any]) -> np.ndarray:
    """[num_tokens] int32: each token's role code, what statistics by role group by."""
    if record.get("roles") is None:
        raise missing_roles("--stats_by role", record["sample_id"])
    return role_codes(record["roles"]).astype(np.int32)


class OrderedExtraction:
    """Stream records -> activation records (and ``Tagged`` outputs), in input order."""

    def __init__(self, config: ExtractConfig):
        self.config = config
        self.selection = parse_selection(config.tokens)
        self.extractor = None
        self.continuing: Continuing | None = None  # with --generate, set up with the model
        self._pending: list[dict[str, Any]] = []

    def setup(self) -> None:
        from model.extract import Extractor
        c = self.config
        self.extractor = Extractor.load(c.model_path, c.layers, c.mesh_type, c.dtype, c.batch_size,
                                        c.max_seq_length, c.model_axis_size, activation_dtype=c.activation_dtype,
                                        attention=c.attention, moe_dispatch=c.moe_dispatch,
                                        batches_in_flight=c.batches_in_flight,
                                        ablation=ablation_source(c.ablation, c.ablation_means),
                                        residual_dtype=c.residual_dtype, sites=c.sites,
                                        revision=c.model_revision,
                                        pool=self.selection.pool if self.selection else None,
                                        whole_model=bool(c.generate), statistics=c.statistics,
                                        logits_top_k=c.logits_top_k)
        if c.generate:
            self.continuing = continuing_for(self.extractor, c)

    def window_for(self, global_batch: int) -> int:
        """Records computed together: the configured window, else 8 global batches."""
        return self.config.window or 8 * global_batch

    @property
    def window(self) -> int:
        return self.window_for(self.extractor.batch_size)

    @property
    def pending(self) -> int:
        """Records waiting for the window to fill (0 at a window's start)."""
        return len(self._pending)

    def start(self) -> None:
        self._pending = []

    def process(self, record: dict[str, Any]) -> Iterator[dict[str, Any] | Tagged]:
        self._pending.append(record)
        if len(self._pending) >= self.window:
            yield from self.drain()

    def drain(self) -> Iterator[dict[str, Any] | Tagged]:
        """Computes and yields every pending record."""
        records, self._pending = self._pending, []
        yield from extract_in_order(self.extractor, records, self.config.long_samples, self.selection,
                                    self.continuing)

    def discard_pending(self) -> int:
        """Drops records not computed yet (on preemption they are redone after resume)."""
        dropped, self._pending = len(self._pending), []
        return dropped

    def teardown(self) -> None:
        self.extractor = self.continuing = None


def continuing_for(extractor, config: ExtractConfig, free: int | None = None) -> Continuing:
    """How ``config``'s ``generate`` continues each prompt, on ``extractor``'s model (loaded whole,
    with its head): a batch of the extraction's rows at a time, fewer where their key/value cache
    would not fit the ``free`` bytes of a device (None: measured, ``model.generate.free_bytes``),
    stopping at the checkpoint's end-of-sequence ids and ``stop`` strings, the text written by
    ``generation_tokenizer``'s, whose special tokens and thinking markers are marked."""
    from model.generate import CACHE_SHARE, Generator, free_bytes, stop_token_ids
    from transforms.tokenizers import load_tokenizer, special_ids
    model = extractor.config  # under the extraction's intervention, over every block: they all write
    intervention, ablation = ablation_for(config.ablation, config.ablation_means, model, model.num_hidden_layers)
    model_dir = resolve_model_dir(config.model_path, config.model_revision)
    name = generation_tokenizer(config.tokenizer, model_dir)
    tokenizer = load_tokenizer(name) if name else None
    thinking = thinking_ids(tokenizer) if tokenizer else None
    steer = intervention and intervention.steer_tokens
    generator = Generator(model, extractor.params, extractor.dtype, cache_length=config.max_seq_length,
                          residual_dtype=extractor.residual_dtype, mesh=extractor.mesh, ablation=ablation,
                          steers_written=steers_written_tokens(steer, thinking is not None) if steer else None)
    rows = generator.rows_that_fit(extractor.batch_size, free_bytes(extractor.mesh) if free is None else free)
    if rows < extractor.batch_size:
        log.warning("--generate: %d prompts continued at a time, not %d: the key/value cache of %d would "
                    "take more than %.0f%% of a device's free memory", rows, extractor.batch_size,
                    extractor.batch_size, 100 * CACHE_SHARE)
    return Continuing(generator, config.generate, config.sampling(), tuple(stop_token_ids(model_dir)), rows,
                      tokenizer, config.stop, special_ids(tokenizer) if tokenizer else frozenset(), thinking, steer)
