"""The adapter-pages kind: LoRA adapters as pages of the KV pool (unified paging),
and which are resident. The coordinator (``core/kv_cache_manager.py``) drives it
beside its KV cache groups, so the scheduler never talks to it.

An adapter needs ``num_pages`` blocks with consecutive ids (``lora/page_layout.py``
says why and what goes where). While a request holding device blocks uses it,
it holds one reference on each page; when the last such request lets go, the
pages go back to the free queue as cached blocks do, so an idle adapter is
evicted least recently used beside cached prefix blocks, and using it again
before that costs nothing. Pure bookkeeping: the runner writes the weights
(``AdapterLoad``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from pagedllm.core.adapter_spec import AdapterSpec
from pagedllm.core.block_moves import AdapterLoad
from pagedllm.core.block_pool import BlockPool, KVCacheBlock


class ResidentAdapter:
    """A resident adapter: the ``BlockOwner`` of its pages. Its eviction callback
    is given here, when it is made; the pool hands it its pages (``take_run``)."""

    def __init__(self, spec: AdapterSpec, on_evict: Callable[[ResidentAdapter], None]) -> None:
        self.spec = spec
        self._on_evict = on_evict  # the manager's: the adapter stops being resident
        self.pages: list[KVCacheBlock] = []
        self.pins = 0  # requests holding device blocks that run under it

    @property
    def name(self) -> str:
        return self.spec.name

    def evicted(self, block: KVCacheBlock) -> None:
        self._on_evict(self)


class AdapterPages:
    """Pins adapters for requests, paging them in when needed.

    Safety rules:
    - ``pin`` is all-or-nothing: it either pins the request's adapter (paged in,
      or revived from the free queue) or pins nothing and returns False, and the
      request waits. A page-in it makes stays, idle, when the caller then unpins.
    - A pin is keyed by request id: ``unpin`` releases it (a no-op for a request
      that holds none), so every path that frees a request's device blocks may call it.
    - Pinned pages are never evicted. ``max_loras`` (None: no cap but the pool)
      bounds the adapters pinned at once.
    - ``enabled`` False (an engine without LoRA): a request that names an adapter
      is refused with ``ValueError``.
    """

    def __init__(self, pool: BlockPool, max_loras: int | None = None, enabled: bool = True) -> None:
        self.pool = pool
        self.max_loras = max_loras
        self.enabled = enabled
        self.resident: dict[str, ResidentAdapter] = {}
        self.pinned_by: dict[str, ResidentAdapter] = {}  # request id -> the adapter it pins
        self.num_pinned_adapters = 0
        self.num_page_ins = 0
        self._loads: list[AdapterLoad] = []

    def pin(self, request_id: str, spec: AdapterSpec | None) -> bool:
        """Pin adapter ``spec`` for ``request_id`` (True at once for no adapter); False: it cannot be now."""
        if spec is None:
            return True
        if not self.enabled:
            raise ValueError(f"request {request_id!r} names LoRA adapter {spec.name!r} but the engine was "
                             "started without enable_lora")
        resident = self.resident.get(spec.name)
        if resident is None or not resident.pins:
            if self.max_loras is not None and self.num_pinned_adapters >= self.max_loras:
                return False
            resident = self._page_in(spec) if resident is None else self._revive(resident)
            if resident is None:
                return False
            self.num_pinned_adapters += 1
        resident.pins += 1
        self.pinned_by[request_id] = resident
        return True

    def _revive(self, resident: ResidentAdapter) -> ResidentAdapter:
        self.pool.touch(resident.pages)
        return resident

    def _page_in(self, spec: AdapterSpec) -> ResidentAdapter | None:
        resident = ResidentAdapter(spec, on_evict=self._evicted)
        pages = self.pool.take_run(spec.num_pages, resident)
        if pages is None:
            return None
        resident.pages = pages
        self.resident[spec.name] = resident
        self._loads.append(AdapterLoad(spec.name, spec.path, pages[0].block_id))
        self.num_page_ins += 1
        return resident

    def share(self, parent_id: str, child_id: str) -> None:
        """A fork: ``child_id`` pins its parent's adapter too (never fails: the parent holds it)."""
        resident = self.pinned_by.get(parent_id)
        if resident is not None:
            resident.pins += 1
            self.pinned_by[child_id] = resident

    def unpin(self, request_id: str) -> None:
        """The request let go of its device blocks: drop its pin, if it holds one."""
        resident = self.pinned_by.pop(request_id, None)
        if resident is None:
            return
        resident.pins -= 1
        if resident.pins == 0:
            self.num_pinned_adapters -= 1
            self.pool.free_blocks(resident.pages)

    def drop(self, name: str) -> None:
        """An unloaded adapter stops being resident now: its idle pages become plain
        free blocks, so a later load of the name (perhaps from another path) pages
        the new weights in instead of reviving the old ones. ``ValueError`` while a
        request pins it (its pages are in use)."""
        resident = self.resident.get(name)
        if resident is None:
            return
        if resident.pins:
            raise ValueError(f"LoRA adapter {name!r} is in use by {resident.pins} running sequences")
        self._evicted(resident)

    def take_loads(self) -> list[AdapterLoad]:
        """The page-ins since the last call, in order (the runner performs them)."""
        loads, self._loads = self._loads, []
        return loads

    def _evicted(self, resident: ResidentAdapter) -> None:
        """One free page is being reused (or the adapter was unloaded): the whole
        adapter stops being resident, and its pages become plain blocks."""
        del self.resident[resident.name]
        self.pool.disown(resident.pages)

    def view(self) -> list[dict]:
        """The resident adapters for the live pool view: name, pages, first block, pins."""
        return [{"name": name, "pages": len(resident.pages), "first_block": resident.pages[0].block_id,
                 "pinned_by": resident.pins} for name, resident in list(self.resident.items())]

    def check_invariants(self, holders: Collection[str]) -> None:
        """Raise ``RuntimeError`` if a page, its adapter and the pins disagree, or a
        pin is held by a request outside ``holders`` (those with device blocks)."""
        pins = {name: 0 for name in self.resident}
        for request_id, resident in self.pinned_by.items():
            if request_id not in holders:
                raise RuntimeError(f"request {request_id!r} pins LoRA adapter {resident.name!r} but holds no blocks")
            if self.resident.get(resident.name) is not resident:
                raise RuntimeError(f"request {request_id!r} pins LoRA adapter {resident.name!r}, which is not resident")
            pins[resident.name] += 1
        for name, resident in self.resident.items():
            if resident.pins != pins[name]:
                raise RuntimeError(f"LoRA adapter {name!r} counts {resident.pins} pins but {pins[name]} requests hold it")
            for page in resident.pages:
                if page.owner is not resident:
                    raise RuntimeError(f"page {page.block_id} of adapter {name!r} is owned by {page.owner!r}")
                if page.ref_cnt != (1 if resident.pins else 0):
                    raise RuntimeError(f"page {page.block_id} of adapter {name!r} has ref_cnt {page.ref_cnt} "
                                       f"with {resident.pins} pins")
        for block in self.pool.blocks:
            owner = block.owner
            if isinstance(owner, ResidentAdapter) and self.resident.get(owner.name) is not owner:
                raise RuntimeError(f"block {block.block_id} is owned by LoRA adapter {owner.name!r}, "
                                   "which is not resident")
        pinned = sum(1 for resident in self.resident.values() if resident.pins)
        if pinned != self.num_pinned_adapters:
            raise RuntimeError(f"{pinned} adapters are pinned but {self.num_pinned_adapters} are counted")
