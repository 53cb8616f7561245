"""Where the step time goes: ``loader.stats()``, the stats log and its report.

* ``clock``: in a loading context, each pipeline stage's own time, and the report sent
  with each item.
* ``timed``: a stage's iterator, timed while a clock is active in its thread.
* ``recorder``: in the main process, the training loop's waits in ``next()``, the
  workers' reports, the queue of ready items; the windows ``stats()`` and the log read.
* ``record``: :class:`LoaderStats`, what ``stats()`` returns and a log line holds.
* ``log``: the JSON-lines stats log (``stats_log=``).
* ``report``: ``python -m savable_loader report RUN.jsonl``: a run's log in words, and
  a plot with the ``plot`` extra.

May import: ``errors`` (msgspec and the standard library; matplotlib in the plot of a report, imported when it is drawn).

Example::

    loader = sl.SavableDataLoader(ds, batch_size=64, num_workers=4, stats_log="run/stats-{rank}.jsonl")
    for step, batch in enumerate(loader):
        ...
        if step % 100 == 0:
            print(loader.stats().summary())
"""

from savable_loader.stats.log import read_log
from savable_loader.stats.record import LoaderStats, QueueStats, StageStats, WorkerStats

__all__ = ["LoaderStats", "QueueStats", "StageStats", "WorkerStats", "read_log"]
