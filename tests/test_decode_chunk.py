"""decode_chunk over streamed chunks of byte-level BPE tokens that split multi-byte characters.

Chunks are cut where the engine cuts them (IncrementalDecoder.clean_prefix_len: never inside
a UTF-8 character); the concatenated chunk texts must equal decoding everything at once.
"""

from __future__ import annotations

import random

import pytest

from manylora.engine.requests.detokenize import CONTEXT_TOKENS, IncrementalDecoder, decode_chunk
from model_factory import train_tokenizer

WORDS = ["the", " baker", " café", " crème", " brûlée", " ñ", "!"]
WORDS += [" 東京", " ありがとう", " καλημέρα", " 🙂", " Москва"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(vocab_size=300)


def _stream_chunks(tokenizer, prompt_ids: list[int], ids: list[int], rng: random.Random) -> list[str]:
    """Texts of the chunks an engine would release, token by token with random pauses."""
    decoder = IncrementalDecoder(tokenizer)
    released, texts = 0, []
    for i, token in enumerate(ids):
        decoder.append(token)
        last = i == len(ids) - 1
        if not last and rng.random() < 0.3:  # the engine does not release after every token
            continue
        n = len(ids) if last else decoder.clean_prefix_len()
        if n <= released:
            continue
        context = (prompt_ids + ids[:released])[-CONTEXT_TOKENS:]
        texts.append(decode_chunk(tokenizer, ids[released:n], context))
        released = n
    return texts


def test_chunks_concatenate_to_the_whole_text(tokenizer):
    rng = random.Random(0)
    split_chars = 0
    for _ in range(300):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        prompt_ids = tokenizer.encode("the baker", add_special_tokens=True).ids
        # per-token decoding shows the characters really are split across tokens
        split_chars += sum("\ufffd" in tokenizer.decode([t]) for t in ids)
        chunks = _stream_chunks(tokenizer, prompt_ids, ids, rng)
        assert "".join(chunks) == tokenizer.decode(ids) == text
        assert all("\ufffd" not in c for c in chunks), chunks
    assert split_chars > 100


def test_random_token_streams(tokenizer):
    """Arbitrary token ids (not from encoding text): equal to decoding all at once, once complete."""
    rng = random.Random(1)
    vocab = tokenizer.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 20))]
        chunks = _stream_chunks(tokenizer, [0], ids, rng)
        assert "".join(chunks) == tokenizer.decode(ids)


def test_strip_chars_and_empty(tokenizer):
    ids = tokenizer.encode(" crème brûlée", add_special_tokens=False).ids
    assert decode_chunk(tokenizer, ids, [], strip_chars=3) == " crème brû"
    assert decode_chunk(tokenizer, [], ids) == ""


def _mixed_streams(tokenizer, rng: random.Random, trials: int):
    """Token streams, alternately arbitrary ids and encoded text with split multi-byte characters."""
    vocab = tokenizer.get_vocab_size()
    for trial in range(trials):
        if trial % 2:
            yield [rng.randrange(2, vocab) for _ in range(rng.randint(1, 40))]
        else:
            text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            yield tokenizer.encode(text, add_special_tokens=False).ids


def test_incremental_text_equals_decoding_everything(tokenizer):
    """The windowed text (kept for stop strings) and the tail-only clean check agree with full decodes."""
    for ids in _mixed_streams(tokenizer, random.Random(2), 200):
        tracked, untracked = IncrementalDecoder(tokenizer), IncrementalDecoder(tokenizer, track_text=False)
        for i, token in enumerate(ids):
            tracked.append(token)
            untracked.append(token)
            full = tokenizer.decode(ids[: i + 1])
            clean = tracked.clean_prefix_len()
            assert clean == untracked.clean_prefix_len()
            assert not tokenizer.decode(ids[:clean]).endswith("\ufffd")
            if not full.endswith("\ufffd"):
                assert tracked.text == full
            assert full.startswith(tracked.text)
        with pytest.raises(RuntimeError, match="track_text"):
            _ = untracked.text


class _CountingTokenizer:
    """The tokenizer, counting decode calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decodes = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _clean_prefix_by_decoding(tokenizer, ids: list[int], released: int, look_back: int = 8) -> int:
    """The clean-prefix rule with a tail decode at every candidate length (no whole-token shortcut)."""
    n = len(ids)
    lowest = max(released, n - look_back)
    while n > lowest and tokenizer.decode(ids[max(0, n - IncrementalDecoder.TAIL_TOKENS):n]).endswith("\ufffd"):
        n -= 1
    return n if n > released else released


def test_whole_tokens_skip_the_decode_and_agree_with_it(tokenizer):
    """After a clean prefix, a token whose own text is whole characters keeps the prefix clean without a decode;
    on random streams (split characters included) the answer equals decoding every candidate tail, and a stream of
    whole tokens costs no decode once each token id has been seen."""
    rng = random.Random(3)
    for ids in _mixed_streams(tokenizer, rng, 300):
        decoder, released = IncrementalDecoder(tokenizer, track_text=False), 0
        for i, token in enumerate(ids):
            decoder.append(token)
            n = decoder.clean_prefix_len(released)
            assert n == _clean_prefix_by_decoding(tokenizer, ids[: i + 1], released)
            if rng.random() < 0.5:
                released = n
    ascii_ids = tokenizer.encode(" the baker the baker the baker", add_special_tokens=False).ids
    counting = _CountingTokenizer(tokenizer)
    for _ in range(2):  # the first pass learns each id's wholeness
        counting.decodes = 0
        decoder = IncrementalDecoder(counting, track_text=False)
        for token in ascii_ids:
            decoder.append(token)
            assert decoder.clean_prefix_len() == len(decoder.token_ids)
    assert counting.decodes == 0
