"""Reading a block's tensors from its checkpoint or cache files into a host buffer with direct
I/O, so the disk tier never fills the page cache (See [Note: the disk tier] in
dlo.hotpath.read_ahead).

A block's tensors are grouped per file into spans (neighbours less than MERGE_GAP apart read
as one), each widened to DIRECT_ALIGNMENT at both ends and placed at an aligned offset of the
buffer: O_DIRECT needs the file offset, the length and the buffer address aligned. A span is
read in READ_CHUNK pieces by a pool of threads (`os.preadv` releases the GIL), so several
requests are in flight at once, as a disk needs to reach its rate.

Where the file system refuses O_DIRECT (EINVAL at open, or at a first probing read), the file is
read buffered and each span's pages are dropped from the page cache after its read
(POSIX_FADV_DONTNEED): the page cache still does not grow, at the cost of a copy through it.
That fallback is logged once per file with the code `direct_io_refused`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import threading
from collections.abc import Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dlo.errors import StreamingError
from dlo.host.checkpoint import Checkpoint
from dlo.host.pinned_buffer import aligned_empty
from dlo.host.safetensors_file import SafetensorsFile

logger = logging.getLogger(__name__)

DIRECT_ALIGNMENT = 4096  # the largest logical block size of common disks: file offsets, lengths and addresses
MERGE_GAP = 1 << 20  # tensors of one file closer than this are read in one span (the gap is read too)
READ_CHUNK = 4 << 20  # bytes per read request
READ_THREADS = 8  # read requests in flight: a disk needs several to reach its rate
DIRECT_IO_REFUSED = "direct_io_refused"


def _down(value: int) -> int:
    return value - value % DIRECT_ALIGNMENT


def _up(value: int) -> int:
    return _down(value + DIRECT_ALIGNMENT - 1)


@dataclass(frozen=True)
class Span:
    """Bytes [file_start, file_start + nbytes) of `file` into the buffer at `buffer_start`
    (all DIRECT_ALIGNMENT-aligned; the last span of a file may end past its end)."""

    file: SafetensorsFile
    file_start: int
    nbytes: int
    buffer_start: int


@dataclass(frozen=True)
class BlockReads:
    """Where a block's checkpoint tensors lie in the files and in its read buffer.
    `payload_bytes`: the tensors' own bytes; `nbytes`: the buffer it needs (aligned spans)."""

    spans: tuple[Span, ...]
    placed: dict[Hashable, int]  # checkpoint key (or a range's label) -> its first byte in the buffer
    payload_bytes: int

    @property
    def nbytes(self) -> int:
        last = self.spans[-1] if self.spans else None
        return last.buffer_start + last.nbytes if last is not None else 0

    @classmethod
    def plan(cls, checkpoint: Checkpoint, keys: Iterable[str]) -> BlockReads:
        """The reads of whole checkpoint tensors `keys`, each placed under its key."""
        return cls.of_ranges(
            (key, source.file, source.entry.begin, source.entry.end)
            for key in set(keys)
            for source in [checkpoint.tensors[key]]
        )

    @classmethod
    def of_ranges(
        cls, ranges: Iterable[tuple[Hashable, SafetensorsFile, int, int]], merge_gap: int = MERGE_GAP
    ) -> BlockReads:
        """The reads of byte ranges (label, file, begin, end): `placed[label]` is where the
        range's first byte lands in the buffer. Ranges less than `merge_gap` apart, or whose
        aligned spans overlap, are read as one span."""
        by_file: dict[int, list[tuple[int, int, Hashable]]] = {}
        files: dict[int, SafetensorsFile] = {}
        for label, file, begin, end in ranges:
            by_file.setdefault(id(file), []).append((begin, end, label))
            files[id(file)] = file
        spans: list[Span] = []
        placed: dict[Hashable, int] = {}
        payload = 0
        for file_id, pieces in by_file.items():
            pieces.sort(key=lambda piece: piece[:2])
            payload += sum(end - begin for begin, end, _ in pieces)
            groups = [[pieces[0]]]
            for piece in pieces[1:]:
                group_end = max(end for _, end, _ in groups[-1])
                if piece[0] - group_end < merge_gap or _down(piece[0]) < _up(group_end):
                    groups[-1].append(piece)
                else:
                    groups.append([piece])
            for group in groups:
                at = spans[-1].buffer_start + spans[-1].nbytes if spans else 0
                start, end = _down(group[0][0]), _up(max(end for _, end, _ in group))
                spans.append(Span(files[file_id], start, end - start, at))
                placed.update((label, at + begin - start) for begin, _, label in group)
        return cls(tuple(spans), placed, payload)


class ReadImage:
    """A block's checkpoint tensors as views of the read buffer they were read into (what
    `TensorSource.pieces` reads from, as it reads from the mapping)."""

    def __init__(self, checkpoint: Checkpoint, reads: BlockReads, buffer: torch.Tensor) -> None:
        self._checkpoint = checkpoint
        self._reads = reads
        self._buffer = buffer

    def view(self, key: str) -> torch.Tensor:
        entry = self._checkpoint.tensors[key].entry
        start = self._reads.placed[key]
        return self._buffer[start : start + entry.nbytes].view(entry.dtype).view(entry.shape)


class _OpenFile:
    """One file opened for the disk tier: O_DIRECT, or buffered with pages dropped after reads."""

    def __init__(self, file: SafetensorsFile) -> None:
        self.path = file.path
        self.size = file.size
        self.direct = True
        fd = None
        try:
            fd = os.open(file.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            # Some file systems accept the flag but not the I/O: one aligned read tells.
            os.preadv(fd, [aligned_empty(DIRECT_ALIGNMENT, torch.device("cpu"), DIRECT_ALIGNMENT).numpy()], 0)
            self.fd = fd
        except OSError as err:
            if fd is not None:
                os.close(fd)
            if err.errno != errno.EINVAL:
                raise StreamingError(f"cannot read {file.path} to stream blocks from disk: {err}") from None
            logger.warning(
                "dlo: %s: the file system refused O_DIRECT; disk-tier blocks are read buffered and their pages "
                "dropped after each read (%s)", file.path, DIRECT_IO_REFUSED,
            )
            self.direct = False
            self.fd = os.open(file.path, os.O_RDONLY | os.O_CLOEXEC)
        stat = os.fstat(self.fd)
        if (stat.st_dev, stat.st_ino, stat.st_size) != file.identity:
            os.close(self.fd)
            raise StreamingError(
                f"{file.path} is not the file dlo mapped at enable() (replaced or resized since): load the model again"
            )

    def read(self, into: np.ndarray, offset: int) -> int:
        """Fill `into` from `offset` (short only at the end of the file); returns the bytes read."""
        done = 0
        while done < into.size and offset + done < self.size:  # a short read ends only at the end of the file
            try:
                count = os.preadv(self.fd, [into[done:]], offset + done)
            except OSError as err:
                raise StreamingError(f"reading {self.path} at byte {offset + done} failed: {err}") from None
            if count == 0:
                break
            done += count
        if not self.direct:
            os.posix_fadvise(self.fd, offset, into.size, os.POSIX_FADV_DONTNEED)
        return done

    def close(self) -> None:
        os.close(self.fd)


class DiskReader:
    """Reads blocks' spans into buffers with READ_CHUNK requests on `threads` threads."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dlo-read")
        self._files: dict[int, _OpenFile] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    @property
    def direct(self) -> bool:
        """Every file opened so far is read with O_DIRECT."""
        with self._lock:  # the reading thread opens files as it goes
            return all(f.direct for f in self._files.values())

    def _open(self, file: SafetensorsFile) -> _OpenFile:
        with self._lock:
            opened = self._files.get(id(file))
            if opened is None:
                opened = self._files[id(file)] = _OpenFile(file)
            return opened

    def read(self, reads: BlockReads, buffer: torch.Tensor) -> None:
        """The block's spans into `buffer` (DIRECT_ALIGNMENT-aligned, at least reads.nbytes)."""
        array = buffer.numpy()
        requests = []
        for span in reads.spans:
            if span.file.private:  # no path to read: its pages are this process's memory already
                nbytes = min(span.nbytes, span.file.size - span.file_start)
                array[span.buffer_start : span.buffer_start + nbytes] = span.file.region(span.file_start, nbytes).numpy()
                continue
            opened = self._open(span.file)
            wanted = min(span.nbytes, span.file.size - span.file_start)  # the span may end past the file
            for start in range(0, span.nbytes, READ_CHUNK):
                into = array[span.buffer_start + start : span.buffer_start + min(span.nbytes, start + READ_CHUNK)]
                requests.append((opened, into, span.file_start + start, max(0, min(into.size, wanted - start))))
        futures = [self._pool.submit(opened.read, into, offset) for opened, into, offset, _ in requests]
        # Every request ends before any failure is raised: the buffer is reused after it, and a
        # request still running would write into the next read.
        concurrent.futures.wait(futures)
        for future, (opened, _, _, wanted) in zip(futures, requests):
            got = future.result()
            if got < wanted:
                raise StreamingError(f"{opened.path} ended early: read {got} of {wanted} bytes (truncated since enable()?)")
            self.bytes_read += got

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for opened in self._files.values():
                opened.close()
            self._files.clear()


def drop_cached(checkpoint: Checkpoint) -> None:
    """Take the checkpoint's pages out of this process's mapping (MADV_DONTNEED) and out of
    the page cache (POSIX_FADV_DONTNEED; pages other processes map stay): what enable() read
    through the mapping (headers, the parts placed on the device) does not stay cached under
    a host memory budget. Best effort: a file that cannot be advised is left as it is."""
    for file in checkpoint.files:
        if file.private:  # this process's own pages: nothing cached to drop
            continue
        try:
            file.advise_dontneed()
            fd = os.open(file.path, os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError) as err:
            logger.info("dlo: %s: its cached pages stay (%s)", file.path, err)
            continue
        try:
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino, stat.st_size) == file.identity:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
