"""The per-kind managers under the KV cache coordinator (``core/kv_cache_manager.py``).

One module per attention kind states its rules (``full_attention``,
``sliding_window``, ``chunked_local``; ``kinds`` names them), which the one
per-group table keeper ``core/single_type_manager.py`` asks; ``adapter_pages``
holds LoRA adapters' pages in the shared pool, pinned for the requests that run
under them, and ``tail_runs`` an int8 pool's full-precision tails, held by the
requests that write. The contiguous baseline is ``core/contiguous.py``.
"""
