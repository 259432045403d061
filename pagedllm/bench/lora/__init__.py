"""`pagedllm bench lora`: multi-LoRA throughput (issue 44) on the default model.

The same real-text requests run on the base model and with requests spread
round-robin over N rank-r adapters (1, 8, 64, 256 by default). Every LoRA run gets
the memory a fixed-slot design (vLLM's ``max_loras``) would spend on 8 adapter
slots on top of the base run's KV pool, and no cap on resident adapters: with more
adapters than that budget holds, they are paged in and out of the pool.

Modules: ``adapters`` (random PEFT folders written with safetensors, reused across
runs), ``runs`` (the workload, one timed run per engine, the page-in probe) and
``cli`` (the flags, the rows in order, the table and the record).
"""
