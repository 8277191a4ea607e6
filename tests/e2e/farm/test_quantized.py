"""Quantized deployments: one repo at nf4 and at int8 side by side, each asked for
by URL (``<url>/dtype/<name>``), each equal to the client's own local run of the
model loaded the same way; on the trusted path and in jailed children (fork
and zygote). bitsandbytes runs both formats on this CPU.

Also here: what a deployment shows (its dtype, the size it was placed by and
its measured weights), fp8 refused on a CPU worker with nnsight's reason, and
a vLLM key refused as the client shows it.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.cases.tiny_model import PROMPT, REPO_ID, client_model

#: Two formats of one repo, each a deployment of its own.
HELD = ("nf4", "int8")


@pytest.fixture(scope="module", params=[pytest.param(kind, marks=pytest.mark.pools(kind))
                                        for kind in ("fs", "isolated", "zygote")])
def quantized(request, stack_pool):
    """``(kind, stack)``: a pool stack that also holds the tiny model at each of ``HELD``; evicted after."""
    stack = stack_pool.get(request.param)
    for name in HELD:
        stack.cli("deploy", REPO_ID, "--dtype", name, "--timeout", "180", check=True, timeout=240)
    yield request.param, stack
    for name in HELD:
        stack.cli("evict", REPO_ID, "--dtype", name)


def edited_reads(model, **trace):
    """Reads downstream of an in-place edit, and the logits' gradient at a layer;
    with the run's ``meta`` when it was remote."""
    with model.trace(PROMPT, **trace) as tracer:
        model.transformer.h[0].output[:, -1] = 0
        hidden = model.transformer.h[1].output
        hidden.requires_grad_(True)  # a server's weights take no gradient: the user asks for one here
        after = model.transformer.h[2].output.save()
        logits = model.output.logits.save()
        with logits.sum().backward():
            grad = hidden.grad.save()
    return {"after": after, "logits": logits, "grad": grad}, getattr(tracer.backend, "meta", None)


def generated(model, **trace):
    with model.generate(PROMPT, max_new_tokens=3, do_sample=False, **trace) as tracer:
        tokens = tracer.result.save()
    return tokens


def frozen_local(name: str):
    """The client's model loaded as ``name`` and held as the farm holds it.

    Frozen: bitsandbytes picks its kernel by whether autograd needs the
    result (``matmul_4bit``'s ``needs_grad``), so a model whose weights take
    gradients computes the last bits differently (docs/researchers.md).
    Settled (``workers.quantized``): on this CPU bitsandbytes would
    otherwise repack 4-bit weights on their first forward without gradients."""
    from workers import quantized

    model = client_model(REPO_ID, dtype=name)
    model.dispatch()
    model._module.requires_grad_(False)
    quantized.settle(model._module)
    return model


def test_each_quantized_deployment_gives_the_clients_local_values(quantized):
    kind, stack = quantized
    seen = {}
    for name in HELD:
        model = frozen_local(name)
        url = f"{stack.url}/dtype/{name}"
        remote, meta = edited_reads(model, remote=url)
        local, _ = edited_reads(model)  # the client's own model, loaded as `name`
        assert meta["isolated"] is (kind != "fs"), meta  # "isolated" and "zygote" jail every request
        for read, value in local.items():
            assert remote[read].dtype == value.dtype, (name, read)
            assert torch.equal(remote[read], value), f"{name}: {read} differs from the local run"
        assert torch.equal(generated(model, remote=url), generated(model))
        seen[name] = local["logits"]
    # Two deployments, not one: the formats compute differently (int8 in float16, nf4 in bfloat16).
    assert seen["nf4"].dtype == torch.bfloat16 and seen["int8"].dtype == torch.float16
    assert not torch.equal(seen["nf4"].float(), seen["int8"].float())


def test_status_shows_each_format_and_its_memory_estimated_within_a_quarter_of_measured(quantized):
    _, stack = quantized
    entries = [e for e in stack.farm()["deployments"].values()
               if e.get("repo_id") == REPO_ID and e.get("deployment_level") == "HOT"]
    held = {e["dtype"]: e for e in entries if e.get("dtype") in HELD}
    assert set(held) == set(HELD), entries
    for name, entry in held.items():
        assert entry["model_key"].endswith(f', "dtype": "{name}"}}')
        # Placed by the estimate (padded for activations): the estimate is what is checked.
        estimated, measured = entry["weight_bytes"], entry["measured_bytes"]
        assert measured and abs(estimated - measured) <= 0.25 * measured, (name, estimated, measured)
        assert entry["size_bytes"] > estimated
    assert held["nf4"]["measured_bytes"] < held["int8"]["measured_bytes"]
    page = stack.cli("status").stdout
    assert all(f" {name} " in page for name in HELD), page


@pytest.mark.pools("fs")
def test_fp8_on_a_cpu_worker_is_refused_with_nnsights_reason(fs_stack):
    started = time.monotonic()
    result = fs_stack.cli("deploy", REPO_ID, "--dtype", "fp8", "--timeout", "60", timeout=90)
    took = time.monotonic() - started
    try:
        assert result.returncode != 0, result.stdout
        assert 'dtype="fp8" needs a GPU of compute capability 8.9' in result.stderr, result.stderr
        assert took < 15, f"refused after {took:.1f} s"
    finally:
        fs_stack.cli("evict", REPO_ID, "--dtype", "fp8")


@pytest.mark.pools("fs")
def test_a_url_naming_no_quantization_is_refused_before_anything_is_queued(fs_stack):
    model = client_model(REPO_ID)
    with pytest.raises(Exception) as caught:
        with model.trace(PROMPT, remote=f"{fs_stack.url}/dtype/int3"):
            model.output.logits.save()
    assert "not a quantization nnsight loads" in str(caught.value)


@pytest.mark.pools("fs")
def test_a_vllm_key_is_told_there_are_no_vllm_workers(fs_stack):
    from nnsight.intervention.backends.remote import RemoteBackend
    from nnsight.modeling.vllm import VLLM
    from nnsight.util import to_import_path

    # The key VLLM(REPO_ID).to_model_key() builds; vllm itself is not installed here.
    backend = RemoteBackend(f"{to_import_path(VLLM)}:{REPO_ID}", host=fs_stack.url)
    model = client_model(REPO_ID)
    with pytest.raises(Exception) as caught:
        with model.trace(PROMPT, backend=backend):
            model.output.logits.save()
    said = str(caught.value)
    assert "no vLLM workers" in said and f"LanguageModel('{REPO_ID}')" in said, said
