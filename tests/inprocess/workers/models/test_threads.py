"""Torch threads per model (``workers.models.threads``): measured at load with
``NDIF_TORCH_THREADS=0``, the setting itself otherwise, set before each job."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO_ID, client_model
from workers.models import threads
from workers.models.resident import ResidentModels


@pytest.fixture
def torch_threads():
    """Whatever a test sets, torch gets its count back."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_every_core_is_kept_only_when_clearly_faster():
    assert threads.decide(0.010, 0.007, 8)[0] == 8
    assert threads.decide(0.010, 0.009, 8)[0] == 1, "10 % faster is not worth eight spinning cores"
    assert threads.decide(0.010, 0.012, 8)[0] == 1
    _, why = threads.decide(0.0123, 0.0456, 4)
    assert "12.3 ms on 1 thread" in why and "45.6 ms on 4" in why


def test_a_model_the_sample_cannot_run_keeps_every_core(torch_threads):
    assert threads.choose(torch.nn.Linear(4, 4), 4) == (4, "no token input to time")
    assert threads.choose(torch.nn.Linear(4, 4), 1) == (1, "one core")
    assert torch.get_num_threads() == torch_threads


def test_a_loaded_model_gets_a_measured_count_and_jobs_run_on_it(torch_threads):
    if torch_threads < 2:
        pytest.skip("one core here: there is nothing to choose")
    key = client_model(REPO_ID).to_model_key()
    models = ResidentModels(torch_threads=0)
    models.load(key)
    chosen = models.threads_of(key)
    assert chosen in (1, torch_threads)
    assert torch.get_num_threads() == torch_threads, "the measurement leaves torch as it found it"
    torch.set_num_threads(torch_threads + 1)  # another model's count, say
    models.threads.current = torch_threads + 1
    assert models.use(key) is models.get(key)
    assert torch.get_num_threads() == chosen


def test_a_set_count_is_used_as_it_is(torch_threads):
    key = client_model(REPO_ID).to_model_key()
    models = ResidentModels(torch_threads=3)
    models.load(key)
    assert models.threads_of(key) == 3
    models.use(key)
    assert torch.get_num_threads() == 3
