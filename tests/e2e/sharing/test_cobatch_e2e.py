"""Co-batching end to end: the real nnsight client, a real stack, one worker.

The worker is held busy by one slow job while sixteen users submit at once
(threads; blocking and non-blocking clients), each with a block of its own:
different prompts and lengths, edits, saves, ``.source`` reads and edits, a
skip, an early stop, ``tracer.cache()``, a block that raises, ``generate``
with ``max_new_tokens`` and ``tracer.iter``. Then the slow job is killed and
the next job gathers the others (``workers.job.gather``). Every user gets what the
same block gives run locally: exactly (``torch.equal``), or, where its forward
was shared with requests of other lengths (``meta["cobatch"]`` > 1), within the
engine's stated tolerance (``tests.support.clients.load.COBATCH_TOLERANCE``, measured in tests/inprocess/workers/cobatch/test_engine.py, 1e-5 absolute
on float values; token ids always exact). The raising user gets its own error,
and ``meta`` shows that requests shared forwards.

Then, per architecture (GPT-2 through ``.source``, a tiny OPT-style and a tiny
Mixtral-style model built like the test GPT-2), a dozen users at once whose
values are flattened over rows and positions (GPT-2's ``Conv1D`` internals,
OPT's MLP, Mixtral's router logits): each gets its local run, none holds a
row of a canary user's values, and two users who write every value they
reach by every road (``.data``, ``set_``, a view, the storage) change no one
else's result.

Also: an untrusted job (auth on, a key without the ``trusted`` tag) is never
merged: it runs in its jailed child while the trusted jobs queued around it
share a forward. All on the shared auth farm (tests/support/stacks/stack_pool.py).
With ``NDIF_COBATCH_MAX=1`` each waiting job runs alone:
tests/inprocess/workers/job/test_gather.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial
from unittest import mock

import httpx
import nnsight
import pytest
import redis
import torch
from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

from ndif_celery.state import queues
from tests.support.cases import conformance
from tests.support.clients.load import COBATCH_TOLERANCE as TOLERANCE
from tests.support.clients.load import compile_one_at_a_time
from tests.support.clients.remote import PollUntilDone, client_pointed_at, final_status, poll, slow_job, wait_status
from tests.support.cases.tiny_model import PROMPT, REPO_ID, build_tiny_gpt2, client_model

pytestmark = pytest.mark.pools("auth")

GEN = dict(max_new_tokens=4, do_sample=False)
RAISED = "user 9 asked for this error"
# The tiny tokenizer gives these two the same token length (9): generates share only at one length.
GEN_A = "Madison Square Garden is located in the city of"
GEN_B = "The quick brown fox jumps over the lazy dog"


# --- the sixteen users' blocks: ``run`` is {} locally, the remote kwargs remotely ------


def u_read(model, run):
    with model.trace("The quick brown fox jumps over the lazy dog", **run) as tracer:
        hidden = model.transformer.h[2].output.save()
    return {"hidden": hidden}, tracer


def u_logits(model, run):
    with model.trace("The lazy dog jumps over the quick brown fox", **run) as tracer:
        logits = model.lm_head.output.save()
    return {"logits": logits}, tracer


def u_zero(model, run):
    with model.trace(PROMPT, **run) as tracer:
        model.transformer.h[0].mlp.output[:] = 0
        hidden = model.transformer.h[3].output.save()
        logits = model.lm_head.output.save()
    return {"hidden": hidden, "logits": logits}, tracer


def u_scale(model, run):
    with model.trace("Hello world", **run) as tracer:
        model.transformer.h[1].output = model.transformer.h[1].output * 2
        last = model.transformer.h[-1].output.save()
    return {"last": last}, tracer


def u_source_read(model, run):
    with model.trace("Paris is the capital of", **run) as tracer:
        mlp = model.transformer.h[0].mlp.source
        act_in = mlp.self_act_0.input.save()
        act_out = mlp.self_act_0.output.save()
    return {"act_in": act_in, "act_out": act_out}, tracer


def u_source_edit(model, run):
    with model.trace("Rome is the capital of", **run) as tracer:
        model.transformer.h[0].mlp.source.self_act_0.output[:] = 0
        mlp_out = model.transformer.h[0].mlp.output.save()
        logits = model.output.logits.save()
    return {"mlp_out": mlp_out, "logits": logits}, tracer


def u_skip(model, run):
    with model.trace("Berlin is the capital of", **run) as tracer:
        mlp = model.transformer.h[0].mlp.source
        mlp.self_act_0.skip(mlp.self_c_fc_0.output * 0.5)
        block = model.transformer.h[0].output.save()
    return {"block": block}, tracer


def u_stop(model, run):
    with model.trace("The cat sat on the mat", **run) as tracer:
        early = model.transformer.h[1].output.save()
        tracer.stop()
    return {"early": early}, tracer


def u_cache(model, run):
    with model.trace("A dog ran in the park", **run) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[3], "model.transformer.h.7"])
    return {"cache": cache}, tracer


def u_raises(model, run):
    with model.trace("client nine asks about the city of", **run) as tracer:
        hidden = model.transformer.h[1].output.save()  # noqa: F841
        raise ValueError(RAISED)
    return {}, tracer


def u_generate(model, run):
    with model.generate(GEN_A, **GEN, **run) as tracer:
        ids = tracer.result.save()
    return {"ids": ids}, tracer


def u_generate_iter(model, run):
    with model.generate(GEN_B, **GEN, **run) as tracer:
        hiddens = nnsight.save([])
        for step in tracer.iter[:3]:
            hiddens.append(model.transformer.h[0].output[:, -1])
        ids = tracer.result.save()
    return {"hiddens": hiddens, "ids": ids}, tracer


def u_two_invokes(model, run):
    with model.trace(**run) as tracer:
        with tracer.invoke(PROMPT):
            a = model.transformer.h[2].output.save()
        with tracer.invoke("Hello world"):
            b = model.lm_head.output.save()
    return {"a": a, "b": b}, tracer


def u_plain_saves(model, run):
    with model.trace("client thirteen asks about the city of", **run) as tracer:
        shape = nnsight.save(tuple(model.transformer.h[-1].output.shape))
        top = model.lm_head.output[:, -1].argmax(dim=-1).save()
        print("user 13 was here")
    return {"shape": shape, "top": top}, tracer


def u_mean(model, run):
    with model.trace("client fourteen asks about the capital", **run) as tracer:
        mean = model.lm_head.output.mean(dim=-1).save()
    return {"mean": mean}, tracer


def u_edit_in_place(model, run):
    with model.trace("The Colosseum is in Rome", **run) as tracer:
        model.transformer.h[5].output[:, 0] = 0
        after = model.transformer.h[6].output.save()
    return {"after": after}, tracer


USERS = [u_read, u_logits, u_zero, u_scale, u_source_read, u_source_edit, u_skip, u_stop, u_cache, u_raises,
         u_generate, u_generate_iter, u_two_invokes, u_plain_saves, u_mean, u_edit_in_place]


def _local(model, user):
    """What the block gives run locally: its saves, or its error's text."""
    try:
        saves, _ = user(model, {})
        return saves
    except ValueError as error:
        return f"ValueError: {error}"


_exact = conformance._tensor_diff


def _tolerant(a: torch.Tensor, b: torch.Tensor, path: str):
    """conformance's tensor comparison, with the engine's tolerance on float values."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return _exact(a, b, path)
    if a.is_floating_point():
        worst = (a.detach().cpu() - b.detach().cpu()).abs().max().item() if a.numel() else 0.0
        return None if worst <= TOLERANCE else f"{path}: max abs diff {worst!r} > {TOLERANCE}"
    return _exact(a, b, path)


def _diff(got, want, shared_forward: bool):
    """None when the same: exactly, or within TOLERANCE where the forward was shared."""
    exact = conformance.diff(got, want)
    if exact is None or not shared_forward:
        return exact
    with mock.patch.object(conformance, "_tensor_diff", _tolerant):
        return conformance.diff(got, want)


# --- users of three architectures: values flattened over rows and positions -------

CANARY = "Zyxwvut canary passphrase hunter2 Zyxwvut"
PROMPTS = ["Hello world", "The cat sat on the mat", "Paris is the capital of",
           "Madison Square Garden is located in the city of", "The quick brown fox jumps over the lazy dog",
           "One, two, three, four, five, six, seven, eight, nine, ten.", "Big Ben is a famous clock tower",
           "Water boils at one hundred degrees", "She walked to the market to buy apples, bread, milk and cheese."]


def gpt2_reads(model, run, prompt):
    with model.trace(prompt, **run) as tracer:
        c_fc = model.transformer.h[0].mlp.c_fc.source  # x.view(-1, d) and addmm: [rows x positions, d]
        flat_in = c_fc.x_view_0.output.save()
        flat_out = c_fc.torch_addmm_0.output.save()
        act = model.transformer.h[1].mlp.source.self_act_0.output.save()
        logits = model.lm_head.output.save()
    return {"flat_in": flat_in, "flat_out": flat_out, "act": act, "logits": logits}, tracer


def gpt2_writes(model, run, prompt):
    with model.trace(prompt, **run) as tracer:
        model.transformer.wpe.input.data[:] = 0  # the positions: this user's rows, or every row's
        model.transformer.h[0].mlp.c_fc.source.torch_addmm_0.output.data.mul_(2)  # flattened
        model.transformer.h[0].output.data[:, 0] = 1.0
        h1 = model.transformer.h[1].output
        h1.set_(h1 * 0.5)
        model.transformer.h[2].output.view(-1)[:7] = 3.0
        model.transformer.h[3].output.untyped_storage().fill_(0)
        logits = model.lm_head.output.save()
    return {"logits": logits}, tracer


def opt_reads(model, run, prompt):
    with model.trace(prompt, **run) as tracer:
        layer = model.model.decoder.layers[0]
        fc1 = layer.fc1.output.save()  # [rows x positions, ffn]
        fc2 = layer.fc2.output.save()
        hidden = model.model.decoder.layers[1].output.save()
        logits = model.lm_head.output.save()
    return {"fc1": fc1, "fc2": fc2, "hidden": hidden, "logits": logits}, tracer


def opt_writes(model, run, prompt):
    with model.trace(prompt, **run) as tracer:
        model.model.decoder.embed_positions.inputs[1]["position_ids"].data[:] = 0
        layer = model.model.decoder.layers[0]
        layer.self_attn.output[0].data.mul_(0.5)
        layer.fc1.output.data[:] = 0
        fc2 = layer.fc2.output
        fc2.set_(fc2 + 1.0)
        layer.output.view(-1)[:5] = 2.0
        model.model.decoder.layers[1].output.untyped_storage().fill_(0)
        logits = model.lm_head.output.save()
    return {"logits": logits}, tracer


def mixtral_reads(model, run, prompt):
    with model.trace(prompt, **run) as tracer:
        moe = model.model.layers[0].mlp
        router = moe.gate.output[0].save()  # [rows x positions, experts]
        hidden = model.model.layers[0].output.save()
        logits = model.lm_head.output.save()
    return {"router": router, "hidden": hidden, "logits": logits}, tracer


def mixtral_writes(model, run, prompt):
    with model.trace(prompt, **run) as tracer:
        cos, sin = model.model.rotary_emb.output
        cos.data.mul_(0.5)  # the rotary table: this user's rows, or every row's
        model.model.layers[0].mlp.gate.output[0].data[:, 0] = 5.0
        hidden = model.model.layers[0].output
        hidden.set_(hidden * 2)
        model.model.layers[1].self_attn.output[0].view(-1)[:9] = 0.0
        model.model.layers[1].output.untyped_storage().fill_(0)
        logits = model.lm_head.output.save()
    return {"logits": logits}, tracer


ARCHITECTURES = {"gpt2": (gpt2_reads, gpt2_writes), "opt": (opt_reads, opt_writes),
                 "mixtral": (mixtral_reads, mixtral_writes)}


def _rows(value) -> list[torch.Tensor]:
    """Every float tensor in a saved value, as rows of its last dimension."""
    if isinstance(value, torch.Tensor):
        return [value.detach().reshape(-1, value.shape[-1])] if value.is_floating_point() and value.dim() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [rows for item in value for rows in _rows(item)]
    return []


def _holds_a_row_of(saves, canary_saves) -> bool:
    theirs = {}
    for rows in _rows(canary_saves):
        theirs.setdefault(rows.shape[-1], []).append(rows)
    for rows in _rows(saves):
        for other in theirs.get(rows.shape[-1], []):
            if (rows[:, None, :] == other[None, :, :]).all(-1).any():
                return True
    return False


# --- running users at once against a busy worker ------------------------------------


def _depth(stack) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return sum(row["depth"] for row in queues.summary(client))
    finally:
        client.close()


def _at_once(stack, model, calls: list) -> list:
    """Hold the worker with a slow job, submit ``calls`` from threads until all
    wait in the queue, kill the slow job; each call's (result, meta) or its error."""
    slow = slow_job(model, steps=2400)  # 2 min of sleep, killed below
    key = nnsight.CONFIG.API.APIKEY
    wait_status(stack.url, slow.job_id, "RUNNING", headers={"ndif-api-key": key} if key else None)
    answers: list = [None] * len(calls)

    def client(i: int) -> None:
        try:
            answers[i] = calls[i]()
        except Exception as error:  # noqa: BLE001 - what the user gets, checked below
            answers[i] = error

    threads = [threading.Thread(target=client, args=(i,), name=f"user-{i}") for i in range(len(calls))]
    with compile_one_at_a_time():  # (CPython 3.11's parser and client threads: see tests/support/clients/load.py)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while _depth(stack) < len(calls):
            assert time.monotonic() < deadline, f"only {_depth(stack)} of {len(calls)} jobs queued\n{stack.logs()}"
            time.sleep(0.1)
        assert "cancelling on" in stack.cli("kill", slow.job_id).stdout
        for thread in threads:
            thread.join(240)
            assert not thread.is_alive(), f"{thread.name} got no answer\n{stack.logs()}"
    return answers


def _remote(model, user, blocking: bool, api_key=None):
    """A call of ``user`` through the real client: (saves, meta)."""
    def call():
        if blocking and api_key is None:
            run = {"remote": True}
        elif blocking:
            run = {"backend": RemoteBackend(model.to_model_key(), api_key=api_key, env=model._remoteable_get_env())}
        else:
            run = {"backend": PollUntilDone(model, api_key=api_key)}
        saves, tracer = user(model, run)
        return saves, dict(tracer.backend.meta or {})
    return call


# --- the stacks -------------------------------------------------------------------------

def _key(stack, email: str, *flags: str) -> str:
    result = stack.cli("keys", "create", "--email", email, *flags)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def auth_stack(stack_pool, model):
    """The shared auth farm: auth on, per-key limits off (sixteen jobs of one key
    at once); the client holds a trusted key; ``stack.untrusted`` is a key
    without the tag."""
    stack = stack_pool.get("auth")
    with client_pointed_at(stack.url):
        nnsight.CONFIG.API.APIKEY = _key(stack, "trusted@example.org", "--trusted")
        stack.untrusted = _key(stack, "untrusted@example.org")
        _remote(model, u_read, True)()  # the first request deploys the model
        yield stack


def test_sixteen_users_at_once_each_get_their_own_answer(auth_stack, model):
    expected = [_local(model, user) for user in USERS]
    assert isinstance(expected[USERS.index(u_raises)], str)
    calls = [_remote(model, user, blocking=i % 2 == 0) for i, user in enumerate(USERS)]
    answers = _at_once(auth_stack, model, calls)

    metas = {}
    for user, want, got in zip(USERS, expected, answers):
        name = user.__name__
        if user is u_raises:
            assert isinstance(got, RemoteError) and RAISED in str(got), got
            assert "ValueError" in str(got), str(got)
            continue
        assert not isinstance(got, BaseException), f"{name}: {got!r}"
        saves, meta = got
        metas[name] = meta
        assert meta.get("isolated") is False, (name, meta)
        found = _diff(saves, want, meta.get("cobatch", 1) > 1)
        assert found is None, f"{name} ({meta}): {found}"
    shared = {name: meta["cobatch"] for name, meta in metas.items() if meta.get("cobatch", 1) > 1}
    print("co-batched:", shared, "alone:", {n: m.get("cobatch_solo") for n, m in metas.items() if n not in shared})
    # Fifteen of sixteen were waiting when the lead started: most share forwards.
    assert len(shared) >= 8 and max(shared.values()) >= 4, metas
    assert "skips a module" in metas["u_skip"]["cobatch_solo"], metas["u_skip"]
    assert len({meta["job_id"] for meta in metas.values()}) == len(metas)


def test_an_untrusted_job_is_never_merged(auth_stack, model):
    users = [u_read, u_logits, u_zero, u_mean]
    expected = [_local(model, user) for user in users]
    calls = [_remote(model, user, blocking=True, api_key=auth_stack.untrusted) for user in users[:2]]
    calls += [_remote(model, user, blocking=i % 2 == 0) for i, user in enumerate(users[2:])]
    answers = _at_once(auth_stack, model, calls)
    for i, (user, want, (saves, meta)) in enumerate(zip(users, expected, answers)):
        assert conformance.diff(saves, want) is None or (i >= 2 and _diff(saves, want, True) is None), user
        if i < 2:  # untrusted: its jailed child, alone
            assert meta["isolated"] is True and "cobatch" not in meta, meta
        else:
            assert meta["isolated"] is False and meta["cobatch"] == 2, meta


def test_a_worker_killed_mid_batch_loses_none_of_its_jobs(auth_stack, model):
    """``kill -9`` of the worker while a co-batch of four runs (each block sleeps
    2.5 s inside the shared forward): the supervisor restarts the worker, the
    beat's watchdog re-sends every job of the batch (the taken ones have no
    broker message; the registry's ``batch`` named them), and each completes,
    alone (a job on its second attempt is never gathered), exactly right."""
    headers = {"ndif-api-key": nnsight.CONFIG.API.APIKEY}
    local = []
    for layer in range(4):
        with model.trace(PROMPT):
            local.append(model.transformer.h[layer].output.save())
    slow = slow_job(model, steps=2400)
    wait_status(auth_stack.url, slow.job_id, "RUNNING", headers=headers)
    batch = [slow_job(model, steps=50, layer=layer) for layer in range(4)]
    deadline = time.monotonic() + 60
    while _depth(auth_stack) < len(batch):
        assert time.monotonic() < deadline, auth_stack.logs()
        time.sleep(0.1)
    assert "cancelling on" in auth_stack.cli("kill", slow.job_id).stdout
    for backend in batch:
        wait_status(auth_stack.url, backend.job_id, "RUNNING", headers=headers)
    time.sleep(1.0)  # inside the shared forward now (it takes 4 x 2.5 s)
    os.kill(auth_stack.pids()["worker"], signal.SIGKILL)
    for backend in batch:  # none had ended: the kill landed in the batch
        assert httpx.get(f"{auth_stack.url}/response/{backend.job_id}", headers=headers).json()["status"] in (
            "RUNNING", "QUEUED"), backend.job_id
    for layer, backend in enumerate(batch):
        latest = final_status(auth_stack.url, backend.job_id, headers=headers, timeout_s=120)
        assert latest["status"] == "COMPLETED", latest
        assert torch.equal(poll(backend)["out"], local[layer])
        assert "cobatch" not in backend.meta, backend.meta  # attempt 2: alone
    beat = (auth_stack.logs_dir / "beat.log").read_text(errors="replace")
    for backend in batch:  # every one rescued by the watchdog, the three taken ones included
        assert f"job {backend.job_id} lost with worker" in beat, beat[-3000:]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_each_architectures_users_get_their_own_rows(auth_stack, model, hf_home, architecture):
    """Twelve users at once: nine readers of flattened and per-row values with
    prompts of 2 to 16 tokens, a canary, two writers of every value they
    reach. Each gets its local run; no one else holds a row of the canary's
    values; the writers changed only their own results."""
    reads, writes = ARCHITECTURES[architecture]
    if architecture == "gpt2":
        client = model
    else:
        repo = f"ndif-celery/e2e-tiny-{architecture}"
        build_tiny_gpt2(hf_home, repo, n_layer=2, architecture=architecture)
        client = client_model(repo)
        _remote(client, partial(reads, prompt=PROMPT), True)()  # the first request deploys it
    users = [partial(reads, prompt=p) for p in PROMPTS] + [partial(reads, prompt=CANARY)]
    users += [partial(writes, prompt=PROMPTS[1]), partial(writes, prompt=PROMPTS[4])]
    expected = [_local(client, user) for user in users]
    answers = _at_once(auth_stack, model, [_remote(client, u, blocking=i % 2 == 0) for i, u in enumerate(users)])

    metas = []
    for i, (want, got) in enumerate(zip(expected, answers)):
        assert not isinstance(got, BaseException), f"user {i}: {got!r}"
        saves, meta = got
        metas.append(meta)
        found = _diff(saves, want, meta.get("cobatch", 1) > 1)
        assert found is None, f"user {i} ({meta}): {found}"
    canary = answers[len(PROMPTS)][0]
    for i, (saves, meta) in enumerate(answers):
        if i != len(PROMPTS):
            assert not _holds_a_row_of(saves, canary), f"user {i} holds a row of the canary's values ({meta})"
    readers = metas[:len(PROMPTS) + 1]
    assert sum(meta.get("cobatch", 1) > 1 for meta in readers) >= 6, metas
    untouched = _local(client, partial(reads, prompt=PROMPTS[1]))["logits"]
    assert (answers[-2][0]["logits"] - untouched).abs().max() > 1e-2  # the writes did change the writer's own run
    print(architecture, [(m.get("cobatch"), m.get("cobatch_solo")) for m in metas])
