"""ExtractActivations inside an ordinary Beam pipeline on the local runner."""

import dataclasses
import re

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from tests.conftest import read_streams
from fixtures.hf_reference import load_reference, reference_activations, relative_error
from common.stream_format import StreamFormatError, parse_stream_line
from transforms.extract import ExtractActivations
from transforms.extraction import REJECTED, ExtractConfig

pytestmark = pytest.mark.slow


def test_dofn_in_a_beam_pipeline_matches_the_reference(arc_streams, tiny_checkpoints):
    records = read_streams(arc_streams, 2)[1][:5]
    config = ExtractConfig(model_path=tiny_checkpoints["gqa_tied"], layers=(1, 3), batch_size=2,
                           max_seq_length=160, dtype="float32", window=3)
    refs = reference_activations(load_reference(tiny_checkpoints["gqa_tied"]), [r["input_ids"] for r in records])
    expected = {r["sample_id"]: ref for r, ref in zip(records, refs)}

    def check(outputs):
        assert sorted(o["sample_id"] for o in outputs) == sorted(expected)
        for o in outputs:
            assert sorted(o["activations"]) == [1, 3] and o["activations"][1].dtype == np.float32
            for layer in (1, 3):
                assert relative_error(o["activations"][layer], expected[o["sample_id"]][layer]) <= 1e-5

    with BeamTestPipeline(runner=FnApiRunner()) as p:
        outputs = p | beam.Create(records) | beam.ParDo(ExtractActivations(config))
        assert_that(outputs, check)


def test_long_records_are_truncated_or_go_to_the_rejected_output(arc_streams, tiny_checkpoints):
    records = read_streams(arc_streams, 2)[0][:4]  # cut to 160 tokens by prepare, most of them
    assert any(r["truncated"] for r in records) and "original_num_tokens" in records[0]
    long = {"sample_id": 99, "input_ids": records[1]["input_ids"] * 3, "num_tokens": 480,
            "source": "long", "text_preview": ""}
    config = ExtractConfig(model_path=tiny_checkpoints["gqa_tied"], layers=(1,), batch_size=2, max_seq_length=160,
                           dtype="float32", window=2)
    with BeamTestPipeline(runner=FnApiRunner()) as p:
        inputs = p | beam.Create([*records, long])
        skipped = inputs | "Skip" >> beam.ParDo(ExtractActivations(
            dataclasses.replace(config, long_samples="skip"))).with_outputs(REJECTED, main="activations")
        assert_that(skipped.activations | "Ids" >> beam.Map(lambda o: o["sample_id"]),
                    equal_to([r["sample_id"] for r in records]), label="Computed")
        assert_that(skipped[REJECTED], equal_to([{"sample_id": 99, "source": "long", "num_tokens": 480,
                                                  "max_seq_length": 160, "reason": "too_long"}]),
                    label="Rejected")
        truncated = (inputs | "Truncate" >> beam.ParDo(ExtractActivations(config))
                     | "Flags" >> beam.Map(lambda o: (o["sample_id"], o["num_tokens"], o["truncated"],
                                                      o["original_num_tokens"])))
        # Truncated by prepare or here: both flagged, with the length before any truncation.
        assert_that(truncated, equal_to([(r["sample_id"], r["num_tokens"], r["truncated"],
                                          r.get("original_num_tokens", r["num_tokens"])) for r in records]
                                        + [(99, 160, True, 480)]), label="Truncated")


@pytest.mark.parametrize("line, message", [
    ('{"sample_id": 1', "malformed JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"sample_id": 1, "input_ids": [1], "num_tokens": 1, "source": "s"}', "missing field(s) text_preview"),
    ('{"sample_id": 1, "input_ids": [], "num_tokens": 0, "source": "s", "text_preview": ""}',
     "input_ids must be a non-empty list"),
    ('{"sample_id": 1, "input_ids": [4, 5], "num_tokens": 3, "source": "s", "text_preview": ""}',
     "num_tokens 3 != 2 input_ids"),
])
def test_malformed_stream_lines(line, message):
    with pytest.raises(StreamFormatError, match=re.escape(message)) as e:
        parse_stream_line(line, "s.jsonl:9")
    assert str(e.value).startswith("s.jsonl:9: ")
