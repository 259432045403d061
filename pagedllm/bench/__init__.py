"""The benchmarks behind `pagedllm bench ...` (``cli``): each drives the engine
through the public API (``LLM``, ``LLMEngine``, ``LLM.stats()``) or, for the
kernel and allocator benches, a module's public functions. docs/benchmarks.md
says what each measures."""
