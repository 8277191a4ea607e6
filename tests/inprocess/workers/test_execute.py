"""What a request's run keeps on the model between requests
(``workers.execute``: ``persistent_objects``, ``forget_tree``), on the
worker's resident tiny model (the fixtures: tests/inprocess/workers/conftest.py).
A request's run itself, case by case: ``test_conformance_local.py`` and
``test_baseline.py`` beside this module, and end to end
``tests/e2e/api/test_conformance_remote.py``.
"""

from __future__ import annotations

from tests.support.cases.tiny_model import REPO_ID, client_model


def test_a_model_layered_by_a_requests_adapter_stays_walked_after_a_swap(worker, redis):
    """A model that took a PEFT adapter from a request's env is walked for every
    request; a swap the stamps saw drops kept objects, never that mark."""
    from workers import execute

    model = worker.models.get(client_model(REPO_ID).to_model_key())
    execute._PERSISTENT[model._module] = execute.LAYERED  # as a request with env {"peft": ...} leaves it
    try:
        execute.forget_tree(model)
        assert execute._PERSISTENT[model._module] is execute.LAYERED
        objects = execute.persistent_objects(model, {})
        assert objects["Module:model.transformer.h.0"] is model._module.transformer.h[0]
        assert execute._PERSISTENT[model._module] is execute.LAYERED, "walked, not kept"
    finally:
        execute._PERSISTENT.pop(model._module, None)
