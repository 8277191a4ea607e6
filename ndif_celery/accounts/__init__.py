"""Who may do what, and what they used: users, API keys, limits, the job ledger, usage.

Bottom first:

- ``db``: users, hashed API keys and the ledger's table (SQLAlchemy: SQLite on
  one host, PostgreSQL in production).
- ``auth``: who is asking (the ``ndif-api-key`` header), trust, priority and
  ownership; fails closed when the database is away.
- ``limits``: payload size, rate and concurrency per key, sockets and uploads
  in flight per key, queue depth; counters in Redis so every web process shares them.
- ``usage``: usage per key and per model from the ledger (``ndif-celery
  usage``, the dashboard) and the bounded ``ndif_usage_*`` counters.
- ``ledger``: one database row per ended job, queued in Redis with its final
  status and written in batches by the ``Drainer`` (a thread in every worker,
  one leading), so ending a job never waits on the database; pruning.
- ``ledger_queries``: the ledger read back for ``ndif-celery jobs`` and the
  dashboard, summaries still waiting in Redis included; ``--since`` times.
"""
