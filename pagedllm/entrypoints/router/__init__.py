"""The HTTP front of a fleet: `pagedllm router` (prefix-aware, from the replicas' KV events) and `serve --data-parallel-size` (replicas as processes or Ray actors behind it)."""
