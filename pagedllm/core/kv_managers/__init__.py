"""The per-kind managers under the KV cache coordinator (``core/kv_cache_manager.py``).

``adapter_pages``: LoRA adapters' pages in the shared pool, pinned for the
requests that run under them. The attention kinds (full, sliding window) live
in ``core/single_type_manager.py`` for now, the contiguous baseline in
``core/contiguous.py``.
"""
