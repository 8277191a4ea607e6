"""The weight checks (``workers.models.integrity``): what each one sees, in-process on
real torch modules.

The keyed check exists for a GPU zygote's child, which maps the worker's
weights writable through CUDA IPC. There is no GPU here, so the detection is
proven in-process on CPU tensors (the same code runs on both), including a
real jailed child on the GPU child's path that writes the worker's weights
through a shared mapping, exactly as a CUDA IPC mapping lets it. That the
worker runs the check after a failing untrusted job is
tests/e2e/isolation/test_integrity.py.
"""

from __future__ import annotations

import os
import secrets
import threading
import types

import nnsight
import pytest
import torch

from tests.support.cases.tiny_model import PROMPT, REPO_ID, client_model, worker_loaded
from workers.models import integrity

nnsight.register(__name__)  # flip_every_other_sign() runs inside remote blocks


def flip_every_other_sign(weight) -> None:
    """Negate every odd float32 element: the top bit of every other 32-bit
    word, so of each 64-bit word's high half. A plain wrapping sum of 64-bit
    words gains 2**63 per flip, and an even count cancels."""
    weight.view(-1)[1::2] *= -1


@pytest.fixture(scope="module")
def loaded():
    """The tiny GPT-2 as a worker loads it (``from_model_key``, dispatched)."""
    return worker_loaded()


@pytest.fixture
def keyed() -> integrity.KeyedHash:
    return integrity.KeyedHash(secrets.token_bytes(32))


class WithRotary(torch.nn.Module):
    """A small module with a non-persistent buffer, as rotary embeddings keep ``inv_freq``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(48, 40)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)


def test_an_untouched_model_passes(loaded, keyed):
    _, model = loaded
    module = model._module
    expected = keyed.fingerprint(module)
    assert integrity.changed(module, expected, key=keyed) == []
    assert integrity.changed(module, integrity.fingerprint(module)) == []
    # Every parameter and buffer, under every name (tied ones twice).
    names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
    assert set(expected) == names


def test_an_even_number_of_sign_flips_is_caught(loaded, keyed):
    _, model = loaded
    module = model._module
    weight = module.transformer.h[0].mlp.c_fc.weight
    plain, expected = integrity.fingerprint(module), keyed.fingerprint(module)
    with torch.no_grad():
        flip_every_other_sign(weight)
    try:
        assert (weight.numel() // 2) % 2 == 0, "the test needs an even number of flips"
        assert integrity.changed(module, plain) == [], "the plain sum was expected to miss this (see its docstring)"
        assert integrity.changed(module, expected, key=keyed) == ["transformer.h.0.mlp.c_fc.weight"]
    finally:
        with torch.no_grad():
            flip_every_other_sign(weight)
    assert integrity.changed(module, expected, key=keyed) == []


def test_a_swap_of_two_values_is_caught(keyed):
    module = torch.nn.Linear(64, 64)
    plain, expected = integrity.fingerprint(module), keyed.fingerprint(module)
    with torch.no_grad():
        w = module.weight.view(-1)
        assert w[0] != w[2]
        w[0], w[2] = w[2].clone(), w[0].clone()
    assert integrity.changed(module, plain) == [], "the plain sum was expected to miss a swap"
    assert integrity.changed(module, expected, key=keyed) == ["weight"]


def test_a_single_bit_flip_in_every_byte_position_is_caught(keyed):
    """Every bit of every byte of a 64-bit word, at the start of a tensor
    and at its very end (past several blocks, in the odd last byte)."""
    module = torch.nn.Module()
    module.register_buffer("floats", torch.randn(1 << 20))  # 4 MiB: several blocks on a CPU
    module.register_buffer("odd", torch.randint(-128, 127, (4097,), dtype=torch.int8))  # an odd byte count
    expected = keyed.fingerprint(module)
    for name, positions in (("floats", range(8)), ("floats", range(4 * (1 << 20) - 8, 4 * (1 << 20))),
                            ("odd", range(4097 - 8, 4097))):
        raw = getattr(module, name).view(torch.uint8)
        for position in positions:
            for bit in range(8):
                raw[position] ^= 1 << bit
                assert integrity.changed(module, expected, key=keyed) == [name], (name, position, bit)
                raw[position] ^= 1 << bit
    assert integrity.changed(module, expected, key=keyed) == []


def test_a_change_in_a_non_persistent_buffer_is_caught(keyed):
    module = WithRotary()
    assert "inv_freq" not in module.state_dict()
    plain, expected = integrity.fingerprint(module), keyed.fingerprint(module)
    module.inv_freq.mul_(2)
    assert integrity.changed(module, expected, key=keyed) == ["inv_freq"]
    assert integrity.changed(module, plain) == ["inv_freq"]


def test_a_change_in_a_tied_weight_is_caught_under_both_names(loaded, keyed):
    _, model = loaded
    module = model._module
    assert module.lm_head.weight is module.transformer.wte.weight, "the tiny GPT-2 ties its embeddings"
    expected = keyed.fingerprint(module)
    row = module.lm_head.weight[7]
    saved = row.clone()
    with torch.no_grad():
        row[[0, 1]] = row[[1, 0]].clone()  # a swap within one row
    try:
        assert integrity.changed(module, expected, key=keyed) == ["lm_head.weight", "transformer.wte.weight"]
    finally:
        with torch.no_grad():
            row.copy_(saved)


def test_different_keys_give_different_fingerprints():
    module = WithRotary()
    key = secrets.token_bytes(32)
    one, again = integrity.KeyedHash(key).fingerprint(module), integrity.KeyedHash(key).fingerprint(module)
    other = integrity.KeyedHash(secrets.token_bytes(32)).fingerprint(module)
    assert one == again
    for name in one:
        assert one[name][2] != other[name][2], name
    assert all(0 <= value < (1 << 31) - 1 for _, _, lanes in one.values() for value in lanes)


# --- a jailed child that really writes the worker's weights ---------------------


class _GpuWayForker:
    """Forks children the way a GPU zygote does (``workers.isolation.child.main`` with
    ``before_jail``: no PID namespace, no inner fork), from this process,
    whose model lives in a ``MAP_SHARED`` file (``shared_weights.share``), so
    the child's writes reach this process's weights, as a CUDA IPC mapping's
    do."""

    def __init__(self, model) -> None:
        self.model = model

    def fork(self, out_fd, in_fd, policy, workdir, cgroup):
        from workers.isolation.child import kill_group
        from workers.isolation.child import main as child_main

        child = types.SimpleNamespace(pid=0, status=None)
        forked, done = threading.Event(), threading.Event()

        def run() -> None:  # a fresh thread (OpenMP), which stays to reap the child
            pid = os.fork()
            if pid == 0:
                child_main(self.model, policy, out_fd, in_fd, workdir, cgroup, before_jail=lambda: None)
                os._exit(70)
            child.pid = pid
            forked.set()
            child.status = os.waitpid(pid, 0)[1]
            done.set()

        threading.Thread(target=run, daemon=True).start()
        forked.wait()
        child.kill = lambda: kill_group(child.pid)
        child.wait = lambda timeout=None: child.status if done.wait(timeout) else None
        return child


def blob_of(block) -> bytes:
    """The request the real client sends for ``block(client)`` (serialized as for a server)."""
    from nnsight.schema.request import RequestModel

    blobs = []
    original = RequestModel.serialize.__func__

    def serialize(cls, tracer, compress=False):
        blobs.append(original(cls, tracer, compress))
        return blobs[-1]

    RequestModel.serialize = classmethod(serialize)
    try:
        block(client_model(REPO_ID))
    except Exception:  # noqa: BLE001 - the block raises, as it does remotely; only its bytes matter here
        pass
    finally:
        RequestModel.serialize = classmethod(original)
    assert blobs
    return blobs[-1]


def test_a_child_that_writes_the_weights_and_fails_gets_the_model_reloaded(hf_home):
    """The worker's own code after an untrusted job (``executors.Isolated.after``),
    against a jailed child that flips signs in pairs in the worker's weights and raises."""
    from ndif_celery import config
    from workers.execute import RequestError
    from workers.isolation import jail
    from workers.isolation import parent
    from workers.job import executors
    from workers.models.resident import ResidentModels

    def attack(client) -> None:
        with client.trace(PROMPT, remote="local"):
            flip_every_other_sign(client.transformer.h[1].mlp.c_proj.weight)
            raise ValueError("after editing the weights")

    key = client_model(REPO_ID).to_model_key()
    models = ResidentModels(verify_untrusted=True)
    models.load(key)
    model = models.get(key)
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    with torch.no_grad():
        before = model._module(ids).logits
    models.resident(key).share()  # the weights in a MAP_SHARED file, as for a zygote
    policy = parent.IsolationPolicy(timeout_s=30, memory_bytes=8 << 30, disk_bytes=64 << 20,
                            readable=tuple(jail.readable_paths((str(hf_home / "hub"),))))
    with pytest.raises(RequestError, match="after editing the weights"):
        parent.run(model, blob_of(attack), False, {}, policy, lambda line: None, zygote=_GpuWayForker(model))
    assert parent.wait_reaped(10)
    with torch.no_grad():
        assert not torch.equal(model._module(ids).logits, before), "the child's write was expected to reach the worker"

    job = types.SimpleNamespace(id="attack", model_key=key)
    executors.Isolated(config.load(), models, watchdog=None).after(job)  # after() arms no deadline
    reloaded = models.get(key)
    assert reloaded is not model, "the model was not reloaded"
    with torch.no_grad():
        assert torch.equal(reloaded._module(ids).logits, before)
    assert models.check_after_untrusted(key) == []
    models.evict(key)


# --- the worker runs the check on a real stack ---------------------------------


def test_the_plain_check_read_again_gives_the_whole_fingerprint_and_sees_every_write(monkeypatch):
    """``PlainFingerprint`` reads small tensors together and large ones alone:
    its numbers are ``fingerprint``'s, and a changed bit, a ``.data`` write, a
    new storage and an unaligned tensor show on either road."""
    module = WithRotary()
    module.register_buffer("flag", torch.tensor([True, False, True]))  # 3 bytes: no whole word
    module.register_buffer("odd", torch.arange(11, dtype=torch.int16)[1:])  # starts 2 bytes into its storage
    monkeypatch.setattr(integrity, "SMALL_BYTES", 1000)  # proj.weight (7,680 bytes) is read alone
    plain = integrity.PlainFingerprint(module)
    assert plain.read(module) == integrity.fingerprint(module) == plain.expected
    assert plain._large and plain._small  # both roads taken
    assert plain.changed(module) == []
    written: set = set()
    for name, write, undo in [
        ("proj.weight", lambda: module.proj.weight.data.view(torch.int32)[0, 3].__ixor__(1),
         lambda: module.proj.weight.data.view(torch.int32)[0, 3].__ixor__(1)),
        ("proj.bias", lambda: module.proj.bias.data.__setitem__(39, 2.0), None),
        ("inv_freq", lambda: module.inv_freq.view(torch.int32)[7].__ixor__(1 << 31), None),
        ("flag", lambda: module.flag.__setitem__(1, True), None),
        ("odd", lambda: module.odd.__setitem__(0, 99), None),
    ]:
        write()
        written.add(name)
        assert plain.changed(module) == sorted(written), name
        if undo is not None:
            undo()
            written.discard(name)
            assert plain.changed(module) == sorted(written), name
    fresh = integrity.PlainFingerprint(module)  # what it reads now is the new normal
    module.proj.bias.data = module.proj.bias.data.clone()  # same values, another storage
    assert fresh.changed(module) == ["proj.bias"]


def test_named_tensors_are_torchs_parameters_then_buffers_under_every_name():
    """One walk of the modules gives what named_parameters then named_buffers give
    (duplicates kept): a tied weight under both names, a buffer outside state_dict."""
    _, loaded = worker_loaded()
    model = loaded._module
    model.register_buffer("not_persistent", torch.ones(2), persistent=False)
    expected = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    found = list(integrity.named_tensors(model))
    assert [name for name, _ in found] == [name for name, _ in expected]
    assert all(a is b for (_, a), (_, b) in zip(found, expected))
    assert "lm_head.weight" in dict(found) and "transformer.wte.weight" in dict(found)
