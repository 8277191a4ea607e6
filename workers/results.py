"""Result bytes exactly as the nnsight 0.8.1 client reads them.

``torch.save`` of the saved-values dict; zstd as ONE frame with its content
size when the request was compressed (the client's one-shot decompress needs
it). An inline result rides in a pickled ``ResponseModel`` dict: a binary
websocket frame.
"""

from __future__ import annotations

import io
import mmap

import torch
import zstandard

from ndif_celery import wire
from workers import adapters


def encode(saved: dict, compress: bool) -> memoryview:
    """The result bytes, made without a second full copy of them in memory.

    A big result: ``torch.save`` runs twice, once into a sink that only
    counts, to learn the size, then into memory sized for it (mapped, so only
    what is written becomes resident), through a zstd stream that records that
    size in its frame. Peak memory is the saved tensors plus one copy of the
    result, instead of the tensors, the raw bytes and the compressed bytes at
    once. A small one (most): the counting pass keeps its bytes, and is all.
    A 0.5 client reads its result uncompressed, whatever its request was.
    """
    compress = compress and adapters.current().RESULTS_COMPRESSED
    size = _CountingSink(keep=_SMALL)
    torch.save(saved, size, pickle_protocol=4)
    if size.kept is not None:
        raw = size.kept.getbuffer()
        return memoryview(zstandard.ZstdCompressor(level=3).compress(raw) if compress else bytes(raw))
    if compress:
        out = _MappedSink(_zstd_bound(size.n))
        with _COMPRESSOR.stream_writer(out, size=size.n, closefd=False) as writer:
            torch.save(saved, _Unseekable(writer), pickle_protocol=4)
    else:
        out = _MappedSink(size.n)
        torch.save(saved, _Unseekable(out), pickle_protocol=4)
    return out.view()


_SMALL = 1 << 20  # up to this, the counting pass keeps the bytes: one pass, no streaming

# Level 3: zstd's default balance of speed and size; every core, since a big result is on the request's path.
_COMPRESSOR = zstandard.ZstdCompressor(level=3, threads=-1)


def _zstd_bound(n: int) -> int:
    # ZSTD_COMPRESSBOUND, plus room for the frame header.
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 1024


class _CountingSink(io.RawIOBase):
    """Counts what is written; keeps it too (``kept``) while it is within ``keep`` bytes."""

    def __init__(self, keep: int = 0) -> None:
        self.n = 0
        self.keep = keep
        self.kept: "io.BytesIO | None" = io.BytesIO() if keep else None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        length = memoryview(data).nbytes
        self.n += length
        if self.kept is not None:
            if self.n <= self.keep:
                self.kept.write(data)
            else:
                self.kept = None  # too big to keep: counted only
        return length


class _Unseekable(io.RawIOBase):
    """Hides ``seek``/``tell`` so ``torch.save`` writes its zip strictly in order
    (the counting pass saw the same, so both passes write the same bytes)."""

    def __init__(self, sink) -> None:
        self.sink = sink

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sink.write(data)
        return memoryview(data).nbytes


class _MappedSink(io.RawIOBase):
    """Anonymous memory of a fixed capacity, filled in order."""

    def __init__(self, capacity: int) -> None:
        self.map = mmap.mmap(-1, max(capacity, 1))
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        end = self.n + view.nbytes
        if end > len(self.map):
            raise ValueError("result larger than its measured size")
        self.map[self.n:end] = view
        self.n = end
        return view.nbytes

    def view(self) -> memoryview:
        return memoryview(self.map)[: self.n]


def completed_frame(job_id: str, description: str, data: bytes, meta: dict) -> bytes:
    """A pickled COMPLETED response carrying the result inline."""
    buffer = io.BytesIO()
    torch.save(
        {"id": job_id, "status": wire.COMPLETED, "description": description, "data": bytes(data), "meta": meta},
        buffer,
        pickle_protocol=4,
    )
    return buffer.getvalue()
