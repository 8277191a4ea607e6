"""Fair turns between keys on a model's queue, kept in the broker's own lists.

Celery's Redis transport serves a queue's list oldest first, so one key that
queued a hundred jobs held the model for every job of every other key sent
after them. Here each job gets a *turn* when it is queued: one more than its
key's last turn, and never before the turn the model is on (the turn of the
job it last started)::

    turn = max(the turn started last, the key's last turn + 1)

and the list is kept in turn order (arrival order within a turn): the new
message, pushed by kombu at the back, is moved just before the first waiting
job of a later turn. So keys with waiting jobs take turns, one job each, and a
key with nothing waiting joins the turn the model is on: its job runs once
the jobs of that turn still waiting have (one per key at most), however many
another key queued. Priority keys keep their own list, served first
(``queues.PRIORITY_STEPS``). The health probe's job takes the turn before the
model's (:func:`plan`'s ``first``): ahead of the jobs waiting, behind those running.

The lists stay Celery's: a worker takes from them as before (BRPOP, or the
head and co-batch partners with ``queues.take``), so nothing about delivery,
acknowledgement, restarts or several workers changes; only the order does.
Beside each list, in Redis:

- zset ``ndif:turns:<list>``        job id -> turn x 2^20 + arrival (the order)
- hash ``ndif:turns:<list>:raw``    job id -> its message in the list (where to insert)
- hash ``ndif:turns:<queue>:last``  owner -> the key's last turn on the model
- key  ``ndif:turns:<queue>:now``   the turn of the job the model last started

A key's jobs running at once on a model are bounded too (``NDIF_MAX_RUNNING_PER_KEY``):
a worker claims a slot before it runs one (:func:`claim_run`); a job over the
bound goes back in line, so a key's long jobs cannot hold every replica:

- zset ``ndif:turns:<queue>:running:<owner>``  job id -> when it started

A message with no turn (sent before this order existed) keeps its place; a
job that left the list by another road (killed, removed) is dropped from the
order when it is met. Every key expires with the jobs (``NDIF_JOB_TTL_S``).
"""

from __future__ import annotations

import time

import redis

from ndif_celery.celery_app import PRIORITY_FIRST, PRIORITY_NORMAL, queue_for, send_job

from . import jobs, queues

ARRIVALS = 1 << 20  # arrivals told apart within one turn
SEARCH = 64  # how far from the back of the list a just-pushed message is looked for

# KEYS: the list's order, the queue's last turns, its turn now, its arrival counter.
# ARGV: job id, owner, ttl, first (1: the turn before the one the model is on, so
# ahead of every job waiting for this turn or a later one, in arrival order).
# Returns {turn, jobs ahead in this list}.
_PLAN = """
local now = tonumber(redis.call('GET', KEYS[3]) or '0')
local turn = now - 1
if ARGV[4] ~= '1' then
  local last = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
  turn = math.max(now, last + 1)
  redis.call('HSET', KEYS[2], ARGV[2], turn)
end
local score = turn * %d + redis.call('INCR', KEYS[4]) %% %d
redis.call('ZADD', KEYS[1], score, ARGV[1])
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
return {turn, redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. score)}
""" % (ARRIVALS, ARRIVALS)

# KEYS: the list, its order, its messages. ARGV: job id, ttl, how far to search.
# Moves the job's message, just pushed at the back, before the first job of a later turn.
_PLACE = """
local raw = nil
for _, item in ipairs(redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)) do
  if string.find(item, ARGV[1], 1, true) then raw = item break end
end
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not raw or not score then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], raw)
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('LREM', KEYS[1], 1, raw)
while true do
  local later = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. score, '+inf', 'LIMIT', 0, 1)
  if #later == 0 then
    redis.call('LPUSH', KEYS[1], raw)
    return 1
  end
  local pivot = redis.call('HGET', KEYS[3], later[1])
  if pivot and redis.call('LINSERT', KEYS[1], 'AFTER', pivot, raw) > 0 then return 1 end
  redis.call('ZREM', KEYS[2], later[1])  -- no longer waiting: out of the order
  redis.call('HDEL', KEYS[3], later[1])
end
"""

# KEYS: the list's order, its messages, the queue's turn now. ARGV: job id, ttl.
_STARTED = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
local turn = math.floor(tonumber(score) / %d)
if turn > tonumber(redis.call('GET', KEYS[3]) or '0') then redis.call('SET', KEYS[3], turn, 'EX', ARGV[2]) end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return turn
""" % ARRIVALS


# KEYS: the key's running jobs on the model. ARGV: job id, the bound, now, stale before, ttl.
_CLAIM = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[4])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _list(queue: str, job: jobs.Job) -> str:
    return queues.list_for(queue, PRIORITY_FIRST if job.priority else PRIORITY_NORMAL)


def _order(list_name: str) -> str:
    return f"ndif:turns:{list_name}"


def _queue_keys(queue: str) -> list[str]:
    return [f"ndif:turns:{queue}:last", f"ndif:turns:{queue}:now", f"ndif:turns:{queue}:arrivals"]


def plan(client: redis.Redis, job: jobs.Job, queue: str, ttl_s: int, first: bool = False) -> int:
    """Give ``job`` its turn on ``queue``; the jobs ahead of it in its own list.
    ``first``: the health probe's job, one short trace per deployment and interval
    (``monitoring.probes``; the beat sends no other while it waits): a turn before
    the one the model is on, ahead of its waiting jobs, so it waits for the jobs
    running, not behind a line of long ones, and delays each researcher by one
    forward pass. Its key's own turns are left as they were."""
    own = _list(queue, job)
    _turn, ahead = client.eval(_PLAN, 4, _order(own), *_queue_keys(queue), job.id, job.owner, ttl_s,
                               "1" if first else "0")
    return ahead


def place(client: "redis.Redis | redis.client.Pipeline", job: jobs.Job, queue: str, ttl_s: int) -> bool:
    """Move ``job``'s message, just sent, to its turn in its list; False when it
    was not found near the back (a worker took it already). On a pipeline,
    queued after the send (the intake's park), and its answer is the pipeline's."""
    own = _list(queue, job)
    return bool(client.eval(_PLACE, 3, own, _order(own), f"{_order(own)}:raw", job.id, ttl_s, SEARCH))


def started(pipe, job: jobs.Job, queue: str, ttl_s: int) -> None:
    """In the worker's start round trip: the model's turn now is at least
    ``job``'s, and ``job`` leaves the order."""
    own = _list(queue, job)
    pipe.eval(_STARTED, 3, _order(own), f"{_order(own)}:raw", _queue_keys(queue)[1], job.id, ttl_s)


def send(client: redis.Redis, celery, job: jobs.Job, settings) -> None:
    """Send ``job`` (sent again: back from a worker that lost its model, or
    rescued from one that died) to its model's queue, at a turn of its own
    (with ``NDIF_FAIR_TURNS`` off, at the back)."""
    queue = queue_for(job.model_key)
    if settings.fair_turns:
        plan(client, job, queue, settings.job_ttl_s)
    send_job(celery, job)
    if settings.fair_turns:
        place(client, job, queue, settings.job_ttl_s)


def _running(queue: str, owner: str) -> str:
    return f"ndif:turns:{queue}:running:{owner}"


def claim_run(pipe, job: jobs.Job, queue: str, settings) -> None:
    """On ``pipe``, with NDIF_MAX_RUNNING_PER_KEY set: whether ``job`` may run now
    (1), its key running fewer jobs than that on the model (counted from now on,
    until :func:`release_run`), or not (0). Nothing is added to ``pipe`` without
    a bound. A job of a worker that died without releasing stops counting after
    its deadline."""
    bound = settings.max_running_per_key
    if not bound:
        return
    now = time.time()
    held_s = settings.execution_timeout_s + settings.deadline_grace_s + 60
    pipe.eval(_CLAIM, 1, _running(queue, job.owner), job.id, bound, now, now - held_s, int(held_s) + 60)


def release_run(client: "redis.Redis | redis.client.Pipeline", job: jobs.Job, queue: str) -> None:
    client.zrem(_running(queue, job.owner), job.id)


def others_waiting(client: redis.Redis, job: jobs.Job, queue: str) -> bool:
    """Whether a job of another key waits on the model (so a worker that sent
    ``job`` back runs it at once, rather than pausing)."""
    return any(entry.job.owner != job.owner for entry in queues.waiting(client, queue))
