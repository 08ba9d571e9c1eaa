"""The supervisor behind ``rankwatch launch``: it owns an msrun job's processes and relaunches it after a failure.

* ``command``: the msrun line, with ``--join=False`` forced (the supervisor,
  not msrun, decides when an attempt has failed and how it ends) and a fresh
  ``--master_port`` per attempt on one node;
* ``procs``: the child subreaper, the processes of an attempt (told apart by
  the ``MS_ROLE`` msrun gives them), reaping, and SIGTERM then SIGKILL;
* ``attempt``: one attempt, from msrun's start until none of its processes is left;
* ``policy``: the budget, the no-progress and startup rules, the backoff,
  and the set the next attempt resumes from (``app.checkpoints.finite``: its weights are read
  for NaN and infinities first);
* ``lock``: one supervisor per run directory (and node);
* ``keeper``: a small process that ends the attempt if the supervisor dies;
* ``nodes``: several nodes, one supervisor each: the attempt ends on every
  node and node 0's plan relaunches them together;
* ``gaspask``: the supervisor's side of the dying gasp;
* ``supervisor``: the loop, the dying gasp it asks of the survivors
  (``trainer_bridge/gasp.py``), and the supervised lines of ``attempts.jsonl``;
* ``cause``: why an attempt ended, as the record those lines keep and in words.

It never imports MindSpore: it runs beside the job, like the dashboard.
"""
