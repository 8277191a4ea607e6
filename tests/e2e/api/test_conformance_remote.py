"""Every conformance case, run through the real client against a real stack,
must give exactly what the same block gives locally (``torch.equal``).

Which cases run where, and why. A case computes the same thing whichever way
the request travels; what a transport variant (``tests/support/clients/remote.py`` VARIANTS)
changes is only how the request and its result move: blocking over the
websocket or non-blocking by polling, zstd or raw, inline in the COMPLETED
frame or through the filesystem store or S3 by URL. So:

* the **main variants** run every case (``conformance.CASES``), because each
  is a different *execution* path: ``fs-blocking-zstd`` (in the worker's own
  process, result inline), ``isolated-blocking-zstd`` and ``zygote-blocking-zstd``
  (a fresh jailed child per request, its zygote forked from the fork server,
  ``NDIF_ISOLATION=fork``, or exec'd, ``=zygote``: see docs/security.md);
* the **transport-only variants** (fs raw, fs non-blocking x2, S3 x3,
  isolated and zygote non-blocking) run TRANSPORT_CASES, the cases whose requests or results stress what differs between transports: plain
  tensors (``read_outputs``), the largest single tensor (``read_logits``,
  vocabulary-wide logits), the largest and most nested result (``cache_all``,
  Cache objects of every module), several traces in one request
  (``session``), a long generation with per-step saves (``generate_streamer``),
  and a request that carries a user's class and function by value
  (``local_module``, the biggest upload, so compression of the request matters);
* ``test_results_take_the_expected_path`` runs on every variant: it proves the
  result really went the variant's way (inline or stored, isolated or not).

Nothing is lost by the split: every case still runs remotely on each execution
path, and every transport still carries results of each kind that exists
(tensors, big tensors, nested objects, lists, many traces, generation).
"""

from __future__ import annotations

import pytest

from tests.support.cases import conformance
from tests.support.clients.remote import VARIANTS

MAIN_VARIANTS = ("fs-blocking-zstd", "isolated-blocking-zstd", "zygote-blocking-zstd")

TRANSPORT_CASES = (
    conformance.case_read_outputs,
    conformance.case_read_logits,
    conformance.case_cache_all,
    conformance.case_session,
    conformance.case_generate_streamer,
    conformance.case_local_module,
)

assert set(MAIN_VARIANTS) <= {v.id for v in VARIANTS}, "a main variant is not in tests/support/clients/remote.py VARIANTS"
assert set(TRANSPORT_CASES) <= set(conformance.CASES)


def _variant_and_case():
    """Every case on the main variants, TRANSPORT_CASES on the others."""
    for variant in VARIANTS:
        cases = conformance.CASES if variant.id in MAIN_VARIANTS else TRANSPORT_CASES
        for case in cases:
            yield pytest.param(variant, case, id=f"{variant.id}-{conformance.case_id(case)}")


@pytest.mark.parametrize("variant, case", list(_variant_and_case()), indirect=["variant"])
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
