"""Executors: where a job's block runs, each owning its deadline.

A job's life (``workers.job.life``) does not care where the user's code runs.
It hands the payload to an executor and gets the result bytes back. Or it
gets an exception, which ``life.fail`` turns into the ERROR the client reads.
Two executors share one small interface:

- ``run(model, job, blob, channel, meta) -> bytes``: run the block. Fill
  ``meta`` with what the client may see about the run.
- ``after(job)``: after the answer is sent, before the next job. Check the
  weights the job could have touched.
- ``prepare_next(model_key)``: make the next job on the model cheaper.

:class:`InProcess` serves trusted keys. It runs in this worker's own process,
against the resident model itself. Its deadline is the worker's watchdog
(``workers.job.deadline``). At the limit the watchdog sends the ERROR itself.
Then it interrupts the job's thread with :class:`JobTimedOut`, as ``ndif-celery
kill`` does with :class:`JobCancelled`. If the thread is stuck in C, where no
exception reaches it, the watchdog replaces the worker.

:class:`Isolated` serves untrusted keys. It runs a fresh jailed child per
request (``workers.isolation.parent``). The model's zygote forks the child
(``workers.isolation.zygote``). This worker never does: it holds secrets and
what earlier jobs left in its memory. The zygote is an exec'd interpreter
with ``NDIF_ISOLATION=zygote``, or a fork of the fork server with ``=fork``.
Its deadline is the isolation policy's, which bounds every wait on the child.
The watchdog stands behind it, ``deadline.ISOLATED_MARGIN_S`` later. The
policy is built here too: what the jail lets the child read, as whom, with
which limits.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from typing import Callable

from huggingface_hub import constants as hf_constants
from huggingface_hub import file_download

from ndif_celery import config, statuses, wire
from ndif_celery.state import jobs
from workers import cobatch, execute, results
from workers.isolation import forkserver, jail
from workers.isolation import parent
from workers.isolation.zygote import ZygoteError
from workers.models.resident import ResidentModels

from . import deadline

log = logging.getLogger("ndif_celery.worker")

# A killed child is gone in milliseconds; one that is not is stuck in the kernel.
REAP_WAIT_S = 30.0


class JobCancelled(BaseException):
    """Raised in the job's thread by ``ndif-celery kill``.

    It is a BaseException so user code's ``except Exception`` cannot swallow it."""


class JobTimedOut(BaseException):
    """Raised in the job's thread at its execution deadline (trusted path)."""


def ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 1)


class InProcess:
    """Trusted: run in this process, against the resident model itself.

    It runs one job (:meth:`run`) or a co-batch (:meth:`run_together`). Both go
    through the co-batching engine's trusted path (``cobatch.run_alone``,
    ``run_batch``)."""

    def __init__(self, settings: config.Settings, models: ResidentModels, watchdog: deadline.DeadlineWatchdog,
                 job_waiting: Callable[[str], bool] = lambda model_key: False) -> None:
        self.timeout_s = settings.execution_timeout_s
        self.cobatch_max, self.cobatch_pad = settings.cobatch_max, settings.cobatch_pad
        self.models = models
        self.watchdog = watchdog  # the worker's: answers at the deadline, interrupts, replaces if stuck
        self.job_waiting = job_waiting  # whether a job waits for this model; if so the whole check may wait

    def run(self, model, job: jobs.Job, blob: bytes, channel: statuses.StatusChannel, meta: dict) -> bytes:
        with self.watchdog.watch(job.id, channel, meta, self.timeout_s), deadline.backstop(self._last_resort()):
            meta["isolated"] = False
            outcome = cobatch.run_alone(model, cobatch.Request(job.id, blob, job.compress, job.env, channel.log), "")
            if outcome.deserialize_ms is not None:
                meta["deserialize_ms"] = outcome.deserialize_ms
            if outcome.error is not None:
                raise outcome.error
            encode_started = time.perf_counter()
            data = results.encode(outcome.saved, job.compress)
            meta["encode_ms"] = ms_since(encode_started)
            return data

    def run_together(self, model, runs: list[tuple]) -> list:
        """A co-batch: ``runs`` is (job, blob, channel, meta) per job.

        Every job is trusted and of one model. One watch covers them all, with
        one deadline: the job limit. At it, every job of the batch gets its
        timeout ERROR. Returns each job's result bytes, or the exception that
        is its answer, in order."""
        (lead, _, lead_channel, lead_meta), *others = runs
        others = [(job.id, channel, meta) for job, _, channel, meta in others]
        with self.watchdog.watch(lead.id, lead_channel, lead_meta, self.timeout_s, others), \
                deadline.backstop(self._last_resort()):
            requests = [cobatch.Request(job.id, blob, job.compress, job.env, channel.log)
                        for job, blob, channel, _ in runs]
            outcomes = cobatch.run_batch(model, requests, self.cobatch_max, self.cobatch_pad,
                                         restore=lambda: self._restored(lead.model_key))
            answers: list = []
            for (job, _, _, meta), outcome in zip(runs, outcomes):
                meta["isolated"] = False
                meta.update(outcome.meta)
                if outcome.error is not None:
                    answers.append(outcome.error)
                    continue
                try:
                    answers.append(results.encode(outcome.saved, job.compress))
                except Exception as error:  # noqa: BLE001 - one job's result, one job's answer
                    answers.append(error)
            return answers

    def _last_resort(self) -> float:
        return self.timeout_s + self.watchdog.grace_s + deadline.BACKSTOP_MARGIN_S

    def _restored(self, model_key: str):
        """A co-batch's stamps showed a write. Run the whole check; a changed
        weight reloads the model. Returns the model to go on with."""
        why, restored = self.models.check_written(model_key)
        if restored:
            log.warning("a co-batch on %s changed %d weight tensors; model reloaded", model_key, len(restored))
        elif why:
            log.warning("a co-batch on %s wrote a weight (%s); its values are as loaded", model_key, why)
        return self.models.get(model_key)

    def after(self, job: jobs.Job, jobs_run: int = 1) -> None:
        """After the job, or the co-batch of ``jobs_run`` it led, before the next.

        It reads the stamps of every weight. The whole plain check runs when
        they show a write, or when no job waits (at most every 10 s). It also
        runs every ``NDIF_TRUSTED_CHECK_EVERY``-th job
        (``ResidentModels.check_after_trusted``). A change reloads the model."""
        started = time.perf_counter()
        idle = False
        if self.models.idle_check_due(job.model_key):  # else no need to ask the broker
            try:
                idle = not self.job_waiting(job.model_key)
            except Exception:  # noqa: BLE001 - the broker away: check now, as if idle
                idle = True
        why, restored = self.models.check_after_trusted(job.model_key, idle=idle, jobs=jobs_run)
        if restored:
            log.warning("job %s changed %d weight tensors; model reloaded (checked: %s)", job.id, len(restored), why)
        elif why:
            log.debug("job %s: whole weight check intact (%s, %.0f ms)", job.id, why, ms_since(started))

    def prepare_next(self, model_key: str) -> None:
        """Nothing to prepare: the model itself runs the next job."""


class Isolated:
    """Untrusted: a fresh jailed child per request, forked by the model's zygote."""

    def __init__(self, settings: config.Settings, models: ResidentModels, watchdog: deadline.DeadlineWatchdog) -> None:
        self.settings = settings
        self.models = models
        self.watchdog = watchdog  # the backstop behind the policy's deadline
        # What an isolated job may read, and whether it can run as nobody.
        # Learnt once, when the worker is ready (learn_host).
        self.readable: tuple = ()
        self.as_nobody = True
        self.cache_exposed = ""  # why the jail cannot keep the model cache private, or ""

    def learn_host(self) -> None:
        """Read once from this host what the jail needs.

        First, the paths the jail leaves readable: the interpreter, the
        packages, system libraries. Each job adds its model's own files. Then,
        whether that keeps the rest of the model cache and the hub token
        private. Last, whether user ``nobody`` can read the interpreter's prefixes."""
        self.readable = tuple(jail.readable_paths())
        path, private = jail.covering(self.readable, (hf_constants.HF_HUB_CACHE, hf_constants.HF_TOKEN_PATH,
                                                      hf_constants.HF_STORED_TOKENS_PATH))
        self.cache_exposed = (f"{private} lies under {path}, which untrusted code must be able to read, so it "
                              "would see every cached model and the hub token; move HF_HOME out of it") if path else ""
        if self.cache_exposed:
            log.error("untrusted jobs are refused on this worker: %s", self.cache_exposed)
        self.as_nobody = jail.readable_by_others(sys.base_prefix) and jail.readable_by_others(sys.prefix)

    def run(self, model, job: jobs.Job, blob: bytes, channel: statuses.StatusChannel, meta: dict) -> bytes:
        meta["isolated"] = True
        if self.cache_exposed:
            raise execute.RequestError(f"This worker does not run untrusted code: {self.cache_exposed} "
                                       "(see docs/security.md). Ask the operator.")
        zygote = self.zygote(job.model_key)
        # Armed once the zygote is ready, as parent.run's own deadline is. Its start is not the job's time.
        backstop_s = self.settings.execution_timeout_s + deadline.ISOLATED_MARGIN_S
        with self.watchdog.watch(job.id, channel, meta, backstop_s):
            outcome = parent.run(model, blob, job.compress, job.env, self.policy(zygote, job.model_key), channel.log,
                                  zygote=zygote)
        # Only what parent vouches for, never a key of ours. That is the child's
        # jail layers and timings (checked by parent.child_meta), isolated_ms and spare.
        meta.update({key: value for key, value in outcome.meta.items()
                     if key in parent.OUTCOME_META and key not in meta})
        meta["isolation"] = zygote.mode
        return outcome.data

    def zygote(self, model_key: str):
        """The model's zygote, started on first use.

        It is exec'd (NDIF_ISOLATION=zygote) or forked from the fork server
        (=fork). When none can be had, the job is refused."""
        try:
            server = None
            if self.settings.isolation == "fork":
                server = forkserver.current()
                if server is None:
                    raise forkserver.ForkServerError("this worker has no fork server (it starts with the Celery "
                                                     "worker, when untrusted jobs can come)")
            zygote = self.models.zygote(model_key, fork_server=server)
            zygote.wait_ready()
        except ZygoteError as error:
            self.models.drop_zygote(model_key)  # the next job tries a fresh one
            raise execute.RequestError(f"This worker could not start its isolation process, so it did not run "
                                       f"your job: {error}. Ask the operator (see docs/security.md).",
                                       kind="server") from None
        return zygote

    def start_zygote(self, model_key: str) -> None:
        """Start the zygote right after a load, when untrusted jobs can come.

        It is then ready by the first untrusted job. An exec'd one takes
        seconds of imports."""
        server = forkserver.current() if self.settings.isolation == "fork" else None
        self.models.zygote(model_key, fork_server=server)

    def policy(self, zygote, model_key: str) -> parent.IsolationPolicy:
        settings = self.settings
        readable = self.readable + model_files(model_key)
        if zygote is not None and zygote.cuda:
            readable = readable + _gpu_readable()
        return parent.IsolationPolicy(
            timeout_s=settings.execution_timeout_s,
            memory_bytes=settings.job_memory_bytes,
            disk_bytes=settings.job_disk_bytes,
            secrets=settings.secrets(),
            max_result_bytes=settings.max_result_bytes,
            readable=readable,
            as_nobody=self.as_nobody,
            jail_waived=settings.jail_waived,
            jail_disabled=settings.jail_disabled,
            cgroup_root=settings.jail_cgroup_root,
            # Hidden from the child's view, UNIX sockets included, on top of Landlock.
            hidden=(str(settings.home), str(settings.results_dir)),
        )

    def after(self, job: jobs.Job, jobs_run: int = 1) -> None:
        """The keyed weight check, after every untrusted job, before the next.

        It runs however the job ended: success, user error, timeout, cancel, a
        crashed child, a server fault. It runs where a child could have written
        the weights: a GPU model, since CUDA IPC has no read-only mapping. It
        also runs when the operator asks (NDIF_VERIFY_UNTRUSTED). A child not
        dead in time, or a check that fails, evicts the model. The model is
        never served unverified."""
        if not self.models.checks_untrusted(job.model_key):
            return
        started = time.perf_counter()
        if not parent.wait_reaped(REAP_WAIT_S):
            log.error("untrusted job %s: its child was not reaped within %g s; evicting %s unverified",
                      job.id, REAP_WAIT_S, job.model_key)
            self.models.evict(job.model_key)
            return
        restored = self.models.check_after_untrusted(job.model_key)
        if restored:
            log.warning("untrusted job %s changed %d weight tensors (%s); model reloaded", job.id, len(restored),
                        ", ".join(restored[:5]))
        else:
            log.info("untrusted job %s: keyed weight check intact (%.0f ms)", job.id, ms_since(started))

    def prepare_next(self, model_key: str) -> None:
        """After an untrusted job: fork and jail the next one's child now, while idle.

        The child waits as a ``parent.Spare``. Best effort: a failure here only
        costs speed."""
        model = self.models.get(model_key)
        if model is None:
            return
        try:
            zygote = self.models.current_zygote(model_key)
            if zygote is None:
                return
            parent.prepare(model, self.policy(zygote, model_key), zygote=zygote)
        except Exception:  # noqa: BLE001
            log.exception("could not prepare a spare isolated process")


def model_files(model_key: str) -> tuple:
    """The served model's own folder in the hub cache.

    It holds the snapshots, the blobs they link to, and the refs: weights,
    tokenizer, config. It is the one part of the cache a child of this model
    may read."""
    folder = file_download.repo_folder_name(repo_id=wire.repo_id(model_key), repo_type="model")
    return (os.path.join(hf_constants.HF_HUB_CACHE, folder),)


def _gpu_readable() -> tuple:
    """What a CUDA child may still read once locked in.

    That is the driver's device nodes and its /proc and /sys entries. This
    list is untested on a GPU."""
    return tuple(glob.glob("/dev/nvidia*")) + tuple(p for p in ("/proc/driver/nvidia", "/sys") if os.path.exists(p))
