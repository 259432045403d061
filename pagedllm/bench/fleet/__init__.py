"""`pagedllm bench fleet`: a data-parallel fleet's routing policies against one engine on a
multi-turn chat workload whose reused prefixes overflow one replica's pool.

Modules: ``workload`` (system prompts, conversations and their schedule, seeded), ``client``
(the turns sent as streamed chat completions, timed), ``report`` (per-run figures, the table,
the goals) and ``cli`` (the flags, the servers started in turn, ``main``).
"""
