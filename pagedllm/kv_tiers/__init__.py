"""Below the KV pool: the host-memory and disk tiers of the prefix cache
(docs/kv_tiers.md), and the KV event publisher (docs/kv_events.md)."""
