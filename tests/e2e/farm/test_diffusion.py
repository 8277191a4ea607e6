"""nnsight's DiffusionModel served: the tiny offline Stable Diffusion pipeline
(``tests/support/cases/tiny_diffusion.py``), deployed by the operator, traced by
the real 0.8.1 client, each run equal to the client's own local run, on the
trusted path and in jailed children (fork and zygote).

The pipeline runs under ``torch.no_grad()`` (diffusers decorates its call), so
no case takes a gradient. Diffusion requests never share a forward
(``workers/cobatch/screen.py``): a shared pipeline call draws every row's
starting noise from one generator.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.cases.tiny_diffusion import DIFFUSION_PROMPT, build_tiny_diffusion, client_diffusion

#: Two denoising steps, a fixed seed, images as a tensor.
RUN = dict(num_inference_steps=2, seed=0, output_type="pt")


@pytest.fixture(scope="module", params=[pytest.param(kind, marks=pytest.mark.pools(kind))
                                        for kind in ("fs", "isolated", "zygote")])
def served(request, stack_pool, hf_home):
    """``(kind, stack, model)``: a pool stack holding the tiny pipeline, and the client's model."""
    build_tiny_diffusion(hf_home)
    model = client_diffusion()
    stack = stack_pool.get(request.param)
    stack.cli("deploy", model.to_model_key(), "--timeout", "180", check=True, timeout=240)
    yield request.param, stack, model
    stack.cli("evict", model.to_model_key())


def reads(model, **remote):
    """The UNet's noise prediction at each of two steps, and the images."""
    with model.generate(DIFFUSION_PROMPT, **RUN, **remote) as tracer:
        steps = list().save()
        for _ in tracer.iter[0:2]:
            steps.append(model.unet.output[0].clone())
        result = tracer.result.save()
    return {"step0": steps[0], "step1": steps[1], "images": result.images}, getattr(tracer.backend, "meta", None)


def edited(model, **remote):
    """The first step's noise prediction zeroed in place: the images change."""
    with model.trace(DIFFUSION_PROMPT, **RUN, **remote):
        model.unet.output[0][:] = 0
        noise = model.unet.output[0].save()
        images = model.output.save()
    return {"noise": noise, "images": images.images}, None


def seeded_by_generator(model, **remote):
    with model.trace(DIFFUSION_PROMPT, num_inference_steps=2, output_type="pt",
                     generator=torch.Generator().manual_seed(3), **remote):
        images = model.output.save()
    return {"images": images.images}, None


@pytest.mark.parametrize("case", [reads, edited, seeded_by_generator], ids=lambda case: case.__name__)
def test_a_pipeline_run_equals_the_clients_local_run(served, case):
    kind, stack, model = served
    remote, meta = case(model, remote=stack.url)
    local, _ = case(model)
    assert set(remote) == set(local)
    for name, value in local.items():
        assert torch.equal(remote[name], value), f"{name} differs from the local run"
    if meta is not None:
        assert meta["isolated"] is (kind != "fs"), meta


@pytest.mark.pools("fs")
def test_a_pipeline_naming_code_of_its_own_is_refused(fs_stack, hf_home, tmp_path):
    """A diffusers repo may name a component from a module of its own: that is its code, never run."""
    import json
    import shutil

    from tests.support.cases.tiny_diffusion import diffusion_snapshot_dir

    source = diffusion_snapshot_dir(hf_home)
    repo = "ndif-celery/tiny-sd-own-code"
    target = hf_home / "hub" / "models--ndif-celery--tiny-sd-own-code"
    if not target.exists():
        revision = source.name
        shutil.copytree(source.parent.parent, target, symlinks=True)
        index_path = target / "snapshots" / revision / "model_index.json"
        index = json.loads(index_path.read_text())
        index["unet"] = ["my_unet", "MyUNet"]  # diffusers would import my_unet.py from the repo
        index_path.unlink()
        index_path.write_text(json.dumps(index))
    key = client_diffusion(repo).to_model_key()
    result = fs_stack.cli("deploy", key, "--timeout", "60", timeout=90)
    try:
        assert result.returncode != 0
        assert "comes from 'my_unet', code of the repo's own" in result.stderr, result.stderr
    finally:
        fs_stack.cli("evict", key)
