"""Real-text prompts: passages of Python's reference documentation.

``pydoc_data.topics`` ships with every CPython (no download, the same text on
every machine of one Python version). Only prose paragraphs are used: code
samples (indented lines, ``>>>`` sessions) and tables would make prompts the
model mostly continues with punctuation.
"""

from __future__ import annotations

import math
import random
import re
from functools import lru_cache

_MIN_PARAGRAPH_WORDS = 12


@lru_cache(maxsize=1)
def prose_paragraphs() -> tuple[str, ...]:
    """Every prose paragraph of the documentation topics, whitespace collapsed, in topic order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.splitlines()
            if any(line.startswith((" ", "\t", ">>>", "*", "+", "=")) for line in lines):
                continue  # code, tables, lists and headings underlined with =
            text = " ".join(" ".join(lines).split())
            if len(text.split()) >= _MIN_PARAGRAPH_WORDS and text[-1] in ".:":
                paragraphs.append(text)
    return tuple(paragraphs)


def real_text_prompts(count: int, *, seed: int = 0, min_words: int = 4, max_words: int = 160) -> list[str]:
    """``count`` distinct passages, each the first ``w`` words of a prose
    paragraph (run on into the next ones when short), with ``w`` drawn
    log-uniformly in [min_words, max_words] so short and long prompts both
    appear. The same arguments give the same prompts."""
    if count < 1 or min_words < 1 or max_words < min_words:
        raise ValueError(f"need count >= 1 and 1 <= min_words <= max_words, got {count}, {min_words}, {max_words}")
    paragraphs = prose_paragraphs()
    if count > len(paragraphs):
        raise ValueError(f"count must be at most {len(paragraphs)} (the prose paragraphs available), got {count}")
    rng = random.Random(seed)
    prompts = []
    for start in rng.sample(range(len(paragraphs)), count):
        words = math.exp(rng.uniform(math.log(min_words), math.log(max_words)))
        prompts.append(_first_words(paragraphs, start, round(words)))
    return prompts


def _first_words(paragraphs: tuple[str, ...], start: int, count: int) -> str:
    words: list[str] = []
    index = start
    while len(words) < count:
        words.extend(paragraphs[index % len(paragraphs)].split())
        index += 1
    return " ".join(words[:count])
