"""Every conformance case, run through the real client against a real stack,
must give exactly what the same block gives locally (``torch.equal``): in every
variant (blocking or not, compressed or not, results inline, through the
filesystem store, or through S3)."""

from __future__ import annotations

import pytest

from tests import conformance



@pytest.mark.parametrize("case", conformance.CASES, ids=[c.__name__.removeprefix("case_") for c in conformance.CASES])
def test_case_matches_local(variant, case, model, tmp_path, local_results):
    expected = local_results(case)
    got = case(model, variant.remote, tmp_path)
    conformance.assert_same(got, expected)


def test_results_take_the_expected_path(variant, model, stack_for_variant, stack_pool):
    """Inline results ride the websocket; others are stored and fetched by URL."""
    with model.trace(conformance.PROMPT, **variant.remote(model)) as tracer:
        model.output.logits.save()
    meta = tracer.backend.meta
    assert meta["inline"] is variant.inline
    assert meta["isolated"] is (variant.stack in ("isolated", "zygote"))
    if meta["isolated"]:
        assert meta["isolation"] == ("zygote" if variant.stack == "zygote" else "fork")
        # This machine's kernel has every layer; the child gave up root.
        assert meta["jail"]["user"] in ("nobody", "root-without-capabilities")
        assert meta["jail"]["landlock_abi"] >= 4
    if not variant.inline:
        assert stack_pool.stored_result_exists(stack_for_variant, meta["job_id"])
