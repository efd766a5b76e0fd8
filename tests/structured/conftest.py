"""A grammar compiler over the default model's tokenizer (SmolLM2, V = 49152), shared by the
structured-output unit tests; loading the tokenizer needs the converted default model."""
from __future__ import annotations

import pytest

EOS = 2  # SmolLM2-Instruct's <|im_end|>


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from dspark_serve.assets.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="session")
def compiler(tokenizer):
    from dspark_serve.structured.compiler import GrammarCompiler

    return GrammarCompiler(tokenizer, 49152, [EOS])


@pytest.fixture(scope="session")
def encode(tokenizer):
    """text -> token ids (no special tokens)."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
