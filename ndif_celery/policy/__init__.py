"""Pure rules, with no Redis and no torch, so the web, the controller and the worker check alike.

``model_policy`` - ``ModelPolicy``: which repos load for whom (``NDIF_MODELS``,
  ``NDIF_TRUST_REMOTE_CODE``), and a model key and ``env`` in canonical form.
  Not ``workers.models``, the models a worker holds. Nor ``IsolationPolicy``,
  an untrusted child's limits in ``workers.isolation.parent``.
``held_formats`` - the formats a deployment may hold its weights in: torch's floats and
  nnsight's quantizations, read from nnsight's own table without torch.
``deployment_access`` - who may use a deployment that names its ``users``.
  ``farm.deployments.check_access`` reads the wishes, then asks it.
``client_versions`` - the client version gate the web applies at intake
  (``NDIF_MIN_NNSIGHT_VERSION``, ``NDIF_MIN_PYTHON_VERSION``).
``jail_layers`` - the jail's layer names and the settings that name them
  (``NDIF_JAIL_REQUIRE``, ``NDIF_JAIL_DISABLE``). They live apart from the jail,
  so any process can check them without loading it.
"""
