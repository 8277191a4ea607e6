"""The weight check after trusted jobs (``workers.models.resident``), on the
worker's own job function in the test process (the fixtures:
tests/inprocess/workers/conftest.py).

Cheap stamps after every job, the whole fingerprint only when they show a
write, when no job waits, or every ``NDIF_TRUSTED_CHECK_EVERY``-th job; a
weight written by one job (through an nnsight edit, ``.data``, a new
storage) never reaches the next one. The fingerprint and the stamps
themselves: ``test_integrity.py``; the model's torch threads: ``test_threads.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from ndif_celery.state import jobs
from tests.support.cases.tiny_model import REPO_ID, client_model
from tests.support.cases.worker_jobs import CHECK_EVERY, PROMPT, delivered, handed_by_celery, logits, result, submit


# --- requests that write a weight, as the real client sends them -----------------------


def edit_write(model):  # an nnsight edit of a weight, in place
    with model.trace(PROMPT, remote=True):
        model.transformer.h[1].mlp.c_fc.weight[:] = 0
        out = model.lm_head.output.save()
    return out


def data_write(model):  # through .data: no version counter moves
    with model.trace(PROMPT, remote=True):
        model.transformer.h[1].mlp.c_fc.weight.data[:] = 0
        out = model.lm_head.output.save()
    return out


def storage_write(model):  # a new storage under the same parameter
    with model.trace(PROMPT, remote=True):
        weight = model.transformer.h[1].mlp.c_fc.weight
        weight.data = torch.zeros_like(weight.data)
        out = model.lm_head.output.save()
    return out


def test_an_untouched_model_passes_the_stamps_and_is_checked_whole_only_when_due(worker, redis):
    """The saving: with a job waiting, a job that wrote nothing skips the whole
    fingerprint (~0.1 s per GiB); nothing waiting, or the Nth job, runs it."""
    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)  # unchecked = 0
    assert models.check_after_trusted(key, idle=False) == ("", [])
    assert models.check_after_trusted(key, idle=True) == ("no job is waiting", [])
    for _ in range(CHECK_EVERY - 1):
        assert models.check_after_trusted(key, idle=False) == ("", [])
    why, changed = models.check_after_trusted(key, idle=False)
    assert why == f"{CHECK_EVERY} trusted jobs since the last whole check" and changed == []


def test_idle_moments_run_the_whole_check_at_most_once_a_gap(worker, redis):
    """A lone client's back-to-back jobs each leave the worker idle: the whole
    check runs in one such moment per IDLE_CHECK_GAP_S, and in the others the
    broker is not even asked whether a job waits."""
    from workers.job.executors import InProcess
    from workers.models import resident

    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    asked: list = []
    executor = InProcess(worker.settings, models, worker.deadlines, lambda model_key: asked.append(model_key))
    job = jobs.Job(id="idle-gap", model_key=key, session_id="", compress=False, env={}, received_at=time.time())
    models.restore_if_changed(key)  # a whole check: just now
    assert not models.idle_check_due(key)
    unchecked = models.resident(key).unchecked
    executor.after(job)
    assert asked == [] and models.resident(key).unchecked == unchecked + 1, "no whole check, no question"
    models.resident(key).checked_at -= resident.IDLE_CHECK_GAP_S
    assert models.idle_check_due(key)
    executor.after(job)  # nothing waits (job_waiting answers None): the whole check runs
    assert asked == [key] and models.resident(key).unchecked == 0
    assert not models.idle_check_due(key)


def test_every_job_of_a_co_batch_counts_towards_the_nth_whole_check(worker, redis):
    """A co-batch's lead checks once for all its jobs: a batch of N-1 jobs and
    then one more job make the Nth, so a write no stamp sees during a shared
    forward reaches no more jobs than one run one at a time."""
    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)
    assert models.check_after_trusted(key, idle=False, jobs=CHECK_EVERY - 1) == ("", [])
    why, changed = models.check_after_trusted(key, idle=False)
    assert why == f"{CHECK_EVERY} trusted jobs since the last whole check" and changed == []


def test_a_write_no_stamp_sees_is_caught_by_the_nth_whole_check(worker, redis):
    """The stated bound: a write through ``.data`` to a word no sample covers
    shows only in the whole fingerprint, run after the Nth trusted job."""
    from workers.models import integrity

    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)
    weight = models.get(key)._module.transformer.h[0].mlp.c_fc.weight
    words = weight.detach().reshape(-1).view(torch.int64)
    step = max(1, words.numel() // integrity.SAMPLED_WORDS)
    unsampled = step // 2  # between the first two samples
    assert 0 < unsampled < step and unsampled != words.numel() - 1
    weight.data.view(-1).view(torch.int64)[unsampled] += 1
    for _ in range(CHECK_EVERY - 1):
        assert models.check_after_trusted(key, idle=False) == ("", []), "the stamps cannot see this write"
    why, changed = models.check_after_trusted(key, idle=False)
    assert why.startswith(f"{CHECK_EVERY} trusted jobs") and changed == ["transformer.h.0.mlp.c_fc.weight"]
    assert torch.equal(models.get(key)._module.transformer.h[0].mlp.c_fc.weight.view(-1).view(torch.int64)[unsampled],
                       words[unsampled] - 1), "reloaded: the word is back"


def test_a_write_of_the_same_values_retakes_the_stamps_and_a_swap_the_sum_misses_reloads(worker, redis):
    """A counter that moved with nothing changed (``w.add_(0)``) costs one whole
    check, then the stamps are retaken; a sampled word that differs is a write
    even where the fingerprint's sum cancels (two words swapped), so the model
    is reloaded."""
    from workers import execute

    key = client_model(REPO_ID).to_model_key()
    models = worker.models
    models.restore_if_changed(key)
    model = models.get(key)
    weight = model._module.transformer.h[0].mlp.c_fc.weight
    execute.persistent_objects(model, {})  # kept, as after a request
    assert model._module in execute._PERSISTENT
    with torch.no_grad():
        weight.add_(0)
    assert models.check_after_trusted(key, idle=False) == ("a weight's version counter or storage changed", [])
    assert model._module not in execute._PERSISTENT, "the tree may have changed: read again at the next request"
    assert models.check_after_trusted(key, idle=False) == ("", []), "the stamps were retaken"
    words = weight.data.view(-1).view(torch.int64)  # through .data: no counter moves
    first, second = words[0].item(), words[1].item()
    assert first != second
    words[0], words[1] = second, first
    why, changed = models.check_after_trusted(key, idle=False)
    assert why == "a sampled word of a weight changed"
    assert changed == ["(a sampled word)"], "the sum alone cannot see a swap: the sampled word did"
    assert models.get(key)._module.transformer.h[0].mlp.c_fc.weight.view(-1).view(torch.int64)[0].item() == first


@pytest.mark.parametrize("writer", [edit_write, data_write, storage_write], ids=["nnsight-edit", "data", "storage"])
def test_a_weight_written_by_a_job_never_reaches_the_next_job(worker, web, redis, client_lm, reference, writer):
    """With the next job waiting (so the whole check is not due), the stamps
    see the write (a version counter, a sampled word, a new storage) and the
    model is reloaded before the next job's forward. Without that detection
    the next job would read the zeroed weight."""
    writing = submit(web, writer, client_lm)
    reading = submit(web, logits, client_lm)
    worker.run(handed_by_celery(redis, writing))  # and the reading job after it (the chain)
    delivered(worker)
    assert torch.equal(result(worker, redis, reading)["out"], reference)
    assert not torch.equal(result(worker, redis, writing)["out"], reference), "the write did change its own run"
    key = client_model(REPO_ID).to_model_key()
    assert torch.count_nonzero(worker.models.get(key)._module.transformer.h[1].mlp.c_fc.weight) > 0
