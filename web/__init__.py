"""The web: the Flask app the nnsight client talks to. It never imports ``workers`` or torch.

``app`` - the factory, and the one ``Refused`` handler every refusal goes through.
``identity`` - who is asking, for every route.
``uploads`` - a request body admitted from its headers, read against a clock.
``dtype_path`` - ``/dtype/<name>/...``: a quantized deployment asked for by URL.
``routes`` - the HTTP API: ``POST /request``, ``GET /response``, ``/status``...
``subscribe`` - ``WS /subscribe``, a blocking client's status stream.
``sio`` - Socket.IO at ``/ws/socket.io``, where the nnsight 0.6/0.7 clients wait
  for their job's statuses.
``open_sockets`` - one web process's websockets, counted per address and while unclaimed.
``hub`` - one Redis pub/sub connection per process for all its websockets.
``results`` - downloads of results kept in the filesystem store.
``model_files`` - ``/hub``: cached models' config and tokenizer files in the hub's
  shapes, for clients without the hub.
``prometheus`` - ``/metrics``, and every answered request counted for it.
``dashboard`` - ``/dashboard`` and its data. Its page is ``templates/dashboard.html``.
``admin`` - the dashboard's admin actions (deploy, evict, scale, kill, schedules),
  their form tokens and audit.
``operators`` - who the operator is (an admin key by HTTP Basic), the HTML refusal,
  the database handle.
``charts`` - the dashboard's SVG charts and the schedule's calendar, drawn on the server.
``gunicorn_conf`` - gunicorn's settings from the ``NDIF_*`` environment.
``gunicorn_logging`` - gunicorn's logger, with repeated records bounded in every web process.
"""
