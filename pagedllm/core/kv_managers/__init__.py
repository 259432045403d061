"""Per-kind KV cache managers' rules (DESIGN.md): one module per attention kind."""
