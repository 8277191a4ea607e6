"""What an operator watches: farm-wide metrics, the synthetic health probes and their alerts.

- ``probes``: a thread of ``ndif-celery beat``, leading by a Redis lease, that
  runs a real remote trace against every served model and judges it against
  its reference; results in ``ndif:probes``.
- ``alerts``: when a red probe's alert is on, and the ``Courier``, the prober's
  thread that tells the alert webhook, retrying with backoff.
- ``probe_runner``: the probe's nnsight client, a child process of the beat,
  because the client imports torch and the beat must not; started by module
  name, imported by nothing.
- ``metrics``: farm-wide Prometheus series kept in Redis, so every web process
  answers ``/metrics`` alike. Not ``workers.metrics``, one worker's own endpoint.
"""
