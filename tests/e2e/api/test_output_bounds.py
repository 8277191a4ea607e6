"""A trusted job's output is bounded as a jailed child's is: 50 MB of prints
and 100k lines, or an exception with a 50 MB message, end cut with a note, rate
limited, with what Redis keeps for the job small, and the worker serving on.
The same attacks from inside the jail: tests/e2e/isolation/test_security_channels.py.
"""

from __future__ import annotations

import pytest
from nnsight.intervention.backends.remote import RemoteError

from tests.support.stacks.status_feed import STORED_LIMIT, logs_of, published, stored_status, the_job
from tests.support.cases.tiny_model import PROMPT


def test_a_trusted_job_printing_and_raising_50_mb_is_bounded_too(on_fs_stack, model):
    trusted = on_fs_stack
    with published(trusted) as messages:
        with model.trace(PROMPT, remote=True) as tracer:
            print("x" * 50_000_000)
            for i in range(100_000):
                print(i)
            out = model.transformer.h[0].output.save()
    assert tracer.backend.meta["isolated"] is False
    assert out.shape[0] == 1
    logs = logs_of(messages)
    assert logs[0].endswith("... [truncated: 49.9 MB more]") and len(logs[0]) <= 64 * 1024
    assert any(line.startswith("LOG output suppressed:") for line in logs)
    assert len(logs) < 3000
    assert len(stored_status(trusted, the_job(messages))) < STORED_LIMIT

    with published(trusted) as messages, pytest.raises(RemoteError) as raised:
        with model.trace(PROMPT, remote=True):
            raise ValueError("y" * 50_000_000)
    assert "ValueError: yyyy" in str(raised.value) and "[truncated: 49.9 MB more]" in str(raised.value)
    assert len(stored_status(trusted, the_job(messages))) < STORED_LIMIT

    with model.trace(PROMPT, remote=True):  # and the trusted worker still serves
        fine = model.transformer.h[0].output.save()
    assert fine.shape == out.shape
