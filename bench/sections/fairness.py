"""The fairness table: one key floods a model's queue while five others work
interactively, first in first out (``NDIF_FAIR_TURNS=0``, the old order, as
NDIF serves) against fair turns (the default), each on a stack of its own.

The flooding key queues its jobs at once (non-blocking); the five light keys
then take turns sending one blocking job each, the next when the last
returned, a few times around (``Plan.fairness``). Every job sleeps ``JOB_S`` in its
block, so a job's run time is known and the same for all. Co-batching is off
on both stacks: each job runs alone, and the order of runs is the queue's.

Printed per order: the light keys' wait (``queue_ms`` of their jobs, p50 and
p95), one job's run time (``run_ms``, p50), and Jain's fairness index over
the six keys of their throughput while they had a job in the farm (jobs done
over the time from a job's submission to its end, summed per key): 1.0 when
every key with work gets the same rate, 1/6 when one key gets it all.
``bench.workloads`` (torch) is imported inside: see ``bench/run.py``.
"""

from __future__ import annotations

import time

from bench import measure

LIGHT_KEYS = 5
JOB_S = 0.1  # every job's block sleeps this long: its run time
STACK_ENV = {  # auth on (keys), co-batching and the per-key limits off
    "NDIF_AUTH": "1", "NDIF_COBATCH_MAX": "1", "NDIF_MAX_CONCURRENT_JOBS": "0", "NDIF_RATE_LIMIT_PER_MIN": "0",
    "NDIF_MAX_QUEUE_DEPTH": "0", "NDIF_MAX_WEBSOCKETS_PER_KEY": "0", "NDIF_UPLOADS_PER_KEY": "0",
    "NDIF_RESULT_QUOTA_BYTES": "0",
}


def jain(rates: list[float]) -> float:
    """Jain's fairness index of ``rates``: (sum x)^2 / (n sum x^2)."""
    squares = sum(x * x for x in rates)
    return round(sum(rates) ** 2 / (len(rates) * squares), 3) if squares else 0.0


class FairnessSection:
    """Mixin of ``bench.core.Bench``: ``fairness()``."""

    def fairness(self) -> None:
        orders = {"fifo": self.new_stack(**STACK_ENV, NDIF_FAIR_TURNS="0"),
                  "fair": self.new_stack(**STACK_ENV, NDIF_FAIR_TURNS="1")}
        stacks = list(orders.values())
        self.at_once(lambda stack: stack.start(), stacks)
        key = self.model.to_model_key()
        self.at_once(lambda stack: stack.cli("deploy", key, "--timeout", "300", timeout=360, check=True), stacks)
        table = {}
        try:
            for name, stack in orders.items():  # one after the other: each saturates the worker
                table[name] = self.flood_and_light(stack)
        finally:
            for stack in stacks:
                stack.discard()
        flood, rounds = self.plan.fairness
        header = self.header("fairness", f"{flood} jobs of one key, then {LIGHT_KEYS} keys x {rounds} "
                                         f"interactive jobs; every job sleeps {JOB_S * 1000:.0f} ms; co-batching off")
        lines = [header, f"{'order':<6} {'light wait p50':>15} {'p95':>9} {'job run p50':>12} {'Jain':>6}"]
        for name, row in table.items():
            lines.append(f"{name:<6} {row['light_wait_p50_ms']:>12.0f} ms {row['light_wait_p95_ms']:>6.0f} ms "
                         f"{row['run_p50_ms']:>9.0f} ms {row['jain']:>6.3f}")
        self.emit("\n".join(lines))
        self.out["workloads"]["fairness"] = {"orders": table, "flood": flood, "light_keys": LIGHT_KEYS,
                                             "light_rounds": rounds, "job_s": JOB_S}

    def flood_and_light(self, stack) -> dict:
        """One order's run: the flood queued, the light keys' turns, every job's end."""
        import nnsight
        import redis

        from ndif_celery.state import jobs
        from tests.support.clients.remote import poll, slow_job
        from tests.support.cases.tiny_model import PROMPT

        def key(email: str) -> str:
            made = stack.cli("keys", "create", "--email", email, "--trusted", check=True)
            return made.stdout.strip().splitlines()[-1]

        flooder, light = key("flooder@bench.test"), [key(f"light{n}@bench.test") for n in range(LIGHT_KEYS)]
        flood_jobs, rounds = self.plan.fairness
        api = nnsight.CONFIG.API
        saved = api.HOST, api.APIKEY
        steps = round(JOB_S / 0.05)
        model = self.model  # the block ships what it names: the model, not the bench
        try:
            api.HOST, api.APIKEY = stack.url, flooder
            flood_started = time.time()
            flood = [slow_job(model, steps) for _ in range(flood_jobs)]
            waits, runs, busy = [], [], {k: 0.0 for k in light}
            for _ in range(rounds):
                for light_key in light:
                    api.APIKEY = light_key
                    sent = time.time()
                    with model.trace(PROMPT, remote=True) as tracer:
                        model.transformer.h[0].output.save()
                        for _ in range(steps):
                            time.sleep(0.05)
                    busy[light_key] += time.time() - sent
                    meta = tracer.backend.meta or {}
                    waits.append(meta.get("queue_ms", 0.0))
                    runs.append(meta.get("run_ms", 0.0))
            api.APIKEY = flooder
            for backend in flood:
                poll(backend, timeout_s=600)
            client = redis.Redis.from_url(stack.redis_url)
            try:
                flood_ended = max(client.zscore(jobs.ENDED, backend.job_id) for backend in flood)
            finally:
                client.close()
        finally:
            api.HOST, api.APIKEY = saved
        rates = [flood_jobs / (flood_ended - flood_started)] + [rounds / busy[k] for k in light]
        return {"light_wait_p50_ms": round(measure.percentile(waits, .5), 1),
                "light_wait_p95_ms": round(measure.percentile(waits, .95), 1),
                "run_p50_ms": round(measure.percentile(runs, .5), 1), "jain": jain(rates),
                "key_rates_per_s": [round(rate, 3) for rate in rates]}
