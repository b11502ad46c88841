"""manylora.engine.requests.prompt_guard: a prompt that cannot fit the context is refused before it is tokenized
whole; one that fits
gets exactly the tokenizer's ids."""

from __future__ import annotations

import random

import pytest

from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.prompt_guard import PromptGuard, longest_token_bytes
from model_factory import TOKENIZER_TEXT, train_tokenizer


class CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.characters = 0

    def encode(self, text, add_special_tokens=True):
        self.characters += len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def _text(rng: random.Random, words: int) -> str:
    vocabulary = TOKENIZER_TEXT.split() + ["🙂", "東京", "naïve", "\n", "zzqx"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def test_the_longest_token_bounds_every_token(tokenizer):
    longest = longest_token_bytes(tokenizer)
    rng = random.Random(3)
    for _ in range(50):
        text = _text(rng, rng.randint(1, 200))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(text.encode()) <= longest * len(ids)


def test_fitting_prompts_get_the_tokenizers_ids_and_long_ones_are_refused(tokenizer):
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    for _ in range(40):
        limit = rng.randint(4, 600)
        guard = PromptGuard(tokenizer, limit, piece_bytes=rng.choice([64, 256, 4096]))
        text = _text(rng, rng.randint(1, 3 * limit))
        ids = tokenizer.encode(text, add_special_tokens=True).ids
        try:
            got = guard.encode(text if rng.random() < 0.5 else text.encode())
        except RequestError as e:
            assert e.code is ErrorCode.INVALID_ARG and "too long" in e.message
            assert len(ids) >= limit, f"seed {seed}: refused a prompt of {len(ids)} tokens with a limit of {limit}"
            continue
        assert got == ids and len(ids) < limit, f"seed {seed}"


def test_a_huge_prompt_is_refused_without_tokenizing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    guard = PromptGuard(counting, 256)
    for text in ("the baker " * 2_000_000, ("the baker " * 2_000_000).encode()):
        with pytest.raises(RequestError, match="bytes cannot make fewer than 256 tokens"):
            guard.encode(text)
    assert counting.characters == 0


def test_a_long_prompt_under_the_byte_bound_is_refused_after_a_bounded_count(tokenizer):
    counting = CountingTokenizer(tokenizer)
    guard = PromptGuard(counting, 200, piece_bytes=64)
    text = " ".join(["baker"] * (guard.max_bytes // 6))  # within the byte bound, far more than 200 tokens
    assert len(text.encode()) <= guard.max_bytes
    assert len(tokenizer.encode(text).ids) > 2 * guard.max_tokens
    with pytest.raises(RequestError, match="too long"):
        guard.encode(text)
    assert counting.characters < 0.6 * len(text)  # stopped counting early, never tokenized it whole


def test_invalid_utf8_is_refused(tokenizer):
    with pytest.raises(RequestError, match="UTF-8"):
        PromptGuard(tokenizer, 64).encode(b"\xff\xfe caf\xc3")
