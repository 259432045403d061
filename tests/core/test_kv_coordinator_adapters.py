"""LoRA adapter pages as a kind under the KV cache coordinator: a request is admitted
only with its adapter's pages, all-or-nothing with its blocks, and lets them go
with its device blocks (finish, recompute, swap); idle pages are free and revivable."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, multiple, rule

from pagedllm.core.adapter_spec import AdapterSpec
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.test_kv_coordinator import BLOCK_SIZE, CoordinatorMachine, manager

ADAPTERS = {name: AdapterSpec(name, f"/adapters/{name}", pages) for name, pages in (("a", 2), ("b", 3), ("c", 5))}


def lora_request(request_id: str, tokens: list[int], adapter: str | None) -> Request:
    return Request(request_id, tokens, SamplingParams(), [0], max_tokens=1,
                   lora=None if adapter is None else ADAPTERS[adapter])


def whole_prompt(request: Request):
    return lambda num_cached: request.num_tokens - num_cached


def test_a_request_is_admitted_only_with_its_adapters_pages_and_leaves_the_pool_free():
    kv = manager(16, enable_lora=True)
    first = lora_request("r", list(range(8)), "c")  # 2 blocks in each of 3 groups, and 5 pages
    admitted = kv.admit(first, whole_prompt(first))
    assert admitted is not None and admitted.num_new_tokens == 8
    [load] = kv.take_adapter_loads()
    assert (load.name, load.first_block) == ("c", 11)  # a run at the top of the pool
    assert kv.num_free_blocks == 16 - 6 - 5 and kv.adapters.pinned_by.keys() == {"r"}
    kv.check_invariants({"r": 8}, swapped=())
    # Not enough blocks beside a second adapter's pages: the request waits, holding nothing.
    second = lora_request("s", list(range(20, 28)), "a")
    assert kv.admit(second, whole_prompt(second)) is None
    assert "s" not in kv.adapters.pinned_by and kv.get_block_ids("s") == [[], [], []]
    kv.check_invariants({"r": 8}, swapped=())
    kv.free("r")
    assert kv.num_free_blocks == 16 and kv.adapters.num_pinned_adapters == 0  # idle pages are free
    assert {block["adapter"] for block in kv.pool_snapshot() if block["state"] == "cached"} >= {"c"}
    again = lora_request("t", [9], "c")
    assert kv.admit(again, whole_prompt(again)) is not None
    assert [load.name for load in kv.take_adapter_loads()] == ["a"]  # "s"'s page-in, still owed; "c" revived
    assert kv.num_adapter_page_ins == 2
    kv.free("t")
    kv.check_invariants({}, swapped=())


def test_forks_share_the_pin_and_swapping_out_releases_it():
    kv = manager(32, num_swap_blocks=16, enable_lora=True, max_loras=1)
    parent = lora_request("p", [1, 2, 3, 4, 5], "b")
    assert kv.admit(parent, whole_prompt(parent)) is not None
    assert kv.fork("p", "q") == [] and kv.adapters.resident["b"].pins == 2
    other = lora_request("o", [7], "a")
    assert kv.admit(other, whole_prompt(other)) is None  # max_loras: "b" is pinned
    assert kv.swap_out("p") is not None and kv.adapters.resident["b"].pins == 1
    kv.check_invariants({"q": 5}, swapped=["p"])
    kv.free("q")
    assert kv.admit(other, whole_prompt(other)) is not None  # "b" idle now: "a" may be pinned
    parent.num_computed_tokens = 5
    assert kv.admit_swapped(parent, 1) is None  # max_loras again: "p" stays swapped, unpinned
    kv.check_invariants({"o": 1}, swapped=["p"])
    kv.free("o")
    moves, copies = kv.admit_swapped(parent, 1)
    assert moves == [] and copies == []  # its blocks were all shared with "q", so they stayed
    assert kv.adapters.pinned_by.keys() == {"p"}
    kv.check_invariants({"p": 6}, swapped=())
    kv.free("p")
    assert kv.num_free_blocks == 32


def test_an_unloaded_adapter_is_paged_in_again():
    kv = manager(16, enable_lora=True)
    req = lora_request("r", [1], "a")
    kv.admit(req, whole_prompt(req))
    try:
        kv.drop_adapter("a")
    except ValueError as error:
        assert "in use" in str(error)
    else:
        raise AssertionError("a pinned adapter was dropped")
    kv.free("r")
    kv.drop_adapter("a")
    assert kv.adapter_view() == [] and all(block.owner is None for block in kv.block_pool.blocks)
    again = lora_request("s", [1], "a")
    kv.admit(again, whole_prompt(again))
    assert kv.num_adapter_page_ins == 2
    kv.free("s")


class AdapterCoordinatorMachine(CoordinatorMachine):
    """The coordinator's operations with requests under adapters: admission pins (and
    may page in, evicting cached blocks), forks share the pin, swap-out drops it and
    swap-in takes it again, adapters are unloaded. The simulated pool also holds each
    page-in's weights: a resident adapter (pinned or idle) must still find them."""

    NUM_BLOCKS = 32

    def __init__(self) -> None:
        super().__init__()
        self.kv = manager(self.NUM_BLOCKS, num_swap_blocks=self.NUM_BLOCKS, enable_lora=True, max_loras=2)

    def _page_in(self) -> None:
        for load in self.kv.take_adapter_loads():
            num_pages = ADAPTERS[load.name].num_pages
            for block in range(load.first_block, load.first_block + num_pages):
                self.pool[block] = [("lora", load.name)] * BLOCK_SIZE

    @rule(target=CoordinatorMachine.sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20),
          adapter=st.sampled_from([None, "a", "b", "c"]), fits_budget=st.booleans())
    def admit(self, tokens, adapter, fits_budget):
        seq = f"s{next(self.ids)}"
        req = lora_request(seq, tokens, adapter)
        admitted = self.kv.admit(req, lambda num_cached: len(tokens) - num_cached if fits_budget else None)
        self._page_in()
        if admitted is None:
            assert seq not in self.kv.adapters.pinned_by and self.kv.get_block_ids(seq) == [[], [], []]
            return multiple()
        assert admitted.copies == []
        req.num_computed_tokens = admitted.num_computed_tokens
        self._write(seq, admitted.num_computed_tokens, tokens[admitted.num_computed_tokens:])
        self.kv.cache_full_blocks(req, len(tokens))
        self.requests[seq] = req
        return seq

    @rule(seq=CoordinatorMachine.sequences)
    def swap_in(self, seq):
        if seq not in self.swapped:
            return
        req = self.requests[seq]
        req.num_computed_tokens = req.num_tokens
        resumed = self.kv.admit_swapped(req, 1)
        self._page_in()
        if resumed is None:
            assert seq not in self.kv.adapters.pinned_by
            return
        moves, copies = resumed
        for host, device in moves:
            self.pool[device] = list(self.host[host])
        self.swapped.discard(seq)
        self._copy(copies)
        self.kv.truncate(seq, req.num_tokens)

    @rule(adapter=st.sampled_from(["a", "b", "c"]))
    def unload(self, adapter):
        resident = self.kv.adapters.resident.get(adapter)
        if resident is not None and resident.pins:
            return
        self.kv.drop_adapter(adapter)
        assert adapter not in self.kv.adapters.resident

    @invariant()
    def running_requests_pin_their_adapters_whose_pages_hold_their_weights(self):
        adapters = self.kv.adapters
        for seq, req in self.requests.items():
            resident = adapters.pinned_by.get(seq)
            if req.lora is None or seq in self.swapped:
                assert resident is None
            else:
                assert resident is adapters.resident[req.lora.name]
        for name, resident in adapters.resident.items():
            assert all(self.pool[page.block_id] == [("lora", name)] * BLOCK_SIZE for page in resident.pages)

    def teardown(self):
        super().teardown()  # every request freed: the pool is all free, idle adapters included
        assert self.kv.adapters.num_pinned_adapters == 0 and not self.kv.adapters.pinned_by


TestAdapterCoordinator = AdapterCoordinatorMachine.TestCase
TestAdapterCoordinator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
