"""N-gram prompt lookup: propose the tokens that followed the most recent
earlier occurrence of the sequence's last n tokens.

Torch-free. Each sequence keeps, per n, a map from every n-gram of its history
to where it last ended, updated as tokens arrive, so a proposal costs
O(prompt_lookup_max) dictionary lookups whatever the length of the context
(a scan of the history per step would be O(length) per sequence).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The n-grams of one token history, for ``min_n <= n <= max_n``.

    Safety rule: ``extend`` must be given every token of the history exactly
    once, in order; ``tokens`` is the index's own copy.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n -> {n-gram: index of its last token}, only n-grams followed by a token.
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens = self.tokens
        for token_id in token_ids:
            # The n-grams ending at the previous last token now have a follower.
            end = len(tokens) - 1
            for n, table in self._last_end.items():
                if end + 1 >= n:
                    table[tuple(tokens[end - n + 1 : end + 1])] = end
            tokens.append(token_id)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the most recent earlier
        occurrence of the longest matching suffix; [] when nothing matches."""
        tokens = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            end = self._last_end[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + num_tokens]
        return []


class NgramProposer:
    """Prompt-lookup proposals for many sequences, keyed by sequence id.

    Safety rule: ``forget`` a sequence whenever the runner forgets it (its
    history is sent whole again when it comes back).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def forget(self, sequence_id: str) -> None:
        self._indexes.pop(sequence_id, None)

    def propose(self, sequence_id: str, history: Sequence[Sequence[int]], num_tokens: int) -> list[int]:
        """Proposals after the sequence's history, given as consecutive
        segments (prompt, output, this step's tokens: no list joins them).
        Between calls for one id the history only grows, so only the tokens
        past what the index holds are read."""
        index = self._indexes.get(sequence_id)
        if index is None:
            index = self._indexes[sequence_id] = NgramIndex(self.min_n, self.max_n)
        start = len(index.tokens)
        for segment in history:
            if start < len(segment):
                index.extend(segment[start:])
            start = max(0, start - len(segment))
        return index.propose(num_tokens)
