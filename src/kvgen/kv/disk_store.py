"""DiskBlockStore: a directory of block files (kv/block_file.py), one engine at a time, within a budget.

    store = DiskBlockStore(directory, budget_bytes, identity)   # locks, scans headers
    store.put(key, parts, metadata) -> bool    # False: not written (disk full...), logged
    store.get(key, expected) -> parts | None   # None: absent or damaged (logged, counted, deleted)

`identity` (model fingerprint, weight mode, storage format, block size) must match a file's
metadata for the file to be used; files of another identity are left alone and never served.
An exclusive lock file (fcntl.flock) keeps a second engine out of the directory. The files are
kept least-recently-used first (file mtime, refreshed on each read, carries the order across
restarts); writing past `budget_bytes` deletes the oldest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from kvgen.kv.block_file import SUFFIX, BlockFileError, check_identity, read_block_file, read_header, write_block_file

log = logging.getLogger("kvgen.kv.disk")
LOCK_NAME = ".kvgen.lock"
FINGERPRINTS_NAME = "fingerprints.json"
READ_WORKERS, READ_AHEAD = 2, 4  # threads reading + hashing block files; files in flight


@dataclass
class DiskStats:
    bytes_written: int = 0
    bytes_read: int = 0
    files_written: int = 0
    files_read: int = 0
    files_evicted: int = 0  # deleted to keep the budget
    damaged_files: int = 0  # damaged or truncated: skipped (and deleted), never served
    mismatched_files: int = 0  # another model / format / block size: skipped, left in place
    write_errors: int = 0  # writes that failed (a full disk): the block was dropped instead


class DiskBlockStore:
    def __init__(self, directory: str | Path, budget_bytes: int, identity: dict[str, str] | None = None):
        """Creates and locks `directory` (ValueError if it cannot, or another engine holds it);
        with `identity`, also indexes its files (else call `load` once the identity is known)."""
        self.directory, self.budget_bytes, self.identity = Path(directory), int(budget_bytes), {}
        self.stats = DiskStats()
        self.entries: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self.bytes_used = 0
        self._last_stamp = 0  # the newest file mtime (ns) set or seen: stamps only go up
        self._pool: ThreadPoolExecutor | None = None
        self._lock = _take_lock(self.directory)
        if identity is not None:
            self.load(identity)

    # --- start: lock and scan ------------------------------------------------------------------
    def load(self, identity: dict[str, str]) -> None:
        """Index the directory's files of this identity (headers only), oldest use first."""
        self.identity = dict(identity)
        self.entries.clear()
        self.bytes_used = 0
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(SUFFIX + ".partial"):  # a write cut short by a crash
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                try:
                    check_identity(path, read_header(path), self.identity)
                except BlockFileError as error:
                    self._skip(path, error)
                    continue
                stat = path.stat()
                found.append((stat.st_mtime_ns, path.name.removesuffix(SUFFIX), stat.st_size))
        for stamp, key, size in sorted(found):
            self._last_stamp = max(self._last_stamp, stamp)
            self.entries[key] = size
            self.bytes_used += size
        self._enforce_budget()
        log.info("KV disk tier %s: %d blocks, %.1f MB", self.directory, len(self.entries), self.bytes_used / 2**20)

    def _skip(self, path: Path, error: BlockFileError) -> None:
        if error.mismatch:
            self.stats.mismatched_files += 1
            log.warning("skipping KV block file of another model/format: %s", error)
        else:
            self.stats.damaged_files += 1
            log.warning("skipping damaged KV block file (deleted; the block is recomputed): %s", error)
            path.unlink(missing_ok=True)

    # --- blocks ----------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def touch(self, key: str) -> None:
        """Mark a block most recently used, here and in its file's mtime (the order a restart
        reads). Callers touch a token path leaf first, so a path's first blocks are evicted last:
        a block is useless once its parent is gone."""
        self.entries.move_to_end(key)
        # An explicit, strictly increasing mtime: the kernel's file clock is coarse (a few ms),
        # and ties would leave the order across a restart to chance.
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        try:
            os.utime(self.path(key), ns=(self._last_stamp, self._last_stamp))
        except OSError:
            pass

    def put(self, key: str, parts: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
        """Write a block unless it is there already; False (logged, counted) if the write failed.
        Write a path leaf first (as eviction does), so its first blocks are the newest."""
        if key in self.entries:
            self.touch(key)
            return True
        try:
            size = write_block_file(self.path(key), parts, {**metadata, **self.identity})
        except OSError as error:
            self.stats.write_errors += 1
            log.warning("could not write KV block to %s (%s): the block is dropped instead", self.directory, error)
            return False
        self.entries[key] = size
        self.touch(key)
        self.bytes_used += size
        self.stats.bytes_written += size
        self.stats.files_written += 1
        self._enforce_budget()
        return key in self.entries

    def get(self, key: str, expected: dict[str, str]) -> dict[str, torch.Tensor] | None:
        """The block's tensors, verified; None if absent or damaged (then deleted, logged, counted)."""
        return next(self.get_path([(key, expected)]), None)

    def get_path(self, requests: list[tuple[str, dict[str, str]]]) -> Iterator[dict[str, torch.Tensor]]:
        """The verified tensors of consecutive blocks of a path, in order, stopping at the first one
        absent or damaged (deleted, logged, counted). Files are read and hashed READ_AHEAD at a
        time on worker threads (both release the GIL) while the caller imports the previous ones."""
        pending: deque[tuple[str, Future]] = deque()
        todo = iter(requests)
        try:
            while True:
                while len(pending) < READ_AHEAD and (item := next(todo, None)) is not None:
                    key, expected = item
                    if key not in self.entries:  # the path ends here: read nothing past it
                        todo = iter(())
                        break
                    pending.append((key, self._readers().submit(read_block_file, self.path(key), {**expected, **self.identity})))
                if not pending:
                    return
                key, future = pending.popleft()
                try:
                    parts, size = future.result()
                except BlockFileError as error:  # the scan vetted its identity: whatever fails now is damage
                    self.discard(key)
                    self._skip(self.path(key), BlockFileError(str(error)))
                    return
                self.entries.move_to_end(key)  # the caller touches the path it loaded, leaf first
                self.stats.bytes_read += size
                self.stats.files_read += 1
                yield parts
        finally:
            for _, future in pending:
                future.cancel()
            wait([future for _, future in pending])

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="kvgen-disk")
        return self._pool

    def discard(self, key: str) -> None:
        size = self.entries.pop(key, None)
        if size is not None:
            self.bytes_used -= size

    def _enforce_budget(self) -> None:
        while self.bytes_used > self.budget_bytes and self.entries:
            key = next(iter(self.entries))
            self.discard(key)
            self.path(key).unlink(missing_ok=True)
            self.stats.files_evicted += 1

    def close(self) -> None:
        """Release the directory lock (files stay for the next start)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


def _take_lock(directory: Path):
    advice = "pass a directory this process can create and write (--kv-cache-dir)"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / LOCK_NAME, "a+")  # noqa: SIM115 - held open for the store's lifetime
    except OSError as error:
        raise ValueError(f"kv_cache_dir {directory} is not writable ({error}): {advice}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        lock.close()
        raise ValueError(f"kv_cache_dir {directory} is not writable: {advice}")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(
            f"kv_cache_dir {directory} is in use by another kvgen engine (it holds {directory / LOCK_NAME}): "
            "give each engine its own --kv-cache-dir, or stop the other engine first"
        ) from None
    return lock


_fingerprints: dict[str, str] = {}  # "path|size|mtime_ns" -> sha256, for this process


def model_fingerprint(model_path: str | Path, cache_dir: Path) -> str:
    """sha256 of the model's file contents (every file of a folder), cached per path+size+mtime in
    memory and in `cache_dir`/fingerprints.json, so a restart does not re-read the weights."""
    root = Path(model_path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    stamp = "|".join(f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in files)
    if stamp in _fingerprints:
        return _fingerprints[stamp]
    saved_path = cache_dir / FINGERPRINTS_NAME
    try:
        saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    except (OSError, ValueError):
        saved = {}
    if stamp not in saved:
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.relative_to(root).as_posix().encode() if root.is_dir() else b"")
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
        saved[stamp] = digest.hexdigest()
        try:
            saved_path.write_text(json.dumps(saved))
        except OSError as error:
            log.warning("could not save the model fingerprint to %s: %s", saved_path, error)
    _fingerprints[stamp] = saved[stamp]
    return saved[stamp]
