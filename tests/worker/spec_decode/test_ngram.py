"""Prompt lookup against a brute-force scan of the history."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.worker.spec_decode.ngram import NgramProposer


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix (max_n down to min_n) seen earlier, most recent match first."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # the n-gram ends at `end`, followed by a token
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=60),
    st.lists(st.integers(1, 5), min_size=1, max_size=6),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 5),
)
def test_incremental_lookup_equals_a_scan_of_the_history(tokens, cuts, min_n, extra, k):
    max_n = min_n + extra
    proposer = NgramProposer(min_n, max_n)
    # Feed the history in growing pieces, split across segments as the runner does.
    end = 0
    for cut in cuts + [len(tokens)]:
        end = min(len(tokens), end + cut)
        history = tokens[:end]
        split = len(history) // 2
        got = proposer.propose("s", (history[:split], history[split:], []), k)
        assert got == brute_force(history, min_n, max_n, k)


def test_a_forgotten_sequence_starts_over():
    proposer = NgramProposer(1, 2)
    assert proposer.propose("s", ([1, 2, 3, 1, 2],), 2) == [3, 1]
    proposer.forget("s")
    assert proposer.propose("s", ([9, 8, 9],), 2) == [8, 9]
