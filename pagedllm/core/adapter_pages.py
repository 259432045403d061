"""LoRA adapters as pages of the KV pool (unified paging), and which are resident.

An adapter needs ``num_pages`` blocks with consecutive ids (``lora/page_layout.py``
says why and what goes where). While a running sequence uses it, the pager holds
one reference on each page; when the last one stops, the pages go back to the
free queue as cached blocks do, so an idle adapter is evicted least recently
used beside cached prefix blocks, and using it again before that costs nothing.
Pure bookkeeping: the runner writes the weights (``AdapterLoad``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.core.adapter_spec import AdapterLoad, AdapterSpec
from pagedllm.core.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from pagedllm.core.request import Request


@dataclass(eq=False)
class _Resident:
    """A resident adapter: the ``BlockOwner`` of its pages."""

    spec: AdapterSpec
    pages: list[KVCacheBlock]
    on_evict: Callable[[_Resident], None]  # the pager's: the adapter stops being resident
    pins: int = 0  # running sequences that use it

    @property
    def name(self) -> str:
        return self.spec.name

    def evicted(self, block: KVCacheBlock) -> None:
        self.on_evict(self)


class AdapterPager:
    """Pins adapters for running sequences, paging them in when needed.

    Safety rules:
    - ``pin_for`` is all-or-nothing: it either pins the request's adapter (paged in,
      or revived from the free queue) or changes nothing and returns False, and the
      request waits. It must be called before the request's prefix lookup, since a
      page-in may evict cached blocks.
    - Every ``pin_for`` that returned True is matched by one ``unpin_for`` when the
      sequence leaves the running state; pinned pages are never evicted.
    - ``max_loras`` (None: no cap but the pool) bounds the adapters pinned at once.
    """

    def __init__(self, pool: BlockPool, max_loras: int | None = None) -> None:
        self.pool = pool
        self.max_loras = max_loras
        self.resident: dict[str, _Resident] = {}
        self.num_pinned_adapters = 0
        self.num_page_ins = 0
        self._loads: list[AdapterLoad] = []

    def pin_for(self, request: Request) -> bool:
        """Pin ``request``'s adapter (True for a request without one); False: it cannot be now."""
        spec = request.lora
        if spec is None:
            return True
        resident = self.resident.get(spec.name)
        if resident is not None and resident.pins:
            resident.pins += 1
            return True
        if self.max_loras is not None and self.num_pinned_adapters >= self.max_loras:
            return False
        if resident is not None:
            self.pool.touch(resident.pages)
        else:
            pages = self.pool.take_run(spec.num_pages)
            if pages is None:
                return False
            resident = self.resident[spec.name] = _Resident(spec, pages, on_evict=self._evicted)
            for page in pages:
                page.owner = resident
            self._loads.append(AdapterLoad(spec.name, spec.path, pages[0].block_id))
            self.num_page_ins += 1
        resident.pins = 1
        self.num_pinned_adapters += 1
        return True

    def unpin_for(self, request: Request) -> None:
        """The sequence stopped running: drop its pin (no-op without an adapter)."""
        if request.lora is None:
            return
        resident = self.resident[request.lora.name]
        resident.pins -= 1
        if resident.pins == 0:
            self.num_pinned_adapters -= 1
            self.pool.free_blocks(resident.pages)

    def drop(self, name: str) -> None:
        """An unloaded adapter stops being resident now: its idle pages become plain
        free blocks, so a later load of the name (perhaps from another path) pages
        the new weights in instead of reviving the old ones. ``ValueError`` while a
        running sequence pins it (its pages are in use)."""
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

    def _evicted(self, resident: _Resident) -> None:
        """One free page is being reused (or the adapter was unloaded): the whole
        adapter stops being resident, and its pages become plain blocks."""
        del self.resident[resident.name]
        for page in resident.pages:
            page.owner = None

    def pages_in_use(self) -> int:
        """Pages held by pinned adapters (they count as used blocks)."""
        return sum(len(r.pages) for r in self.resident.values() if r.pins)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if a page, its adapter and the pins disagree."""
        pinned = 0
        for name, resident in self.resident.items():
            pinned += resident.pins > 0
            for page in resident.pages:
                if page.owner is not resident:
                    raise RuntimeError(f"page {page.block_id} of adapter {name!r} is owned by {page.owner!r}")
                if page.ref_cnt != (1 if resident.pins else 0):
                    raise RuntimeError(f"page {page.block_id} of adapter {name!r} has ref_cnt {page.ref_cnt} "
                                       f"with {resident.pins} pins")
        if pinned != self.num_pinned_adapters:
            raise RuntimeError(f"{pinned} adapters are pinned but {self.num_pinned_adapters} are counted")


class _NoAdapters:
    """The pager of an engine without LoRA: pins nothing, refuses a request that names an adapter."""

    def pin_for(self, request: Request) -> bool:
        if request.lora is not None:
            raise ValueError(f"request {request.request_id!r} names LoRA adapter {request.lora.name!r} but the "
                             "engine was started without enable_lora")
        return True

    def unpin_for(self, request: Request) -> None:
        return None

    def take_loads(self) -> list[AdapterLoad]:
        return []

    def check_invariants(self) -> None:
        return None


NO_ADAPTERS = _NoAdapters()
