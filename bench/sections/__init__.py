"""The bench's sections, one module per group of tables, each a mixin of ``bench.core.Bench``.

Why mixins: a section is a few methods that use the run's shared state (the
stacks, the null server, the local model, the JSON being written) and its
helpers (``call``, ``measure_into``, ``reference``, ``record``, ``emit``), all
on the ``Bench`` object; as mixins they keep that state in one place and read
as before, while each file holds one section. A section module imports
nothing of ``bench.core`` (the helpers come through ``self``), so the core
can import them all without a circle.

- ``timed``: the workloads timed in three columns (small trace ... big result,
  with its memory and serialization floor) and the cold start;
- ``isolation``: the in-process path against the isolated ones (fork, zygote);
- ``throughput``: requests/s from N client threads, one and two workers, on
  the main model and on a compute-bound one;
- ``cobatch``: co-batching off vs on against one worker, on the main model
  and on the compute-bound one;
- ``fairness``: one flooding key and five interactive ones, first in first
  out against fair turns;
- ``capacity``: ``bench/capacity.py`` run as a process of its own;
- ``checks``: the targets as PASS/FAIL/SKIP, and the values line.
"""
