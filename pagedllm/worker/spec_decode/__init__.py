"""Speculative decoding, the runner's share: cheap proposals of the next
tokens, verified by the target model in one forward pass, so one step may
yield several tokens.

``speculator`` (what the runner calls), ``ngram`` (prompt lookup, no extra
model), ``draft_model`` (a smaller model with its own pool), ``draft_policy``
(when an n-gram draft pays for its rows), ``rejection`` (verification that
keeps the target distribution exactly). What the user asks for is
``pagedllm.config.speculative``; the scheduler's share is ``core/speculation.py``.
Nothing here imports ``worker.model_runner``: the runner calls in, never back.
"""
