"""ExtractActivations inside an ordinary Beam pipeline on the local runner."""

import re

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that

from tests.conftest import read_streams
from tests.hf_reference import load_reference, reference_activations, relative_error
from transforms.extract import ExtractActivations, ExtractConfig, StreamFormatError, parse_stream_line

pytestmark = pytest.mark.slow


def test_dofn_in_a_beam_pipeline_matches_the_reference(arc_streams, tiny_checkpoints):
    records = read_streams(arc_streams, 2)[1][:5]
    config = ExtractConfig(tiny_checkpoints["gqa_tied"], layers=(1, 3), batch_size=2,
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
