"""The disk tier: one file per block under a directory, shared, checked, bounded.

Layout: ``<dir>/<fingerprint[:32]>/<hash[:2]>/<hash>.kvblock``, where
``fingerprint`` names the model, dtype, KV dtype, block size and block layout
(``pagedllm.kv_tiers.fingerprint``), so engines of other models or layouts
never meet, and ``hash`` is the block's chained hash (hex). A file is a fixed
header then the block's bytes (``BlockCodec``)::

    magic 8 bytes | fingerprint 32 | block hash 32 | payload length u64 LE | blake2b-256 of payload 32 | payload

Safety rules:
- Writes are atomic: a temporary file in the same folder, then ``os.replace``;
  a reader (this process or another) sees the whole old file, the whole new
  one, or none. Several engines may share one directory at once.
- Every read is checked: a short file (*truncated*), a wrong checksum
  (*corrupt*), another fingerprint, block or size (*foreign*) or another
  format version (*stale*) is counted, removed, and reported as a miss: the
  block is recomputed, never served.
- A block queued for writing already counts as on disk: ``contains`` says so
  and a fetch takes the queued bytes, so a lookup right after a block is
  cached never misses for the writer's lag.
- Nothing here runs on the step path: writes go through a queue bounded in
  bytes (256 MiB) to a writer thread (a full queue drops the write and counts
  it), reads run on a reader thread that puts good blocks into the host store,
  then reports.
- Disk full or unwritable: a warning, and the tier turns itself off
  (``enabled`` False); requests carry on, served by the pool and host memory.
- ``budget_bytes``: when this process's view of the folder exceeds it, the
  least recently written or read files are removed. Files other engines
  write are found by ``contains`` (a stat) and join the view when read.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.core.block_hash import BlockHash
from pagedllm.logger import init_logger

logger = init_logger(__name__)

MAGIC = b"PGLKV\x00\x01\x00"  # the last bytes are the format version
_HEADER = struct.Struct("<8s32s32sQ32s")
_SUFFIX = ".kvblock"
# Bytes of blocks waiting for the writer at most (at least 16 blocks): past that, writes are dropped.
_WRITE_QUEUE_BYTES = 256 << 20


class DiskTier:
    """Implements ``core.tier_index.DiskCatalog`` over a directory."""

    def __init__(self, root: str, fingerprint: str, block_bytes: int, budget_bytes: int | None,
                 put: Callable[[BlockHash, torch.Tensor], None]) -> None:
        """``put(hash, payload)`` receives each block a fetch reads and checks."""
        self.fingerprint = bytes.fromhex(fingerprint)
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self.folder = os.path.join(os.path.abspath(root), fingerprint[:32])
        self._put = put
        self.enabled = True
        self.reasons: Counter[str] = Counter()  # bad files by kind
        self.counters: Counter[str] = Counter()  # files_written, bytes_written, files_read, bytes_read, ...
        self.read_seconds = 0.0
        self._files: OrderedDict[BlockHash, int] = OrderedDict()  # this process's view, LRU first
        self._files_bytes = 0  # their sizes summed (read on every step's stats: never re-summed)
        self._files_lock = threading.Lock()
        self._fetched: queue.SimpleQueue[tuple[BlockHash, str]] = queue.SimpleQueue()
        self._removed: queue.SimpleQueue[BlockHash] = queue.SimpleQueue()
        self._writes: queue.Queue = queue.Queue(maxsize=max(16, _WRITE_QUEUE_BYTES // block_bytes))
        # Blocks queued for writing: already "on disk" to a lookup, read from memory until written.
        self._pending: dict[BlockHash, torch.Tensor] = {}
        self._reads: queue.Queue = queue.Queue()
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._scan()
        except OSError as error:
            self._turn_off(f"cannot use {self.folder}: {error}")
        self._threads = [threading.Thread(target=_serve, args=(work, handle), daemon=True, name=name)
                         for work, handle, name in (
                             (self._writes, self._write_queued, "pagedllm-kv-disk-writer"),
                             (self._reads, self._read_batch, "pagedllm-kv-disk-reader"))]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------- catalog

    def path_of(self, block_hash: BlockHash) -> str:
        name = block_hash.hex()
        return os.path.join(self.folder, name[:2], name + _SUFFIX)

    def contains(self, block_hash: BlockHash) -> bool:
        return self.enabled and (block_hash in self._pending or os.path.exists(self.path_of(block_hash)))

    def fetch(self, block_hashes: list[BlockHash]) -> None:
        self._reads.put(list(block_hashes))

    def take_fetched(self) -> list[tuple[BlockHash, str]]:
        return _drain(self._fetched)

    def take_removed(self) -> list[BlockHash]:
        return _drain(self._removed)

    @property
    def num_bytes(self) -> int:
        """Bytes of the files this process knows of."""
        return self._files_bytes

    def write_behind(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Queue a block for writing; never waits (a full queue drops it)."""
        if not self.enabled:
            self._removed.put(block_hash)
            return
        try:
            self._writes.put_nowait((block_hash, payload))
            self._pending[block_hash] = payload
        except queue.Full:
            self.counters["writes_dropped"] += 1
            self._removed.put(block_hash)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write and read is done; False on timeout (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks or self._reads.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def shutdown(self) -> None:
        """Finish queued writes (bounded) and stop the threads. Safe to call twice."""
        self.flush(timeout_s=10.0)
        for work in (self._writes, self._reads):
            work.put(None)
        for thread in self._threads:
            thread.join(timeout=5.0)

    # -------------------------------------------------------------- writes

    def _write_queued(self, item: tuple[BlockHash, torch.Tensor]) -> None:
        try:
            self._write(*item)
        finally:  # written (then read from the file) or failed (then a miss)
            self._pending.pop(item[0], None)

    def _write(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        if not self.enabled:
            self._removed.put(block_hash)
            return
        path = self.path_of(block_hash)
        if os.path.exists(path):  # another engine (or an earlier run) wrote it
            self._remember(block_hash, os.path.getsize(path))
            return
        data = memoryview(payload.numpy())
        header = _HEADER.pack(MAGIC, self.fingerprint, block_hash, len(data),
                              hashlib.blake2b(data, digest_size=32).digest())
        temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:
            _remove(temporary)
            self._removed.put(block_hash)
            self._turn_off(f"writing {path} failed: {error}")
            return
        self.counters["files_written"] += 1
        self.counters["bytes_written"] += _HEADER.size + len(data)
        self._remember(block_hash, _HEADER.size + len(data))

    def _remember(self, block_hash: BlockHash, size: int) -> None:
        """Put a file at the recent end of the view; remove the oldest past the budget."""
        with self._files_lock:
            self._files_bytes += size - self._files.get(block_hash, 0)
            self._files[block_hash] = size
            self._files.move_to_end(block_hash)
            victims = []
            while self.budget_bytes is not None and self._files_bytes > self.budget_bytes and len(self._files) > 1:
                victim, victim_size = self._files.popitem(last=False)
                victims.append(victim)
                self._files_bytes -= victim_size
        for victim in victims:
            _remove(self.path_of(victim))
            self.counters["files_evicted"] += 1
            self._removed.put(victim)

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            logger.warning("KV disk tier turned off (%s); requests carry on without it", why)

    # --------------------------------------------------------------- reads

    def _read_batch(self, block_hashes: list[BlockHash]) -> None:
        """Report every block, whatever happens: a request waits until its fetch is reported."""
        for block_hash in block_hashes:
            try:
                outcome = self._read(block_hash)
            except Exception:
                logger.exception("KV disk tier: reading block %s failed; it is recomputed", block_hash.hex())
                outcome = "missing"
            self._fetched.put((block_hash, outcome))

    def _read(self, block_hash: BlockHash) -> str:
        """Check one file and hand its block to the host store: "landed", "missing" or "bad"."""
        queued = self._pending.get(block_hash)
        if queued is not None:  # not written yet: the bytes the writer holds are the block's
            self._put(block_hash, queued)
            return "landed"
        path = self.path_of(block_hash)
        started = time.perf_counter()
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                header = file.read(_HEADER.size)
                problem = self._check_header(header, block_hash, size)
                if problem is None:
                    payload = torch.empty(self.block_bytes, dtype=torch.uint8)
                    got = file.readinto(memoryview(payload.numpy()))
                    problem = "truncated" if got != self.block_bytes else None
        except FileNotFoundError:
            return "missing"
        except OSError as error:
            logger.warning("KV disk tier: reading %s failed (%s); the block is recomputed", path, error)
            return "missing"
        if problem is None:
            checksum = hashlib.blake2b(memoryview(payload.numpy()), digest_size=32).digest()
            problem = None if checksum == _HEADER.unpack(header)[4] else "corrupt"
        if problem is not None:
            self.reasons[problem] += 1
            logger.warning("KV disk tier: %s is %s; removed, the block is recomputed", path, problem)
            _remove(path)
            with self._files_lock:
                self._files_bytes -= self._files.pop(block_hash, 0)
            return "bad"
        self._put(block_hash, payload)
        self.read_seconds += time.perf_counter() - started
        self.counters["files_read"] += 1
        self.counters["bytes_read"] += size
        self._remember(block_hash, size)
        return "landed"

    def _check_header(self, header: bytes, block_hash: BlockHash, size: int) -> str | None:
        """Why the file cannot hold this block, judged by its header, or None."""
        if len(header) < _HEADER.size:
            return "truncated"
        magic, fingerprint, stored_hash, length, _ = _HEADER.unpack(header)
        if magic != MAGIC:
            return "stale" if magic[:5] == MAGIC[:5] else "foreign"
        if fingerprint != self.fingerprint or stored_hash != block_hash or length != self.block_bytes:
            return "foreign"
        if size < _HEADER.size + length:
            return "truncated"
        return None

    def _scan(self) -> None:
        """Learn the files already in the folder (a restart, another engine), oldest first."""
        found = []
        for sub in os.scandir(self.folder):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    block_hash = bytes.fromhex(entry.name.removesuffix(_SUFFIX))
                except ValueError:  # a temporary file, or not ours
                    continue
                if entry.name.endswith(_SUFFIX) and len(block_hash) == 32:
                    stat = entry.stat()
                    found.append((stat.st_mtime, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
            self._files_bytes += size


def _serve(work: queue.Queue, handle: Callable[[Any], None]) -> None:
    """A worker thread's loop: handle each item until None; every item is marked done (``flush`` waits on it)."""
    while True:
        item = work.get()
        try:
            if item is None:
                return
            handle(item)
        except Exception:  # a bug here must not end the thread: the next item is served
            logger.exception("KV disk tier: a %s failed", threading.current_thread().name)
        finally:
            work.task_done()


def _drain(source: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(source.get_nowait())
        except queue.Empty:
            return items


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
