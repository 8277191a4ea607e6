"""Who may do what, and what they used: users, API keys, limits, the job ledger, usage.

Bottom first:

``db`` - the tables: users, hashed API keys, the ledger, the audit log. SQLite on one
  host, PostgreSQL in production.
``audit`` - every operator action taken from the dashboard, allowed or not.
``auth`` - who is asking (the ``ndif-api-key`` header): trust, priority, ownership.
  It fails closed when the database is away.
``limits`` - payload size, rate, concurrency, sockets and uploads per key, and queue
  depth. The counters live in Redis, so every web process shares them.
``usage`` - usage per key and per model from the ledger, and the bounded
  ``ndif_usage_*`` counters.
``ledger`` - one database row per ended job. Rows wait in Redis and the ``Drainer``
  writes them in batches, so ending a job never waits on the database.
``ledger_queries`` - the ledger read back for ``ndif-celery jobs`` and the dashboard.
  Rows still waiting in Redis are included. Also ``--since`` times.
"""
