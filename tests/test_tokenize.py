import apache_beam as beam
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from transforms.samples import Sample
from transforms.tokenize import TokenizeSamples, render_prompt, tokenize_samples

CHAT = Sample(1, "t:0", messages=(("system", "Be brief."), ("user", "2+2?")))
TEXT = Sample(2, "doc", text="Hello world")


def test_chat_is_rendered_with_the_generation_prompt(qwen_tokenizer):
    assert render_prompt(qwen_tokenizer, CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_batch_matches_one_at_a_time_and_keeps_order(qwen_tokenizer):
    out = tokenize_samples(qwen_tokenizer, [TEXT, CHAT, TEXT], max_seq_length=None)
    assert [s.sample_id for s in out] == [2, 1, 2]
    assert out[0].input_ids == (9707, 1879)
    expected_chat = qwen_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert list(out[1].input_ids) == list(expected_chat)
    assert out[1].input_ids[0] == 151644 and not out[1].truncated


def test_truncation_keeps_the_first_tokens_and_marks_it(qwen_tokenizer):
    full, = tokenize_samples(qwen_tokenizer, [CHAT], max_seq_length=None)
    cut, = tokenize_samples(qwen_tokenizer, [CHAT], max_seq_length=5)
    exact, = tokenize_samples(qwen_tokenizer, [CHAT], max_seq_length=len(full.input_ids))
    assert cut.input_ids == full.input_ids[:5] and cut.truncated
    assert exact.input_ids == full.input_ids and not exact.truncated


def test_tokenize_transform_in_a_pipeline(qwen_tokenizer_dir):
    with BeamTestPipeline(runner=FnApiRunner()) as p:
        ids = (p | beam.Create([TEXT, CHAT])
               | TokenizeSamples(qwen_tokenizer_dir, max_seq_length=3)).samples
        ids = (ids | beam.Map(lambda s: (s.sample_id, s.input_ids[:2], s.truncated)))
        assert_that(ids, equal_to([(2, (9707, 1879), False), (1, (151644, 8948), True)]))
