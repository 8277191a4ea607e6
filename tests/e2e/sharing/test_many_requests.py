"""100 mixed requests in a row on one worker, every one exactly right: nothing
one request does leaks into the next."""

from __future__ import annotations

from tests.support.cases import conformance

MIX = ("read_outputs", "zero_output", "grad_single", "session", "generate_result", "source_edit", "cache_modules")


def test_hundred_mixed_requests_in_a_row(on_fs_stack, model, tmp_path, local_results):
    cases = [getattr(conformance, f"case_{name}") for name in MIX]
    expected = {case: local_results(case) for case in cases}
    for i in range(100):
        case = cases[i % len(cases)]
        got = case(model, lambda m: {"remote": True}, tmp_path)
        conformance.assert_same(got, expected[case])
