"""`pagedllm bench vision`: chat requests with one image each, half of the images seen
before, on a random Idefics3 of SmolVLM's shapes (``vision_model.py``): pagedllm with its
encoder cache on and off against Hugging Face ``generate`` on the same checkpoint and inputs.

The workload: ``n`` requests; the first ``ceil(n / 2)`` each bring a new drawing, the rest
ask a different question about one of those images (a follow-up, in shuffled order, after
all the new ones). Each prompt is SmolVLM's chat format, the image first:
``<|im_start|>User:<image>QUESTION<end_of_utterance>\\nAssistant:``, so a repeat shares the
prefix-cache blocks up to the one where its image ends and its question begins; that block
needs the image's last rows again, from the encoder cache or, with the cache off, from the
encoder. All requests go to the engine at once (``LLM.generate``); Hugging Face gets them in
order in left-padded batches of ``--hf-batch-size``, the processor called on each batch as its
model card shows.

TTFT is measured apart, one request alone at a time on each engine: new drawings (never in the
workload), each followed by a follow-up question on the same image."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.bench.tables import markdown_table
from pagedllm.bench.vision_model import drawn_image

QUESTIONS = ["What is in this picture?", "Describe the image in one sentence.", "Which colours do you see?",
             "Is there any text in the image? What does it say?", "How many shapes are there?",
             "What is at the top of the picture?", "Write a short caption for this image.",
             "Is the background light or dark?"]
TTFT_SEED_OFFSET = 100_000  # the TTFT phase's drawings: never one of the workload's


@dataclass(frozen=True)
class VisionRequest:
    image_seed: int
    question: str
    repeat: bool  # its image came in an earlier request

    @property
    def prompt(self) -> str:
        return f"<|im_start|>User:<image>{self.question}<end_of_utterance>\nAssistant:"


@dataclass
class VisionRun:
    system: str
    seconds: float
    tokens: list[list[int]]  # per request, up to and including EOS
    encoder_seconds: float | None = None
    encoder_runs: int | None = None
    ttft_new: list[float] = field(default_factory=list)
    ttft_repeat: list[float] = field(default_factory=list)
    encoder_new: list[float] = field(default_factory=list)  # encoder seconds of each TTFT request
    encoder_repeat: list[float] = field(default_factory=list)


def workload(num_requests: int, seed: int) -> list[VisionRequest]:
    """New images first (each with the next question), then one follow-up per image that has
    one (another question), shuffled."""
    distinct = (num_requests + 1) // 2
    rng = random.Random(seed)
    new = [VisionRequest(seed * 1000 + i, QUESTIONS[i % len(QUESTIONS)], False) for i in range(distinct)]
    repeats = [VisionRequest(r.image_seed, QUESTIONS[(i + 3) % len(QUESTIONS)], True)
               for i, r in enumerate(new[:num_requests - distinct])]
    rng.shuffle(repeats)
    return new + repeats


def _engine_prompt(request: VisionRequest) -> dict:
    return {"prompt": request.prompt, "multi_modal_data": {"image": drawn_image(request.image_seed)}}


def run_pagedllm(llm, label: str, requests: list[VisionRequest], output_len: int, ttft_pairs: int) -> VisionRun:
    """The TTFT pairs first (one request at a time), then the whole workload at once, prefix
    cache emptied before it; encoder seconds and runs are the ``stats()`` differences over it."""
    from pagedllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=output_len)
    llm.generate([_engine_prompt(VisionRequest(-1, QUESTIONS[0], False))], greedy, use_tqdm=False)  # warm-up
    run = VisionRun(label, 0.0, [])
    for pair in range(ttft_pairs):
        seed = TTFT_SEED_OFFSET + pair
        for request in (VisionRequest(seed, QUESTIONS[pair % len(QUESTIONS)], False),
                        VisionRequest(seed, QUESTIONS[(pair + 3) % len(QUESTIONS)], True)):
            before = llm.stats()["encoder_seconds"]
            output = llm.generate([_engine_prompt(request)], SamplingParams(temperature=0, max_tokens=1),
                                  use_tqdm=False)[0]
            ttft = output.metrics.first_token_time - output.metrics.arrival_time
            encoder = llm.stats()["encoder_seconds"] - before
            (run.ttft_repeat if request.repeat else run.ttft_new).append(ttft)
            (run.encoder_repeat if request.repeat else run.encoder_new).append(encoder)
    llm.reset_prefix_cache()
    prompts = [_engine_prompt(r) for r in requests]  # drawn before the clock starts, as HF's inputs are
    before = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    run.seconds = time.perf_counter() - started
    after = llm.stats()
    run.tokens = [list(o.outputs[0].token_ids) for o in outputs]
    run.encoder_seconds = after["encoder_seconds"] - before["encoder_seconds"]
    run.encoder_runs = after["encoder_cache_misses"] - before["encoder_cache_misses"]
    return run


def run_hugging_face(folder: str, requests: list[VisionRequest], output_len: int, batch_size: int,
                     dtype) -> VisionRun:
    """``Idefics3ForConditionalGeneration.generate`` (greedy) on left-padded batches of the
    requests in order, each batch through the checkpoint's processor; after a warm-up batch."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    eos = processor.tokenizer.eos_token_id

    def generate(batch: list[tuple[VisionRequest, object]]) -> list[list[int]]:
        inputs = processor(text=[r.prompt for r, _ in batch], images=[[image] for _, image in batch],
                           padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=output_len, do_sample=False)
        return [_until_eos(row[inputs["input_ids"].shape[1]:].tolist(), eos) for row in out]

    drawn = [(r, drawn_image(r.image_seed)) for r in requests]  # before the clock, as the engine's are
    generate(drawn[:min(2, len(drawn))])  # warm-up
    batches = [drawn[i:i + batch_size] for i in range(0, len(drawn), batch_size)]
    started = time.perf_counter()
    tokens = [row for batch in batches for row in generate(batch)]
    return VisionRun(f"Hugging Face generate (batch {batch_size})", time.perf_counter() - started, tokens)


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def format_table(runs: list[VisionRun], requests: list[VisionRequest]) -> str:
    """One row per system; the first (Hugging Face) is the speed baseline and the greedy oracle."""
    baseline = runs[0]
    ms: Callable[[list[float]], str] = lambda xs: f"{1000 * statistics.median(xs):.0f}" if xs else "-"  # noqa: E731
    rows = []
    for run in runs:
        tokens = sum(len(t) for t in run.tokens)
        same = sum(a == b for a, b in zip(run.tokens, baseline.tokens))
        ratio = (f"{statistics.median(run.ttft_repeat) / statistics.median(run.ttft_new):.2f}x"
                 if run.ttft_new and run.ttft_repeat else "-")
        rows.append([run.system, f"{run.seconds:.2f}", f"{len(requests) / run.seconds:.2f}",
                     f"{tokens / run.seconds:.1f}", f"{baseline.seconds / run.seconds:.2f}x",
                     "-" if run.encoder_seconds is None else f"{run.encoder_seconds:.2f} ({run.encoder_runs})",
                     f"{ms(run.encoder_new)} / {ms(run.encoder_repeat)}",
                     f"{ms(run.ttft_new)} / {ms(run.ttft_repeat)}", ratio,
                     "oracle" if run is baseline else f"{same}/{len(requests)}"])
    return markdown_table(["system", "seconds", "requests/s", "output tok/s", "vs HF",
                           "encoder s (runs)", "encoder ms alone, new / repeat", "TTFT p50 ms, new / repeat",
                           "TTFT repeat / new", "greedy = HF"], rows)


def describe(requests: list[VisionRequest], output_len: int, shape_name: str, ttft_pairs: int) -> str:
    repeats = sum(r.repeat for r in requests)
    return (f"Random Idefics3 of {shape_name} shapes, float32 in both. {len(requests)} chat requests with one "
            f"drawing each ({len(requests) - repeats} distinct; {repeats} later requests ask another question about "
            f"one of them), at most {output_len} greedy tokens, all submitted at once. Encoder s (runs): vision "
            f"tower + connector time and calls over the workload (`stats()['encoder_seconds']`, "
            f"`encoder_cache_misses`). TTFT and encoder ms alone: {ttft_pairs} new drawings, each followed by a "
            f"follow-up question on it, one request at a time, medians.")
