"""The parts of ``pagedllm.worker.sampler``, one module per responsibility."""
