"""Result bytes exactly as the nnsight 0.8.1 client reads them.

``torch.save`` of the saved-values dict; zstd as ONE frame with its content
size when the request was compressed (the client's one-shot decompress needs
it). An inline result rides in a pickled ``ResponseModel`` dict: a binary
websocket frame.
"""

from __future__ import annotations

import io

import torch
import zstandard

from ndif_celery import wire


def encode(saved: dict, compress: bool) -> bytes:
    buffer = io.BytesIO()
    torch.save(saved, buffer, pickle_protocol=4)
    raw = buffer.getbuffer()
    if compress:
        return zstandard.ZstdCompressor(level=3).compress(raw)
    return bytes(raw)


def completed_frame(job_id: str, description: str, data: bytes, meta: dict) -> bytes:
    """A pickled COMPLETED response carrying the result inline."""
    buffer = io.BytesIO()
    torch.save(
        {"id": job_id, "status": wire.COMPLETED, "description": description, "data": data, "meta": meta},
        buffer,
        pickle_protocol=4,
    )
    return buffer.getvalue()
