"""Token ids -> text, correct across streamed chunks.

The engine releases tokens in chunks whose boundaries never split a UTF-8 character;
each chunk carries the few tokens before it (``context_ids``) so tokenizers whose
decoding depends on the neighbour (a leading-space marker, say) still give the
same text as decoding everything at once.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4
# tokenizer identity -> (the tokenizer, kept alive so its id is not reused; token id -> whether the token's text
# alone is whole characters)
_WHOLE_TOKENS: dict[int, tuple[Tokenizer, dict[int, bool]]] = {}


def _whole_token_table(tokenizer: Tokenizer) -> dict[int, bool]:
    entry = _WHOLE_TOKENS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _WHOLE_TOKENS[id(tokenizer)] = (tokenizer, {})
    return entry[1]


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer.json, as the `tokenizers` library reads it."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; the base model directory needs a tokenizer.json")
    return Tokenizer.from_file(str(path))


def tokenizer_from_parameters(parameters: dict, model: str) -> Tokenizer:
    """The tokenizer named by a Triton model's config.pbtxt parameter ``tokenizer_dir``."""
    tokenizer_dir = parameters.get("tokenizer_dir", {}).get("string_value", "")
    if not tokenizer_dir or "${" in tokenizer_dir:
        raise ValueError(f"{model}: parameter 'tokenizer_dir' is not set; render the repository with scripts/serve.py")
    return load_tokenizer(tokenizer_dir)


def decode_chunk(tokenizer: Tokenizer, token_ids: list[int], context_ids: list[int], strip_chars: int = 0) -> str:
    """Text that ``token_ids`` add after ``context_ids``, less ``strip_chars`` at the end."""
    if not token_ids:
        return ""
    prefix = tokenizer.decode(list(context_ids), skip_special_tokens=True) if context_ids else ""
    full = tokenizer.decode(list(context_ids) + list(token_ids), skip_special_tokens=True)
    text = full[len(prefix):]
    if strip_chars > 0:
        text = text[: max(0, len(text) - strip_chars)]
    return text


class IncrementalDecoder:
    """Follows one request's output; says how many tokens may be released as clean text.

    Work per token is bounded: whether text ends on a whole character is read from a decode
    of the last few tokens only, and ``text`` (the decoded output so far, kept only with
    ``track_text``: the stop-string checks need it) grows by decoding a short window, as
    vLLM's incremental detokenizer does, rather than the whole output again. Most tokens need
    no decode at all: a token whose own text has no U+FFFD is whole UTF-8, and appended to a
    prefix that ends on a whole character it leaves one (whether each token id is whole is
    decoded once per tokenizer).
    """

    TAIL_TOKENS = 16  # a window longer than any character's bytes, so its end decodes as the whole

    def __init__(self, tokenizer: Tokenizer, track_text: bool = True) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.track_text = track_text
        self._text = ""
        self._prefix_offset = 0  # text window start: decoding starts here, so context effects cancel
        self._read_offset = 0  # tokens whose text is in self._text
        self._clean_upto = 0  # the first this many tokens are known to end on a whole character
        self._whole = _whole_token_table(tokenizer)

    @property
    def text(self) -> str:
        """Decoded text of the output up to its last whole character (needs ``track_text``)."""
        if not self.track_text:
            raise RuntimeError("this decoder does not keep the text (track_text=False)")
        return self._text

    def append(self, token_id: int) -> None:
        if self._clean_upto == len(self.token_ids) and self._is_whole(token_id):
            self._clean_upto += 1
        self.token_ids.append(token_id)
        if self.track_text:
            self._advance()

    def _is_whole(self, token_id: int) -> bool:
        whole = self._whole.get(token_id)
        if whole is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=True)
            whole = self._whole[token_id] = REPLACEMENT_CHAR not in text
        return whole

    def _advance(self) -> None:
        ids, decode = self.token_ids, self._tokenizer.decode
        prefix = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        new = decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(new) > len(prefix) and not new.endswith(REPLACEMENT_CHAR):
            self._text += new[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _ends_clean(self, n: int) -> bool:
        tail = self.token_ids[max(0, n - self.TAIL_TOKENS):n]
        return not self._tokenizer.decode(tail, skip_special_tokens=True).endswith(REPLACEMENT_CHAR)

    def clean_prefix_len(self, released: int = 0, look_back: int = 8) -> int:
        """Most tokens (at least ``released``) whose text ends on a whole character.

        Text that ends in U+FFFD may be a character whose remaining bytes have not been
        generated yet, so it is held back. Once a prefix ends on a whole character, later
        tokens cannot change it. Only the last ``look_back`` tokens are examined; a longer
        run of undecodable bytes is held until the request finishes.
        """
        n = len(self.token_ids)
        if self._clean_upto == n:  # every token since a clean prefix was whole: no decode needed
            return n if n > released else released
        lowest = max(released, n - look_back)
        while n > lowest:
            if self._ends_clean(n):
                self._clean_upto = max(self._clean_upto, n)  # at n = len, the fast path goes on from here
                break
            n -= 1
        return n if n > released else released

    def text_of(self, n_tokens: int) -> str:
        """Decoded text of the first n_tokens output tokens."""
        if self.track_text and n_tokens == self._read_offset:
            return self._text
        return self._tokenizer.decode(self.token_ids[:n_tokens], skip_special_tokens=True)
