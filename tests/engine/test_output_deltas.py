"""Deltas across the engine-core boundary rebuild exactly the outputs the engine made."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.core_messages import OutputBatch, output_codec
from pagedllm.engine.output_deltas import DeltaEncoder, OutputAssembler
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _output(request_id: str, texts: list[str], tokens: list[list[int]], finished: bool,
            with_logprobs: bool) -> RequestOutput:
    completions = [
        CompletionOutput(index, text, list(ids), -0.5 * len(ids),
                         [{t: Logprob(-0.1, 1, str(t))} for t in ids] if with_logprobs else None,
                         "stop" if finished else None, "." if finished else None)
        for index, (text, ids) in enumerate(zip(texts, tokens))
    ]
    return RequestOutput(request_id, "a prompt", [1, 2, 3], None, completions, finished,
                         RequestMetrics(arrival_time=1.0, num_generation_tokens=sum(map(len, tokens))), 16)


# One sequence's life: each step appends text and tokens, or cuts the text back (a stop string).
_steps = st.lists(st.tuples(st.text(max_size=6), st.lists(st.integers(0, 50_000), max_size=3),
                            st.integers(0, 8), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(lives=st.lists(_steps, min_size=1, max_size=3), with_logprobs=st.booleans())
def test_assembled_outputs_equal_the_engines_through_the_wire(lives, with_logprobs):
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    wire_encoder, wire_decoder = output_codec()
    texts, tokens = [""] * len(lives), [[] for _ in lives]
    num_steps = max(map(len, lives))
    for step in range(num_steps):
        for index, life in enumerate(lives):
            if step < len(life):
                added, ids, cut, do_cut = life[step]
                texts[index] = (texts[index][: max(0, len(texts[index]) - cut)] if do_cut else texts[index]) + added
                tokens[index] = tokens[index] + ids
        finished = step == num_steps - 1
        made = _output("r1", texts, tokens, finished, with_logprobs)
        batch = wire_decoder.decode(wire_encoder.encode(OutputBatch([encoder.encode(made)])))
        assert assembler.assemble(batch.outputs[0]) == made
    assert not encoder._sent and not assembler._requests  # a finished request leaves nothing behind


def test_a_token_costs_bytes_not_the_length_of_its_sequence():
    encoder = DeltaEncoder()
    wire = msgspec.msgpack.Encoder()
    tokens = list(range(1000))
    encoder.encode(_output("r", ["x" * 4000], [tokens], False, False))
    later = wire.encode(encoder.encode(_output("r", ["x" * 4000 + "y"], [tokens + [7]], False, False)))
    assert len(later) < 80


def test_an_aborted_request_is_forgotten_on_both_sides():
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    assembler.assemble(encoder.encode(_output("r", ["a"], [[1]], False, False)))
    encoder.forget("r")
    assembler.forget("r")
    assert not encoder._sent and not assembler._requests
