"""What an operator watches: farm-wide metrics, the synthetic health probes and their alerts.

``probes`` - a thread of ``ndif-celery beat``, leading by a Redis lease. It runs a
  real remote trace against every served model and judges it against its
  reference. Results go in ``ndif:probes``.
``alerts`` - when a red probe's alert is on. The ``Courier``, the prober's thread,
  tells the alert webhook, retrying with backoff.
``history`` - probe results and job latency per model over 24 h and 30 d, for the
  dashboard's charts.
``probe_runner`` - the probe's nnsight client, a child process of the beat. The
  client imports torch and the beat must not. It starts by module name;
  nothing imports it.
``metrics`` - farm-wide Prometheus series kept in Redis, so every web process
  answers ``/metrics`` alike. Not ``workers.metrics``, one worker's own endpoint.
"""
