"""`pagedllm bench fleet`: the workload generator (prefix structure, lengths, seeding, the
schedule), the chat stream reader, the table and goals, and one end-to-end run (slow)."""

from __future__ import annotations

import argparse
import math

import pytest

from pagedllm.bench.fleet import cli
from pagedllm.bench.fleet.client import ChatMetrics, ChatTally
from pagedllm.bench.fleet.report import _REPLICA_UP, FleetResult, fleet_table, goals_text
from pagedllm.bench.fleet.workload import WorkloadSpec, build_workload, tokenizer_counter, turn_order
from pagedllm.bench.serve.stream import RequestFailed

SMALL = WorkloadSpec(num_system_prompts=3, system_tokens=96, num_conversations=7, turns=3, live_conversations=4,
                     user_tokens=20, max_tokens=8, request_rate=10.0, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.model.loader import load_tokenizer

    return load_tokenizer(None)  # the default model's (SmolLM2), with its chat template


@pytest.fixture(scope="module")
def workload(tokenizer):
    return build_workload(SMALL, tokenizer_counter(tokenizer))


def test_each_turn_extends_the_previous_turn_exactly(workload, tokenizer):
    """Turn k+1's messages are turn k's plus the reply and a new user message, so its rendered
    prompt (what the server tokenizes) starts with turn k's whole rendered prompt."""
    replies = ["Sure, the team reviews them weekly.", "No.", " Leading space and\nnew line."]
    for conversation in workload.conversations:
        rendered_before = None
        for turn in range(conversation.turns):
            messages = conversation.messages(replies[:turn])
            assert messages[0] == {"role": "system", "content": workload.system_prompts[conversation.system_index]}
            assert messages[-1] == {"role": "user", "content": conversation.user_messages[turn]}
            if turn:
                before = conversation.messages(replies[:turn - 1])
                assert messages[:len(before)] == before
                assert messages[len(before):] == [{"role": "assistant", "content": replies[turn - 1]},
                                                  {"role": "user", "content": conversation.user_messages[turn]}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if rendered_before is not None:
                assert rendered.startswith(rendered_before)
            rendered_before = rendered
        with pytest.raises(ValueError, match="turn 3 does not exist"):
            conversation.messages(replies)


def test_lengths_are_at_least_the_requested_token_counts(workload, tokenizer):
    count = tokenizer_counter(tokenizer)
    assert len(workload.system_prompts) == 3 and len(set(workload.system_prompts)) == 3
    assert workload.system_prompt_tokens == tuple(count(s) for s in workload.system_prompts)
    assert all(SMALL.system_tokens <= n < SMALL.system_tokens + 40 for n in workload.system_prompt_tokens)
    for conversation in workload.conversations:
        assert conversation.system == workload.system_prompts[conversation.index % 3]
        assert all(count(m) >= SMALL.user_tokens for m in conversation.user_messages)
    # Varied sentences: the text does not compress to a few tokens per sentence's worth of words.
    words = sum(len(s.split()) for s in workload.system_prompts)
    assert sum(workload.system_prompt_tokens) >= words


def test_the_workload_is_determined_by_its_seed(tokenizer, workload):
    count = tokenizer_counter(tokenizer)
    assert build_workload(SMALL, count) == workload
    other = build_workload(WorkloadSpec(**{**SMALL.__dict__, "seed": 4}), count)
    assert other.system_prompts != workload.system_prompts and other.schedule != workload.schedule


def test_schedule_sends_every_turn_in_order_with_a_bounded_number_open(workload):
    schedule = workload.schedule
    assert len(schedule) == workload.num_requests == 7 * 3
    assert [slot.offset_s for slot in schedule] == pytest.approx([i / 10.0 for i in range(21)])
    seen: dict[int, int] = {}
    open_now, most_open = set(), 0
    for slot in schedule:
        assert slot.turn == seen.get(slot.conversation, 0)  # turns in order, none skipped
        seen[slot.conversation] = slot.turn + 1
        open_now.add(slot.conversation)
        most_open = max(most_open, len(open_now))
        if slot.turn == 2:
            open_now.discard(slot.conversation)
    assert seen == {c: 3 for c in range(7)} and most_open == 4


def test_turn_order_keeps_a_conversation_quiet_after_it_speaks():
    import random

    order = turn_order(num_conversations=12, turns=4, live=6, rng=random.Random(0))
    last_spoke = {}
    for position, (conversation, _turn) in enumerate(order[:24]):  # while 6 are open
        if conversation in last_spoke:
            assert position - last_spoke[conversation] > 3
        last_spoke[conversation] = position


def test_poisson_arrivals_are_seeded_and_increasing(tokenizer):
    spec = WorkloadSpec(**{**SMALL.__dict__, "arrivals": "poisson"})
    first = build_workload(spec, tokenizer_counter(tokenizer))
    offsets = [slot.offset_s for slot in first.schedule]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert first == build_workload(spec, tokenizer_counter(tokenizer))


def test_default_pool_overflows_one_replica_and_fits_the_fleet(tokenizer):
    workload = build_workload(WorkloadSpec(), tokenizer_counter(tokenizer))
    working_set = workload.working_set_blocks(16)
    per_replica = math.ceil(cli.AUTO_POOL_SHARE * working_set)
    assert all(n >= 512 for n in workload.system_prompt_tokens)
    assert per_replica < working_set <= 2 * per_replica


def test_spec_refuses_bad_sizes():
    with pytest.raises(ValueError, match="turns must be at least 1"):
        WorkloadSpec(turns=0)
    with pytest.raises(ValueError, match="arrivals must be"):
        WorkloadSpec(arrivals="burst")


def test_chat_tally_reads_content_usage_and_errors():
    tally = ChatTally()
    for line, now in [('data: {"choices": [{"delta": {"role": "assistant"}}]}', 1.0), ("", 1.5),
                      ('data: {"choices": [{"delta": {"content": "Hel"}}]}', 2.0),
                      ('data: {"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]}', 3.0),
                      ('data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2, '
                       '"prompt_tokens_details": {"cached_tokens": 32}}}', 3.5), ("data: [DONE]", 4.0)]:
        tally.feed(line, now)
    assert "".join(tally.text) == "Hello" and tally.first_token_at == 2.0 and tally.done_at == 4.0
    assert tally.usage["prompt_tokens_details"]["cached_tokens"] == 32
    with pytest.raises(RequestFailed, match="replica down"):
        ChatTally().feed('data: {"error": {"message": "replica down", "code": "replica_down"}}', 1.0)


def _result(run: str, cached: int, duration: float, ttft: float) -> FleetResult:
    metrics = [ChatMetrics(prompt_tokens=100, output_tokens=10, ttft_s=ttft, e2e_s=1.0, cached_tokens=cached)] * 4
    return FleetResult(run, run, metrics, duration)


def test_table_ratios_and_goals():
    results = [_result("prefix", 90, 10.0, 0.2), _result("round-robin", 50, 15.0, 0.5), _result("single", 95, 20.0, 0.1)]
    rows = [row.split("|")[1:-1] for row in fleet_table(results).splitlines()[2:]]
    assert [cell.strip() for cell in rows[0]] == ["prefix", "4", "0", "400", "360", "90.0%", "0.95x", "4.0", "44",
                                                   "1.50x", "200", "200", "0.40x", "10.0"]
    assert rows[1][6].strip() == "0.53x" and rows[1][9].strip() == "1.00x"
    goals = goals_text(results)
    assert "cached prompt tokens vs the one engine's: 0.95x (goal >= 0.9x): met" in goals
    assert "total tok/s vs round-robin: 1.50x (goal >= 1.3x): met" in goals
    assert "TTFT p50 vs round-robin: 0.40x (goal <= 0.6x): met" in goals
    assert "NOT met" in goals_text([_result("prefix", 10, 10.0, 0.5), _result("single", 95, 20.0, 0.1)])
    assert goals_text([_result("single", 95, 20.0, 0.1)]) == "Goals: not checked (no prefix run)."


def test_replica_up_lines_are_counted():
    text = ('# HELP pagedllm:router_replica_up 1 while the replica answers /health\n'
            'pagedllm:router_replica_up{replica="http://127.0.0.1:1"} 1.0\n'
            'pagedllm:router_replica_up{replica="http://127.0.0.1:2"} 0.0\n'
            'pagedllm:router_replica_up{replica="http://127.0.0.1:3"} 1.0\n')
    assert len(_REPLICA_UP.findall(text)) == 2


def test_server_flags_of_each_run():
    args = argparse.Namespace(block_size=16, model="/m", serve_args="--dtype bfloat16")
    assert cli.server_flags("single", 2, 100, args)[-5:] == ["/m", "--num-kv-blocks", "200", "--dtype", "bfloat16"]
    flags = cli.server_flags("round-robin", 2, 100, args)
    assert flags[flags.index("--data-parallel-size"):] == ["--data-parallel-size", "2", "--router", "round-robin",
                                                           "--num-kv-blocks", "100", "--dtype", "bfloat16"]


@pytest.mark.slow
def test_bench_fleet_end_to_end(tiny_llama, tmp_path):
    """The three runs on the tiny model, recorded: the prefix router keeps more of the prompts
    cached than round-robin, and no request fails."""
    record = tmp_path / "bench.md"
    argv = ["--model", tiny_llama, "--num-system-prompts", "4", "--system-tokens", "64", "--num-conversations", "8",
            "--turns", "3", "--live-conversations", "4", "--user-tokens", "16", "--max-tokens", "8",
            "--request-rate", "20", "--record", str(record)]
    parser = argparse.ArgumentParser()
    cli.build_arg_parser(parser)
    args = parser.parse_args(argv)
    args.argv, args.program = ["bench", "fleet", *argv], "pagedllm"
    table = cli.main(args)
    rows = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]]
            for row in table.splitlines()[2:]}
    blocks = next(iter(rows)).split(" x ")[1].split()[0]
    assert list(rows) == [f"2 replicas x {blocks} blocks, prefix", f"2 replicas x {blocks} blocks, round-robin",
                          f"one engine, {2 * int(blocks)} blocks"]
    assert all(cells[0] == "24" and cells[1] == "0" for cells in rows.values())
    prefix, round_robin, _single = rows.values()
    assert int(prefix[3]) > int(round_robin[3]) > 0
    text = record.read_text()
    assert "Machine: " in text and "`pagedllm bench fleet --model" in text and "Goals of the prefix router" in text
