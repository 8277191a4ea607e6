"""Every conformance case: local run == nnsight's serverless dry run of remote.

``remote="local"`` selects nnsight's ``LocalSimulationBackend``: it serializes
the request exactly as ``remote=True`` would (including ``pull_env()``'s
by-value registration of local modules), deserializes it with non-installed
modules and paths hidden, then runs the block in-process. The simulated result
is additionally passed through ``torch.save`` / ``torch.load`` the way a real
server's result blob travels, and compared exactly with a plain local run.

The cases must also be deterministic: two local runs are compared too.
"""

from __future__ import annotations

import io

import pytest
import torch
from nnsight.intervention.cache import Cache, CacheView, Entry
from nnsight.schema.request import RequestModel

from tests.support.cases.conformance import CASES, assert_same, case_id, diff, same


def local(m):
    return {}


def simulated(m):
    return {"remote": "local"}


def wire_roundtrip(result: dict) -> dict:
    """What a server's ``torch.save`` of the saves dict gives back to the client."""
    buffer = io.BytesIO()
    torch.save(result, buffer, pickle_protocol=4)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=False)


@pytest.fixture
def count_serialize(monkeypatch):
    """Counts request payloads built (proves the remote path really ran)."""
    calls = []
    original = RequestModel.serialize.__func__

    def serialize(cls, tracer, compress=False):
        blob = original(cls, tracer, compress)
        calls.append(len(blob))
        return blob

    monkeypatch.setattr(RequestModel, "serialize", classmethod(serialize))
    return calls


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_case_local_equals_simulated_remote(case, model, tmp_path, count_serialize):
    first = case(model, local, tmp_path / "local-1")
    second = case(model, local, tmp_path / "local-2")
    assert not count_serialize, "a local run built a remote payload"
    assert isinstance(first, dict) and first, "a case returns a non-empty dict"
    assert_same(first, second, "local run 1 vs local run 2")

    remote_result = case(model, simulated, tmp_path / "simulated")
    assert count_serialize, "remote='local' did not serialize a request"
    assert_same(first, remote_result, "local vs remote='local'")
    assert_same(first, wire_roundtrip(remote_result), "local vs remote='local' after torch.save")


@pytest.fixture(autouse=True)
def _case_dirs(tmp_path):
    for name in ("local-1", "local-2", "simulated"):
        (tmp_path / name).mkdir()


def test_cases_are_unique_and_named():
    names = [case_id(c) for c in CASES]
    assert len(names) == len(set(names))
    assert all(c.__name__.startswith("case_") for c in CASES)


# --- the comparator must not pass silently --------------------------------------


def test_same_accepts_equal_values():
    a = {"x": torch.arange(6.0).reshape(2, 3), "l": [1, (2.5, "s")], "f": float("nan")}
    b = {"l": [1, (2.5, "s")], "x": torch.arange(6.0).reshape(2, 3), "f": float("nan")}
    assert same(a, b)
    assert same(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))


def test_same_rejects_one_element_difference():
    a = torch.zeros(3, 4)
    b = a.clone()
    b[2, 3] = 1e-7
    assert not same(a, b)
    assert not same({"h": a}, {"h": b})
    assert not same([a, a], [a, b])
    assert "max abs diff" in diff({"h": a}, {"h": b})
    with pytest.raises(AssertionError, match=r"\['h'\]"):
        assert_same({"h": a}, {"h": b})


def test_same_rejects_different_keys_types_dtypes_shapes():
    t = torch.ones(2)
    assert not same({"a": t}, {"b": t})
    assert not same({"a": t}, {"a": t, "b": t})
    assert not same(t, t.double())
    assert not same(t, torch.ones(1, 2))
    assert not same(t, t.tolist())
    assert not same([1, 2], (1, 2))
    assert not same([1, 2], [1, 2, 3])
    assert not same(1.0, 1.0000001)
    assert not same(float("nan"), 1.0)
    assert not same("a", "b")
    assert not same(torch.tensor([1.0, float("nan")]), torch.tensor([float("nan"), 1.0]))


def _view(entries: dict) -> CacheView:
    cache = Cache.__new__(Cache)
    cache.__dict__.update(
        model=None, device=torch.device("cpu"), dtype=None, detach=True,
        non_blocking=False, include_output=True, include_inputs=False,
        targets=None, entries=entries, _open={},
    )
    return CacheView(cache, None)


def test_same_compares_caches_by_their_entries():
    a = _view({"model.h.0": [Entry(output=torch.zeros(2))]})
    b = _view({"model.h.0": [Entry(output=torch.zeros(2))]})
    assert same(a, b)
    assert same(a, wire_roundtrip({"c": b})["c"])
    assert not same(a, _view({"model.h.0": [Entry(output=torch.tensor([0.0, 1.0]))]}))
    assert not same(a, _view({"model.h.1": [Entry(output=torch.zeros(2))]}))
    assert not same(a, _view({"model.h.0": [Entry(output=torch.zeros(2))] * 2}))
    assert not same(a, _view({"model.h.0": [Entry(output=torch.zeros(2), inputs=((), {}))]}))


def test_same_compares_plain_objects_by_state():
    class Box:
        def __init__(self, value):
            self.value = value

    assert same(Box(torch.ones(2)), Box(torch.ones(2)))
    assert not same(Box(torch.ones(2)), Box(torch.zeros(2)))
