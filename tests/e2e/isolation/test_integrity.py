"""The keyed weight check (``workers.models.integrity``) after untrusted jobs
on a real stack; what each check sees, in-process on real torch modules, is
tests/inprocess/workers/models/test_integrity.py.

The stack test proves the worker runs the check after a failing untrusted job
(``NDIF_VERIFY_UNTRUSTED=1``), which on CPU finds nothing: the zygote maps the
weights privately there, so a child's writes never reach the worker.
"""

from __future__ import annotations

import secrets
import time

import nnsight
import pytest
import torch
from nnsight.intervention.backends.remote import RemoteError

from tests.support.cases.tiny_model import PROMPT
from workers.models import integrity

nnsight.register(__name__)  # flip_every_other_sign() runs inside remote blocks


def flip_every_other_sign(weight) -> None:
    """Negate every odd float32 element: the top bit of every other 32-bit
    word, so of each 64-bit word's high half. A plain wrapping sum of 64-bit
    words gains 2**63 per flip, and an even count cancels."""
    weight.view(-1)[1::2] *= -1


@pytest.fixture
def keyed() -> integrity.KeyedHash:
    return integrity.KeyedHash(secrets.token_bytes(32))


# --- a jailed child that really writes the worker's weights ---------------------


# --- the worker runs the check on a real stack ---------------------------------


@pytest.fixture(scope="module")
def verifying_stack(tmp_path_factory, hf_home):
    from tests.support.stacks.stack import client_on_stack

    env = {"NDIF_DEFAULT_TRUSTED": "0", "NDIF_ISOLATION": "zygote", "NDIF_VERIFY_UNTRUSTED": "1",
           "NDIF_EXECUTION_TIMEOUT_S": "20"}
    # Cold: what an untrusted child can reach of its worker is the subject.
    with client_on_stack(tmp_path_factory.mktemp("verify-untrusted"), hf_home, env, warm=False) as stack:
        yield stack


def worker_log(stack) -> str:
    return "".join(path.read_text(errors="replace") for path in stack.logs_dir.glob("worker*.log"))


def checks_logged(stack, count: int) -> str:
    """The worker's log once it shows ``count`` keyed checks (it checks after sending the answer)."""
    deadline = time.monotonic() + 30
    while worker_log(stack).count("keyed weight check") < count and time.monotonic() < deadline:
        time.sleep(0.2)
    log = worker_log(stack)
    assert log.count("keyed weight check intact") == count, stack.logs()
    return log


def test_the_worker_checks_the_weights_after_a_failing_untrusted_job(verifying_stack, model):
    """A block that edits weights in place and then raises: the job ends in a
    clear ERROR, the worker runs the keyed check after it all the same, and
    the next request is exactly right. On CPU the check finds the weights
    intact: the zygote's children map them privately, so the edit never
    reached the worker (the detection itself is tested above)."""
    with pytest.raises(RemoteError, match="after editing the weights"):
        with model.trace(PROMPT, remote=True):
            flip_every_other_sign(model.transformer.h[0].mlp.c_fc.weight)
            model.transformer.ln_f.weight[:] = 0
            raise ValueError("after editing the weights")
    log = checks_logged(verifying_stack, 1)
    assert "model reloaded" not in log
    with model.trace(PROMPT, remote=True) as tracer:
        remote = model.transformer.h[3].output.save()
    with model.trace(PROMPT):
        local = model.transformer.h[3].output.save()
    assert torch.equal(remote, local)
    assert tracer.backend.meta["isolation"] == "zygote"
    checks_logged(verifying_stack, 2)  # after the successful job too (logged once its answer is sent)
