"""`pagedllm bench fragmentation`: how much of the KV pool holds real tokens, contiguous
reservations against paged blocks, replaying the same trace through the same pool.

Modules: ``traces`` (the request traces), ``pool`` (the pool both layouts share and one
layout's allocator), ``replay`` (one layout's replay: ``simulate``), ``report`` (both layouts,
the block-size sweep, the tables), ``plots`` and ``cli`` (the flags and ``main``).

Bookkeeping only: requests are lengths, the allocators are the engine's own
``ContiguousKVCacheManager`` and ``KVCacheManager`` (prefix caching off), and no model or
tensor is involved.

Simulation rules
----------------
- Time is discrete steps. Every request arrives at step 0, or, with ``arrival_rate`` R, as a
  Poisson process of R requests per step: exponential gaps drawn from
  ``random.Random(f"{seed}:arrivals")``, arrival step = floor of the arrival time.
- A request that can never fit is rejected when it arrives: one longer than
  ``max_model_len``; under contiguous, one whose reservation is larger than the pool; under
  paged, one whose final length needs more blocks than the pool has.
- Each step, in this order:

  1. Decode: every running request, in admission order, grows by one token
     (``allocate_slots(rid, length, 1)``). A paged request that gets no block stalls for the
     step; if every running request stalls, the latest admitted one is preempted: freed, put
     back at the head of the queue keeping its tokens (recompute re-prefills all of them), and
     counted.
  2. Admission, first come first served with head-of-line blocking: the queue head is admitted
     when ``allocate_slots(rid, 0, tokens)`` succeeds (tokens = ``prompt_len``, or all a
     preempted request had); the first refusal ends admission for the step. A step that
     preempted admits nobody, so the freed blocks go to the stalled requests and not straight
     back to the request just evicted.
  3. Measure the pool: this is the state the step's forward pass would run on.
  4. Departure: a request that holds ``prompt_len + output_len`` tokens is freed.

  The replay ends when every request has departed or been rejected.
- Contiguous reservations (``reservation``): ``max`` reserves ``max_model_len`` slots per
  request (the PagedAttention paper's baseline and the toy allocator's); ``pow2`` the next
  power of two of the final length and ``oracle`` the final length itself (the paper's
  Orca (Pow2) and Orca (Oracle), which assume the output length is known in advance), both
  capped at ``max_model_len``. Under ``max`` every run has the same length and starts at a
  multiple of it, so every hole except the pool's tail is a whole number of runs: external
  fragmentation needs reservations of different sizes.

Metrics (per layout)
--------------------
- ``waste_percent`` = 100 * (held - needed) / held, summed over served requests at their
  final length: held = slots of the blocks the request holds when it departs (contiguous:
  its whole reservation; paged: ceil(len / B) * B), needed = prompt_len + output_len.
- ``internal_percent``: mean over steps of the slots held but holding no token (the empty
  part of reservations, or of paged last blocks), as % of the pool.
- ``external_percent``: mean over steps of the free slots in steps where admission stopped at
  a queue head that the free slots would fit in total (so no single hole fits it), as % of
  the pool. A paged admission fails only when too few blocks are free, so paged measures 0.
- ``delayed``: first admitted at a later step than it arrived.
- The block-size sweep keeps the pool's size in tokens and scales ``num_blocks``. Waste
  depends only on which requests are served and their final lengths, and every request
  that can fit is served in the end (an empty pool admits it), so the sweep computes waste
  and block-table entries from the trace directly instead of replaying it.
"""
