"""Differential testing: pagedllm with a feature against that feature's oracle,
free-running on many real-text prompts, as a user would run it.

- ``prompts``: real English passages the tests have never seen (Python's own
  reference documentation, shipped with every CPython), of varied length.
- ``compare``: what one sequence pair and a whole run agree on (identical
  sequences, position-wise agreement, where they first diverge, score and
  per-token logprob error on the common prefix).
- ``harness``: a case is "feature X" and "its oracle", each a function from
  prompts to generations; ``run_case`` runs both and reports.
- ``cases``: the registered cases (greedy vs Hugging Face, speculation vs
  none, beam search vs HF beam search, quantized KV vs full precision), run
  by ``pagedllm bench differential`` and sliced by ``tests/differential``.
"""
