"""NDIF_ISOLATION=zygote in-process: the weight sharing underneath it, the
keyed weight check of the GPU path, a GPU child's path run jailed, and a
child that lacks a layer the operator requires refusing its request. The
zygote process itself on a real stack is tests/e2e/isolation/test_zygote.py;
a stack whose jail lacks layers it waives, tests/e2e/isolation/test_jail_required.py.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.support.cases.tiny_model import PROMPT, REPO_ID, client_model, worker_loaded


@pytest.fixture(scope="module")
def resident():
    """A model loaded as a worker loads it (``from_model_key``, dispatched)."""
    return worker_loaded()


def logits(module, ids):
    with torch.no_grad():
        return module(ids).logits


def test_shared_weights_give_the_same_model_and_a_private_copy_on_write(resident):
    from nnsight.modeling.mixins.remotable import Remotable

    from workers.isolation import shared_weights

    key, model = resident
    module = model._module
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    before = logits(module, ids)
    tied = module.lm_head.weight is module.transformer.wte.weight
    shared = shared_weights.share(module)
    # The worker's own model: same values, same Parameter objects, now in the shared file.
    assert torch.equal(logits(module, ids), before)
    assert (module.lm_head.weight is module.transformer.wte.weight) == tied
    assert shared.cpu_fd >= 0 and shared.cpu_bytes >= sum(p.nbytes for p in module.parameters())

    # What the zygote does: a skeleton from the model key, pointed at a private mapping.
    kwargs = pickle.loads(pickle.dumps({"tokenizer": model.tokenizer, "config": module.config}))
    skeleton = Remotable.from_model_key(key, dispatch=False, **kwargs)
    shared_weights.attach(skeleton._module, shared.header(), shared.cpu_fd, "cpu")
    skeleton._module.eval()
    assert not [n for n, t in skeleton._module.state_dict().items() if t.device.type == "meta"]
    assert torch.equal(logits(skeleton._module, ids), before)
    assert skeleton._module.lm_head.weight.data_ptr() == skeleton._module.transformer.wte.weight.data_ptr()

    # A write in the mapping's holder changes its own copy only.
    with torch.no_grad():
        skeleton._module.transformer.h[0].mlp.c_fc.weight.zero_()
    assert not torch.equal(logits(skeleton._module, ids), before)
    assert torch.equal(logits(module, ids), before)
    os.close(shared.cpu_fd)


def test_the_keyed_fingerprint_catches_what_a_plain_sum_misses():
    """A GPU child can write the shared weights; an adversary who swaps two
    values keeps the plain sum, not the keyed one (whose key it never sees)."""
    from workers.models import integrity

    module = torch.nn.Linear(64, 64)
    key = 123456789
    plain, keyed = integrity.fingerprint(module), integrity.keyed_fingerprint(module, key)
    assert integrity.changed(module, plain) == [] and integrity.changed(module, keyed, key=key) == []
    with torch.no_grad():
        w = module.weight.view(-1)
        w[0], w[2] = w[2].clone(), w[0].clone()  # same half of two 64-bit words
    assert module.weight.view(-1)[0] != module.weight.view(-1)[2]  # they differed
    assert integrity.changed(module, plain) == [], "a swap was expected to keep the plain sum"
    assert integrity.changed(module, keyed, key=key) == ["weight"]
    assert integrity.keyed_fingerprint(module, key + 1) != integrity.keyed_fingerprint(module, key)


# --- the zygote process on a real stack --------------------------------------------


class _ForksTheGpuWay:
    """Stands in for a zygote whose model has GPU weights: its children take
    the CUDA child's path (``workers.isolation.child.main`` with ``before_jail``), which on a
    GPU maps the weights and here does nothing else."""

    def __init__(self, model) -> None:
        self.model = model

    def fork(self, out_fd, in_fd, policy, workdir, cgroup):
        from workers.isolation.child import kill_group
        from workers.isolation.child import main as child_main

        def child() -> None:
            child_main(self.model, policy, out_fd, in_fd, workdir, cgroup, before_jail=lambda: None)

        return _ForkedFromAThread(child)


class _ForkedFromAThread:
    """The child, forked from a fresh thread that stays to reap it (this test
    process has computed with torch: GNU OpenMP's pool is per thread and not
    fork-safe, and the parent-death signal fires when the forking thread ends)."""

    def __init__(self, child) -> None:
        import threading

        self.pid, self.status = 0, None
        self._forked, self._exited = threading.Event(), threading.Event()
        threading.Thread(target=self._run, args=(child,), daemon=True).start()
        self._forked.wait()

    def _run(self, child) -> None:
        pid = os.fork()
        if pid == 0:
            child()
        self.pid = pid
        self._forked.set()
        _, self.status = os.waitpid(pid, 0)
        self._exited.set()

    def wait(self, timeout=None):
        self._exited.wait(timeout)
        return self.status

    def kill(self) -> None:
        from workers.isolation.child import kill_group

        kill_group(self.pid)


def test_the_gpu_childs_path_runs_a_request_jailed(resident, hf_home, monkeypatch):
    """No PID namespace (CUDA IPC does not cross one), no inner fork (CUDA
    cannot fork), no address-space cap: the rest of the jail and the request
    itself must work the same. Checked on a CPU model (no GPU here)."""
    import io

    import nnsight
    from nnsight.schema.request import RequestModel

    from workers.isolation import jail
    from workers.isolation import parent

    blobs = []
    original = RequestModel.serialize.__func__

    def serialize(cls, tracer, compress=False):
        blobs.append(original(cls, tracer, compress))
        return blobs[-1]

    monkeypatch.setattr(RequestModel, "serialize", classmethod(serialize))
    client = client_model(REPO_ID)
    with client.trace(PROMPT, remote="local"):  # serialized as for a server, then run here
        hidden = client.transformer.h[2].output.save()
        pid = nnsight.save(os.getpid())
    assert blobs and pid == os.getpid()

    _, model = resident
    policy = parent.IsolationPolicy(timeout_s=30, memory_bytes=8 << 30, disk_bytes=64 << 20,
                            readable=tuple(jail.readable_paths((str(hf_home / "hub"),))))
    spare = parent.Spare(model, policy, zygote=_ForksTheGpuWay(model))
    try:
        outcome = spare.run(blobs[-1], False, {}, lambda line: None)
    finally:
        spare.close()
    saved = torch.load(io.BytesIO(bytes(outcome.data)), weights_only=False)
    assert torch.equal(saved["hidden"], hidden)
    assert saved["pid"] != 1, "the child ran in a PID namespace of its own (the CPU path)"
    assert outcome.meta["jail"]["user"] in ("nobody", "root-without-capabilities")
    assert outcome.meta["jail"]["landlock_abi"] >= 4


def test_a_child_lacking_a_required_layer_refuses_the_request(resident, hf_home, tmp_path):
    """The pids cgroup root is a plain directory (no job cgroup can be made) and
    seccomp is switched off (NDIF_JAIL_DISABLE); NDIF_JAIL_REQUIRE waives
    neither: the child refuses before it reads the request, with an ERROR that
    names both layers and the setting, and so does the next child."""
    from workers.isolation import jail
    from workers.isolation import parent

    not_a_cgroup = tmp_path / "not-a-cgroup"
    not_a_cgroup.mkdir()
    _, model = resident
    policy = parent.IsolationPolicy(timeout_s=30, memory_bytes=8 << 30, disk_bytes=64 << 20,
                                     readable=tuple(jail.readable_paths((str(hf_home / "hub"),))),
                                     jail_disabled=("seccomp",), cgroup_root=str(not_a_cgroup))
    for _ in range(2):  # the spare made after a refusal is refused the same way
        spare = parent.Spare(model, policy, zygote=_ForksTheGpuWay(model))
        try:
            with pytest.raises(parent.RequestError) as refused:
                spare.run(b"never read", False, {}, lambda line: None)
        finally:
            spare.close()
        message = str(refused.value)
        assert "did not run your job" in message, message
        assert "missing jail layer(s): pids_cgroup (no writable pids cgroup controller" in message, message
        assert "seccomp (disabled by NDIF_JAIL_DISABLE)" in message, message
        assert "NDIF_JAIL_REQUIRE" in message, message
