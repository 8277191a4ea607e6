"""Result bytes (``workers.results.encode``) as the client reads them: small
results in one pass, big ones counted then streamed, both loadable to the same
values, a compressed one a single zstd frame that records its size."""

from __future__ import annotations

import io

import pytest
import torch
import zstandard

from workers import results


@pytest.mark.parametrize("numel", [16, (1 << 20) // 4 + 1000], ids=["small", "over 1 MiB"])
@pytest.mark.parametrize("compress", [False, True])
def test_a_result_loads_back_to_the_saved_values(numel, compress):
    saved = {"hidden": torch.arange(numel, dtype=torch.float32), "tokens": [1, 2, 3]}
    data = bytes(results.encode(saved, compress))
    if compress:
        params = zstandard.get_frame_parameters(data)
        raw = zstandard.ZstdDecompressor().decompress(data)
        assert params.content_size == len(raw), "the client's one-shot decompress needs the size in the frame"
        data = raw
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    assert torch.equal(loaded["hidden"], saved["hidden"]) and loaded["tokens"] == [1, 2, 3]
