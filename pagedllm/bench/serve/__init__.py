"""`pagedllm bench serve`: an online load generator for an OpenAI-compatible server.

Requests arrive as a Poisson process at a chosen rate and stream their completions back; for each
request the client measures the time to first token (TTFT), the time per output token after the
first (TPOT) and the end-to-end latency (e2e). The benchmark only talks HTTP, so it never loads the
model and works against any server that speaks ``/v1/completions`` with streaming.

Modules: ``stream`` (one streamed completion, read and timed), ``client`` (the arrival schedule and
the requests in flight: ``run_serve_benchmark``), ``results`` (per-request metrics, their
statistics and the table) and ``cli`` (the flags and ``main``).
"""
