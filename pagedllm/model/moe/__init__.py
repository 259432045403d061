"""Mixtures of experts: each family's router (``routers``), the stacked expert weights
and their grouped forward (``experts``), the sparse MLP block that joins them (``block``)
and the checkpoint names they load from (``names``). Only the MLP changes: attention,
norms, rope, the pool and the scheduler are the dense decoder's (issue 57)."""
