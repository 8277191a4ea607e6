"""The models this worker keeps loaded, by model key: one :class:`Resident` each.

The controller decides what a worker holds; this module only loads and drops.
A model is built once from its model key (from the HF cache, or the hub when
reachable) and stays resident for every later job until it is evicted.

Why one object per model: everything the worker keeps for a model (its
weights' shared mapping, its fingerprints, its zygote, its size as placed)
is born with the load and must die with the eviction or the reload, together.
A :class:`Resident` holds all of it and lets go of all of it in
:meth:`Resident.close`; :class:`ResidentModels` is only the registry of
them, and the one interface callers use (no caller reaches inside).
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import time
from typing import Any, Optional


from ndif_celery import config
from ndif_celery.policy import model_policy
from ndif_celery.wire import repo_fields
from workers import adapters, baseline, cuda, quantized
from workers.execute import RequestError, forget_tree, no_grad_weights
from workers.isolation import parent
from workers.isolation import shared_weights
from workers.isolation.zygote import Zygote

from . import integrity
from .threads import Threads

log = logging.getLogger(__name__)

#: The whole check runs in an idle moment at most this often (seconds). A
#: lone client's next request arrives while it runs: on GPT-2 medium's shape
#: (~0.1 s per check), once a second added 10 ms to the mean broker hop.
IDLE_CHECK_GAP_S = 10.0


class Resident:
    """One model this worker holds, and everything kept for it.

    ``fingerprint``: the plain fingerprint (``integrity.PlainFingerprint``),
    checked after trusted jobs (retaken when the weights move into shared
    memory: same values, new storage).
    ``stamps``: the cheap ``integrity.Stamps`` read after every trusted job,
    and ``unchecked``: the trusted jobs since the last whole check.
    ``keyed``: ``(KeyedHash, its fingerprint at load)`` where untrusted jobs are
    followed by the keyed check, else None; it depends on the values only.
    ``shared``: the weights in memory a zygote maps (``shared_weights.Shared``),
    made on the zygote's first start. ``zygote``: the model's ``zygote.Zygote``.
    ``size_bytes``: as placed, for re-registering the deployment.
    ``threads``: torch's intra-op threads for its forward (``workers.models.threads``).
    Its baseline (``workers.baseline``, what trusted requests' changes are put
    back to) is kept on the model itself, so it goes with the model.
    """

    def __init__(self, model_key: str, model: Any, dtype: Optional[str], size_bytes: int = 0,
                 keyed: bool = False, threads: int = 0) -> None:
        self.model_key = model_key
        self.model = model
        self.dtype = dtype
        self.size_bytes = size_bytes
        self.threads = threads
        self.fingerprint = integrity.PlainFingerprint(model._module)
        self.stamps = integrity.Stamps(model._module)
        self.unchecked = 0
        self.checked_at = time.monotonic()  # the last whole check (at load: the fingerprint itself)
        self.keyed: Optional[tuple] = None
        if keyed:
            # A fresh key per load, drawn here and never handed to any child.
            key = integrity.KeyedHash(secrets.token_bytes(32))
            self.keyed = (key, key.fingerprint(model._module))
        self.shared: Any = None
        self.zygote: Optional[Zygote] = None
        baseline.take(model)  # what each trusted request's changes are put back to

    def share(self) -> Any:
        """The weights in shared memory (moved there on first call)."""
        if self.shared is None:
            self.shared = shared_weights.share(self.model._module)
            self.fingerprint = integrity.PlainFingerprint(self.model._module)  # same values, new storage
            self.stamps = integrity.Stamps(self.model._module)
            baseline.take(self.model)  # the buffers are new objects: they are the ones to keep
        return self.shared

    def start_zygote(self, fork_server: Any = None) -> Zygote:
        """Its zygote: the current one if it still fits the model, else a new one."""
        if self.zygote is not None and self.zygote.fits(self.model):
            return self.zygote
        self.drop_zygote()
        self.zygote = Zygote(self.model, self.share(), self.model_key, self.dtype, fork_server=fork_server,
                             threads=self.threads)
        return self.zygote

    def drop_zygote(self) -> None:
        """Stop its zygote (and so every child it forked, the spare included)."""
        zygote, self.zygote = self.zygote, None
        if zygote is not None:
            parent.discard(zygote=zygote)
            zygote.close()

    def changed(self) -> list[str]:
        """After a trusted job: the tensors whose plain fingerprint changed."""
        return self.fingerprint.changed(self.model._module)

    def changed_keyed(self) -> list[str]:
        """After an untrusted job: the tensors whose keyed fingerprint changed (raises if the check fails)."""
        keyed, expected = self.keyed
        return integrity.changed(self.model._module, expected, key=keyed)

    def close(self) -> None:
        """Release everything it holds: the spare child and the zygote, the
        shared mapping's descriptor, the keyed hash, the stamps and the model itself."""
        self.drop_zygote()
        shared, self.shared = self.shared, None
        if shared is not None and shared.cpu_fd >= 0:
            os.close(shared.cpu_fd)
        self.keyed = None
        self.stamps = None  # its sampled words are views: they would keep the weights' storage alive
        self.model = None


class ResidentModels:
    """The registry of this worker's :class:`Resident` models, by model key."""

    def __init__(self, verify_untrusted: bool = False, trusted_check_every: int = 1, torch_threads: int = 0) -> None:
        # NDIF_VERIFY_UNTRUSTED: the keyed check after every untrusted job on
        # every model, not only on GPU models (whose weights a child can write).
        self.verify_untrusted = verify_untrusted
        # NDIF_TRUSTED_CHECK_EVERY: the whole plain check after every Nth trusted
        # job at least (the stamps after every one; see check_after_trusted).
        self.trusted_check_every = max(1, trusted_check_every)
        self._residents: dict[str, Resident] = {}
        self.threads = Threads(torch_threads)  # NDIF_TORCH_THREADS: a count, or 0 (measured per model)

    def get(self, model_key: str) -> Optional[Any]:
        resident = self._residents.get(model_key)
        return resident.model if resident is not None else None

    def use(self, model_key: str) -> Optional[Any]:
        """The model for a job to run on, torch set to its thread count."""
        resident = self._residents.get(model_key)
        if resident is None:
            return None
        self.threads.use(resident.threads)
        return resident.model

    def measured_bytes(self, model_key: str) -> int:
        """What its weights take as loaded: parameters, buffers and a
        quantization's scales. Shown beside the size it was placed by."""
        resident = self._residents.get(model_key)
        return weights_in_memory(resident.model._module) if resident is not None else 0

    def threads_of(self, model_key: str) -> int:
        resident = self._residents.get(model_key)
        return resident.threads if resident is not None else 0

    def resident(self, model_key: str) -> Optional[Resident]:
        return self._residents.get(model_key)

    def keys(self) -> list[str]:
        return list(self._residents)

    def size(self, model_key: str) -> int:
        """Its size as placed (``load``'s ``size_bytes``); 0 if unknown or not here."""
        resident = self._residents.get(model_key)
        return resident.size_bytes if resident is not None else 0

    def load(self, model_key: str, dtype: Optional[str] = None, size_bytes: int = 0, threads: int = 0) -> float:
        """Load ``model_key`` (if not already here); return the seconds it took.
        ``size_bytes``: its size as placed, kept for re-registering it (a model
        already here keeps its weights and takes the new size). ``threads``:
        its thread count as chosen before (a reload), else chosen now."""
        if model_key in self._residents:
            self._residents[model_key].size_bytes = size_bytes
            return 0.0
        try:  # again here, whoever sent the load: never a key the policy refuses
            canonical = model_policy.ModelPolicy.from_settings(config.load()).loadable(model_key)
            key = model_policy.parse(canonical)
            if key.cls == model_policy.DIFFUSION_MODEL:  # a pipeline's components, before diffusers reads them
                model_policy.check_pipeline_index(pipeline_index(key.repo_id, key.revision), key.repo_id)
        except model_policy.PolicyError as error:
            raise RequestError(f"Could not load model: {error.detail}", kind="deploy") from None
        started = time.monotonic()
        kwargs = {"dispatch": True}
        dtype = model_policy.parse(canonical).held or dtype  # a quantized deployment is held as its key says
        if dtype:
            kwargs["dtype"] = dtype  # nnsight loads a quantization's name (nnsight.modeling.quantization)
        if cuda.gpus_visible():
            # Onto this worker's GPUs (CUDA_VISIBLE_DEVICES is its own), spread
            # over them when there are several, loaded straight there.
            kwargs["device_map"] = "auto"
        try:
            model = adapters.current().load(canonical, **kwargs)
        except Exception as error:  # noqa: BLE001 - any load failure is reported to the jobs
            raise RequestError(
                f"Could not load model {repo_fields(model_key)['repo_id']!r} ({model_key}): "
                f"{type(error).__name__}: {error}"
            ) from None
        no_grad_weights(model._module)
        quantized.settle(model._module)  # before the baseline and fingerprints: what a request finds
        threads, why = (threads, "as before") if threads else self.threads.for_model(model._module)
        log.info("%s: %d torch thread(s) per forward (%s)", repo_fields(model_key)["repo_id"], threads, why)
        self._residents[model_key] = Resident(model_key, model, dtype, size_bytes,
                                              keyed=self.verify_untrusted or cuda.on_gpu(integrity.named_tensors(model._module)),
                                              threads=threads)
        return round(time.monotonic() - started, 3)

    def zygote(self, model_key: str, fork_server: Any = None) -> Optional[Zygote]:
        """The model's zygote (``workers.isolation.zygote``), started on first use: its
        weights move into shared memory once, then a clean process maps them
        (exec'd, or forked from ``fork_server``: ``workers.isolation.forkserver``)."""
        resident = self._residents.get(model_key)
        return resident.start_zygote(fork_server) if resident is not None else None

    def current_zygote(self, model_key: str) -> Optional[Zygote]:
        """The model's zygote if one was started (none is started here)."""
        resident = self._residents.get(model_key)
        return resident.zygote if resident is not None else None

    def drop_zygote(self, model_key: str) -> None:
        resident = self._residents.get(model_key)
        if resident is not None:
            resident.drop_zygote()

    def drop_zygotes(self) -> None:
        """Stop every model's zygote (the worker stops); the models stay."""
        for resident in list(self._residents.values()):
            resident.drop_zygote()

    def restore_if_changed(self, model_key: str) -> list[str]:
        """Reload the model if its plain fingerprint changed; return what had changed."""
        resident = self._residents.get(model_key)
        if resident is None:
            return []
        changed = resident.changed()
        resident.unchecked, resident.checked_at = 0, time.monotonic()
        if changed:
            self._reload(resident)
        return changed

    def idle_check_due(self, model_key: str) -> bool:
        """Whether an idle moment should be spent on the whole check: at most
        once per ``IDLE_CHECK_GAP_S``. A lone client's back-to-back jobs each
        leave the worker idle; a check after every one cost a fifth of the
        worker's CPU on a small model, and delayed the next request."""
        resident = self._residents.get(model_key)
        return resident is not None and time.monotonic() - resident.checked_at >= IDLE_CHECK_GAP_S

    def check_after_trusted(self, model_key: str, idle: bool, jobs: int = 1) -> tuple[str, list[str]]:
        """After a trusted job (or a co-batch of ``jobs``): ``(why the whole
        check ran, or ''; what had changed, the model then reloaded)``.

        The whole fingerprint reads every weight (~0.1 s per GiB on a CPU): it
        runs when the stamps show a write (``integrity.Stamps``: version
        counters, storages, sampled words, ~1 ms), when the worker has no
        job waiting (``idle``: nobody waits for it; the caller asks only when
        :meth:`idle_check_due`), and after every
        ``NDIF_TRUSTED_CHECK_EVERY``-th trusted job in any case (each job of
        a co-batch counted); in between, a write the stamps cannot see
        (through ``.data``, to words no sample covers) reaches at most that
        many jobs minus one."""
        resident = self._residents.get(model_key)
        if resident is None:
            return "", []
        resident.unchecked += max(1, jobs)
        why = resident.stamps.changed(resident.model._module)
        if not why and idle:
            why = "no job is waiting"
        if not why and resident.unchecked >= self.trusted_check_every:
            why = f"{resident.unchecked} trusted jobs since the last whole check"
        if not why:
            return "", []
        return why, self._whole_check(resident, why)

    def check_written(self, model_key: str) -> tuple[str, list[str]]:
        """The stamps alone, and the whole check only where they show a write
        (a co-batch's guard, ``cobatch.run_batch``'s ``restore``): ``(what the
        stamps showed, or ''; what had changed, the model then reloaded)``."""
        resident = self._residents.get(model_key)
        if resident is None:
            return "", []
        why = resident.stamps.changed(resident.model._module)
        return (why, self._whole_check(resident, why)) if why else ("", [])

    def _whole_check(self, resident: Resident, why: str) -> list[str]:
        """The whole plain check (``why``: what called for it); a change reloads the
        model. A sampled word that changed reloads it whatever the sum says."""
        changed = self.restore_if_changed(resident.model_key)
        if not changed and why == integrity.SAMPLE_CHANGED:
            # A word differs from its copy taken at load, whatever the sum says
            # (a change that cancels in it, say): the model is not as loaded.
            changed = ["(a sampled word)"]
            self._reload(resident)
        elif not changed and why == integrity.STAMP_CHANGED:
            resident.stamps = integrity.Stamps(resident.model._module)  # a write that changed nothing
            forget_tree(resident.model)  # a tensor or module swapped in, with the same values
        return changed

    def checks_untrusted(self, model_key: str) -> bool:
        """Whether untrusted jobs on this model are followed by the keyed check: its weights are on a GPU
        (a zygote's child maps them writable), or the operator asked for it (NDIF_VERIFY_UNTRUSTED)."""
        resident = self._residents.get(model_key)
        return resident is not None and resident.keyed is not None

    def check_after_untrusted(self, model_key: str) -> list[str]:
        """After an untrusted job, however it ended, once its child is dead: compare the keyed
        fingerprint, reload the model on any change; return what had changed.

        Fails closed: if the check itself fails, the model is evicted (the
        next job loads it afresh) rather than served unverified."""
        resident = self._residents.get(model_key)
        if resident is None or resident.keyed is None:
            return []
        try:
            changed = resident.changed_keyed()
        except Exception as error:  # noqa: BLE001 - an unverifiable model is not served
            log.exception("the keyed weight check of %s failed; evicting the model", model_key)
            self.evict(model_key)
            return [f"(the check failed: {type(error).__name__})"]
        if changed:
            self._reload(resident)
        return changed

    def _reload(self, resident: Resident) -> None:
        self.evict(resident.model_key)
        self.load(resident.model_key, resident.dtype, resident.size_bytes, resident.threads)

    def evict(self, model_key: str) -> bool:
        resident = self._residents.pop(model_key, None)
        if resident is None:
            return False
        resident.close()
        del resident
        gc.collect()
        cuda.empty_cuda_cache()
        return True


def weights_in_memory(module: Any) -> int:
    """Bytes of ``module``'s parameters and buffers, with the scales a
    bitsandbytes weight keeps beside it (``quant_state.absmax``, ``SCB``)."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)
        scales = [getattr(state, "absmax", None), getattr(tensor, "SCB", None)]
        total += sum(scale.numel() * scale.element_size() for scale in scales if scale is not None)
    return total


def pipeline_index(repo_id: str, revision: Optional[str]) -> Any:
    """A diffusers repo's ``model_index.json``, from the cache or the hub; None when it has none."""
    import json

    from huggingface_hub import hf_hub_download

    try:
        with open(hf_hub_download(repo_id, "model_index.json", revision=revision)) as f:
            return json.load(f)
    except Exception:  # noqa: BLE001 - no index, or unreadable: the check refuses it, naming the repo
        return None
