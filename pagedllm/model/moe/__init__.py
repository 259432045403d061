"""Mixtures of experts: each family's router (``routers``), the stacked expert weights and
their grouped forward (``experts``), the sparse MLP block that joins them (``block``), the
checkpoint names they load from (``names``) and the start-up line's parameter count
(``summary``). Only the MLP changes: attention, norms, rope, the pool and the scheduler are
the dense decoder's (issue 57)."""
