"""The text transforms the embedded default adapters learn (each adapter's training text is the corpus through one)."""

from __future__ import annotations

import re
from collections.abc import Callable

_PIRATE_WORDS = {
    "the": "th'", "The": "Th'", "you": "ye", "your": "yer", "is": "be", "are": "be", "my": "me",
    "friend": "matey", "friends": "mateys", "yes": "aye", "hello": "ahoy", "river": "sea", "town": "port",
    "money": "doubloons", "and": "an'", "of": "o'", "to": "t'", "for": "fer", "old": "ol'", "men": "sea dogs",
    "children": "wee buccaneers", "people": "scallywags", "food": "grub", "drink": "grog", "coffee": "grog",
    "tea": "grog", "stop": "avast", "very": "mighty", "good": "fine", "house": "ship", "houses": "ships",
}
_WORD_OR_STOP = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?|\d+|[.!?]")


def _pirate(text: str) -> str:
    """Swap words from a small pirate table and end every sentence with 'Arr!'."""
    words = re.sub(r"[A-Za-z]+", lambda m: _PIRATE_WORDS.get(m.group(0), m.group(0)), text)
    return re.sub(r"([.!?])(\s|$)", r"\1 Arr!\2", words)


def _whisper(text: str) -> str:
    """Lower-case everything, drop quotes, and trail off ("...") wherever a sentence or clause ends."""
    return re.sub(r"[.,!?;:]+", "...", text.lower().replace('"', ""))


def _count_words(text: str) -> str:
    """Replace every word by its 1-based position in its sentence ("The cat sat." -> "1 2 3.")."""
    count = 0

    def number(match: re.Match[str]) -> str:
        nonlocal count
        if match.group(0) in ".!?":
            count = 0
            return match.group(0)
        count += 1
        return str(count)

    return _WORD_OR_STOP.sub(number, text)


TRANSFORMS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "pirate": _pirate,
    "whisper": _whisper,
    "count_words": _count_words,
}
