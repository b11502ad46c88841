"""Text -> prompt token ids, refusing a prompt longer than the context before it is tokenized whole.

Tokenizing costs time in proportion to the text: one 10 MB prompt held the tokenizer for seconds while
every other request waited behind it. So a text is refused at once when its UTF-8 bytes exceed what
``max_tokens`` tokens can hold (``max_tokens`` times the longest token's bytes: no tokenizer makes
fewer tokens than that, unless its normalizer deletes text); a text below that bound but long enough
to matter is first counted piece by piece, stopping as soon as the count is past the limit; only a
text that can fit is tokenized whole.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from manylora.engine.errors import ErrorCode, RequestError

PIECE_BYTES = 16 * 1024  # texts longer than this (characters) are first counted in pieces of about this size


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of input one token can stand for, at most: the longest vocabulary or added token's
    text (its byte-level or sentencepiece spelling is never shorter than the bytes it stands for)."""
    texts = list(tokenizer.get_vocab(with_added_tokens=True))
    texts += [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    return max((len(text.encode("utf-8")) for text in texts), default=1) or 1


class PromptGuard:
    """Tokenizes prompts of at most ``max_tokens`` tokens; refuses longer ones cheaply (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, piece_bytes: int = PIECE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_bytes = max_tokens * longest_token_bytes(tokenizer)
        self.piece_bytes = piece_bytes

    def _too_long(self, detail: str) -> RequestError:
        return RequestError(ErrorCode.INVALID_ARG, f"text_input is too long: {detail}; the context holds "
                                                   f"{self.max_tokens} tokens (max_model_len) and at least one new "
                                                   f"token must fit")

    def encode(self, text: str | bytes, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids (special tokens added unless ``add_special_tokens`` is false) from its text or UTF-8
        bytes; RequestError(INVALID_ARG) if they cannot fit or the bytes are not UTF-8. Bytes are measured before
        they are decoded."""
        if isinstance(text, bytes):
            self._check_bytes(len(text))
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(ErrorCode.INVALID_ARG, f"text_input is not valid UTF-8 ({e})") from None
        elif len(text) * 4 > self.max_bytes:  # a character is 1-4 bytes
            self._check_bytes(len(text) if len(text) > self.max_bytes else len(text.encode("utf-8")))
        if len(text) > self.piece_bytes:
            self._count_in_pieces(text)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if len(ids) >= self.max_tokens:
            raise self._too_long(f"{len(ids)} tokens")
        return ids

    def _check_bytes(self, size: int) -> None:
        if size > self.max_bytes:
            raise self._too_long(f"{size} bytes cannot make fewer than {self.max_tokens} tokens")

    def _count_in_pieces(self, text: str) -> None:
        """Raise once the pieces' tokens are more than the whole text's could be: a piece boundary can split a
        token in two, so the limit is the context plus one token per piece cut so far."""
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + self.piece_bytes)
            space = text.rfind(" ", start + self.piece_bytes // 2, end) if end < len(text) else -1
            end = space if space > start else end
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False).ids)
            cuts += end < len(text)
            if count >= self.max_tokens + cuts:
                raise self._too_long(f"more than {count - cuts} tokens")
            start = end
