"""A job's life on a worker: named steps, where the block runs, its deadline, its delivery.

Not ``ndif_celery.state.jobs``, which holds a job's keys and message in Redis.
Bottom first (docs/jobs.md tells the whole pipeline):

``current`` - ``CurrentJob``, the worker's job slot: the job it runs now, its thread
  and co-batch. It is written into the worker's registry entry. A kill interrupts it.
``context`` - ``JobContext``, what the steps use of their worker (``WorkerState`` is
  the one). So the steps never import the module that runs them.
``channel`` - ``FinalChannel``, a job's one final status. It is claimed in this
  process (by its thread or the watchdog) and across processes.
``deadline`` - deadlines that always fire. ``DeadlineWatchdog``, one thread per
  worker, publishes the timeout ERROR and interrupts the job's thread. It has a
  stuck worker replace itself. ``backstop`` is the C-level last resort. Not
  ``ndif_celery.farm.watchdog``'s ``FarmWatchdog``, the beat's rescuer of dead
  workers' jobs.
``deliveries`` - the worker's delivery thread. It stores results or sends them
  inline, publishes COMPLETED and closes jobs, while the next job's forward runs.
``executors`` - where a block runs, each owning its deadline. ``InProcess`` runs
  trusted keys in this process. ``Isolated`` runs untrusted keys in a zygote's jailed child.
``life`` - ``Life`` and a job's named steps, from taken to answered: start, announce,
  execute, deliver or fail, hand over, finish, close. It is the one place an
  exception becomes the client's ERROR.
``gather`` - a co-batch's life: a trusted lead takes its model's waiting trusted
  jobs and runs them together. ``next_job`` runs the queue's head without Celery.
"""
