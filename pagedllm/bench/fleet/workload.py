"""The fleet bench's workload: shared system prompts and multi-turn conversations.

Everything is drawn from one ``random.Random(seed)``, so a seed gives the same
system prompts, user messages, turn order and send times every time. The text is
English-looking sentences assembled from word banks (varied enough that the
tokenizer does not compress it the way it would a repeated phrase); lengths are
measured with the model's tokenizer. The assistant turns are not part of the
workload: each conversation's turn k+1 carries the reply the server actually gave
to turn k, so its prompt extends turn k's exactly (``Conversation.messages``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SUBJECTS = ("The support team", "Every on-call engineer", "Our billing department", "A new customer",
            "The warehouse manager", "The night-shift operator", "Each regional office", "The legal reviewer",
            "A junior analyst", "The procurement lead", "The mobile app", "Our payment gateway",
            "The quality inspector", "A returning subscriber", "The data platform", "The field technician",
            "The marketing intern", "Every store manager", "The security auditor", "The shipping partner")
VERBS = ("reviews", "updates", "documents", "escalates", "verifies", "archives", "schedules", "reconciles",
         "approves", "translates", "inspects", "summarizes", "flags", "rebuilds", "measures", "forwards",
         "cancels", "negotiates", "labels", "backs up")
OBJECTS = ("the quarterly invoices", "each shipping label", "the firmware release notes", "every open ticket",
           "the loyalty points balance", "the vendor contracts", "the temperature logs", "all refund requests",
           "the onboarding checklist", "the warranty claims", "the inventory forecast", "each password reset",
           "the delivery routes", "the accessibility report", "the customer survey answers", "the backup tapes",
           "the pricing spreadsheet", "the incident timeline", "the travel reimbursements", "the sensor readings")
TAILS = ("before the Friday deadline.", "whenever a refund exceeds {n} dollars.",
         "so that nothing is lost during the migration.", "within {n} hours of the first complaint.",
         "after checking the previous month's figures.", "unless the regional director objects.",
         "using the template stored in the shared drive.", "while the main database is being repaired.",
         "and writes a short note in the audit log.", "before anyone touches the production servers.",
         "at least {n} times per quarter.", "only when the customer has confirmed their identity.",
         "because the auditors asked for it in {month}.", "in both English and Spanish.",
         "for every order above {n} units.", "and copies the finance team on the reply.",
         "so the dashboard stays accurate.", "after the morning stand-up meeting.",
         "even when the queue is unusually long.", "on the first Monday of {month}.")
MONTHS = ("January", "March", "April", "June", "August", "October", "November", "December")
ASSISTANTS = ("Ada", "Basil", "Clio", "Dorian", "Esme", "Felix", "Greta", "Hugo", "Iris", "Jonah", "Kira", "Linus")
COMPANIES = ("Northwind Outfitters", "Bluefin Logistics", "Harbor Lane Bank", "Juniper Health", "Quarry Labs",
             "Maple Street Grocers", "Orbit Telecom", "Silverleaf Insurance", "Tidewater Energy", "Copperfield Books")
ASKS = ("Could you explain how", "Please tell me why", "Can you summarize whether", "What happens when",
        "I would like to know if", "Remind me how often")


def sentence(rng: random.Random) -> str:
    """One sentence: subject, verb, object and a varied tail (with a number or a month in some)."""
    tail = rng.choice(TAILS).format(n=rng.randrange(2, 900), month=rng.choice(MONTHS))
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {tail}"


def grow_text(first: str, rng: random.Random, count_tokens: Callable[[str], int], min_tokens: int,
              next_sentence: Callable[[random.Random], str] = sentence) -> str:
    """``first`` followed by sentences until the text is at least ``min_tokens`` tokens long."""
    text = first
    while count_tokens(text) < min_tokens:
        text += " " + next_sentence(rng)
    return text


def system_prompt(index: int, rng: random.Random, count_tokens: Callable[[str], int], min_tokens: int) -> str:
    """A support assistant's instructions: who it is, then numbered house rules."""
    company = COMPANIES[index % len(COMPANIES)]
    opening = (f"You are {rng.choice(ASSISTANTS)}, the assistant of {company} (desk {index}). "
               f"Answer briefly and politely, and follow the house rules below.")
    rule = iter(range(1, 10_000))
    return grow_text(opening, rng, count_tokens, min_tokens, lambda r: f"Rule {next(rule)}: {sentence(r)}")


def user_message(rng: random.Random, count_tokens: Callable[[str], int], min_tokens: int) -> str:
    """A question about one of the rules, with some context before it."""
    ask = f"{rng.choice(ASKS)} {rng.choice(SUBJECTS).lower()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}?"
    return grow_text(ask, rng, count_tokens, min_tokens)


@dataclass(frozen=True)
class Conversation:
    """One user's conversation: its system prompt and the user message of every turn."""

    index: int
    system_index: int
    system: str
    user_messages: tuple[str, ...]

    @property
    def turns(self) -> int:
        return len(self.user_messages)

    def messages(self, replies: Sequence[str]) -> list[dict]:
        """The chat messages of turn ``len(replies)`` (0-based): the system prompt, every
        earlier user message followed by its reply, then this turn's user message. Turn k+1's
        list therefore starts with turn k's, whatever the replies are."""
        turn = len(replies)
        if turn >= self.turns:
            raise ValueError(f"conversation {self.index} has {self.turns} turns; turn {turn} does not exist")
        messages = [{"role": "system", "content": self.system}]
        for user, reply in zip(self.user_messages, replies):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": self.user_messages[turn]})
        return messages


@dataclass(frozen=True)
class WorkloadSpec:
    """The sizes of a workload (the bench's flags)."""

    num_system_prompts: int = 8
    system_tokens: int = 512
    num_conversations: int = 32
    turns: int = 4
    live_conversations: int = 12
    user_tokens: int = 48
    max_tokens: int = 32
    request_rate: float = 4.0
    arrivals: str = "fixed"  # or "poisson"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_system_prompts", "system_tokens", "num_conversations", "turns", "live_conversations",
                     "user_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        if self.arrivals not in ("fixed", "poisson"):
            raise ValueError(f"arrivals must be 'fixed' or 'poisson', got {self.arrivals!r}")


@dataclass(frozen=True)
class Slot:
    """One request of the schedule: a conversation's turn, sent no earlier than ``offset_s``
    after the start (and, since it carries the previous reply, not before that turn ends)."""

    conversation: int
    turn: int
    offset_s: float


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: tuple[str, ...]
    system_prompt_tokens: tuple[int, ...]
    conversations: tuple[Conversation, ...]
    schedule: tuple[Slot, ...]
    longest_user_tokens: int  # the most tokens one conversation's user messages have together

    @property
    def num_requests(self) -> int:
        return len(self.schedule)

    def working_set_blocks(self, block_size: int, message_overhead: int = 6) -> int:
        """About how many KV blocks the reused prefixes take at the busiest: every system prompt
        plus ``live_conversations`` conversations at their longest (their user messages, every
        reply but the last, and ``message_overhead`` template tokens per message)."""
        systems = sum(math.ceil(tokens / block_size) for tokens in self.system_prompt_tokens)
        tail = (self.longest_user_tokens + self.spec.max_tokens * (self.spec.turns - 1)
                + message_overhead * 2 * self.spec.turns)
        live = min(self.spec.live_conversations, self.spec.num_conversations)
        return systems + live * math.ceil(tail / block_size)


def turn_order(num_conversations: int, turns: int, live: int, rng: random.Random) -> list[tuple[int, int]]:
    """(conversation, turn) pairs: ``live`` conversations are open at a time; each request
    is the next turn of one open conversation, picked at random among those that did not
    speak in the last ``live // 2`` requests (a user reads the reply before answering); a
    conversation that has had all its turns closes and the next one opens."""
    open_ = list(range(min(live, num_conversations)))
    next_to_open = len(open_)
    sent = [0] * num_conversations
    order: list[tuple[int, int]] = []
    while open_:
        recent = {c for c, _ in order[-(live // 2):]} if live // 2 else set()
        conversation = rng.choice([c for c in open_ if c not in recent] or open_)
        order.append((conversation, sent[conversation]))
        sent[conversation] += 1
        if sent[conversation] == turns:
            open_.remove(conversation)
            if next_to_open < num_conversations:
                open_.append(next_to_open)
                next_to_open += 1
    return order


def send_offsets(num: int, request_rate: float, arrivals: str, rng: random.Random) -> list[float]:
    """Send times: every ``1 / request_rate`` seconds, or a Poisson process of that rate."""
    if arrivals == "fixed":
        return [i / request_rate for i in range(num)]
    offsets, now = [], 0.0
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def build_workload(spec: WorkloadSpec, count_tokens: Callable[[str], int]) -> Workload:
    """The workload of ``spec``; ``count_tokens(text)`` is the model tokenizer's length of a text."""
    rng = random.Random(spec.seed)
    systems = tuple(system_prompt(i, rng, count_tokens, spec.system_tokens) for i in range(spec.num_system_prompts))
    conversations = tuple(
        Conversation(c, c % spec.num_system_prompts, systems[c % spec.num_system_prompts],
                     tuple(user_message(rng, count_tokens, spec.user_tokens) for _ in range(spec.turns)))
        for c in range(spec.num_conversations))
    order = turn_order(spec.num_conversations, spec.turns, spec.live_conversations, rng)
    offsets = send_offsets(len(order), spec.request_rate, spec.arrivals, rng)
    schedule = tuple(Slot(c, t, offset) for (c, t), offset in zip(order, offsets))
    longest_user = max(sum(count_tokens(m) for m in c.user_messages) for c in conversations)
    return Workload(spec, systems, tuple(count_tokens(s) for s in systems), conversations, schedule, longest_user)


def tokenizer_counter(tokenizer) -> Callable[[str], int]:
    """``count_tokens`` for ``build_workload`` from a Hugging Face tokenizer (no special tokens)."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
