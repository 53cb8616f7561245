"""Logical workers hosted by loading contexts: a pipeline state resumed under another
``num_workers``.

A savable pipeline's state saved with ``K`` workers describes ``K`` **logical
workers**, each with its snapshot, skip offset, consumed count and exhausted flag. A
loader restored with ``K'`` workers has ``P = max(K', 1)`` loading contexts (worker
processes, or the main process). For the rest of that epoch the ``K`` logical workers go
on, each in its own copy of the pipeline, under a worker view that says
``rank_worker_id() == l`` and ``workers_per_rank == K`` (``_LogicalWorkers``): each
logical worker yields exactly the items it yields in an uninterrupted ``K``-worker run.

The layout is a function of ``K`` and ``P`` alone: there are ``hosts = min(P, K)``
hosting contexts, and context slot ``s`` hosts logical workers ``s, s + hosts, s + 2 *
hosts, ...``; contexts beyond ``hosts`` host none and end at once. Physical worker
``p`` plays slot ``(p + rotation) % hosts``, so that the slot that yields next is played
by physical worker 0 (torch's round robin starts there). With ``K == P`` each slot hosts
one logical worker and this is the ordinary rotation.

A context hosting several logical workers interleaves them (:func:`interleave`): the
next item comes from the hosted logical worker with the fewest items produced, ties to
the lowest id; an exhausted one drops out. That rule depends on the per-worker counts
only, which a state records, so a state saved during such a run and restored with the
same ``num_workers`` continues it in the same order: ``PipelinePosition.next_worker`` is
then the lowest logical worker of the slot that yields next (its slot is ``next_worker %
hosts``). Every item stays tagged with its logical worker.

Memory: a context hosting ``n`` logical workers holds ``n`` copies of the pipeline (``n``
shuffle buffers, ``n`` open shards), for the rest of the restored epoch.

Example::

    hosted_by(physical=0, rotation=0, logical=3, contexts=2)   # [0, 2]
    hosted_by(physical=1, rotation=0, logical=3, contexts=2)   # [1]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from savable_loader.config import _LogicalWorkers

__all__ = ["MAX_LOGICAL_WORKERS", "hosted_by", "hosts", "in_view", "interleave", "slot_of"]

#: The most logical workers a restored pipeline state may have per rank: each one hosted
#: is a copy of the pipeline, so a state claiming a huge number (a corrupt or hostile
#: file) would exhaust memory instead of raising.
MAX_LOGICAL_WORKERS = 1024


def hosts(logical: int, contexts: int) -> int:
    """How many loading contexts host ``logical`` logical workers on ``contexts``.

    >>> hosts(logical=2, contexts=3), hosts(logical=3, contexts=1), hosts(logical=2, contexts=2)
    (2, 1, 2)
    """
    return max(min(logical, contexts), 1)


def slot_of(logical: int, hosting: int) -> int:
    """The slot that hosts ``logical`` among ``hosting`` hosting contexts.

    >>> slot_of(5, 2)
    1
    """
    return logical % hosting


def hosted_by(physical: int, rotation: int, logical: int, contexts: int) -> list[int]:
    """The logical workers (of ``logical``) that physical worker ``physical`` (of
    ``contexts``) hosts when slot ``rotation`` yields first.

    >>> hosted_by(0, 1, logical=3, contexts=2), hosted_by(2, 0, logical=2, contexts=3)
    ([1], [])
    """
    n = hosts(logical, contexts)
    if physical >= n:
        return []
    return list(range((physical + rotation) % n, logical, n))


def in_view(items: Iterator[Any], workers: int) -> Iterator[Any]:
    """``items``, each produced under a worker view of ``workers`` logical workers
    (``WorkerConfig.workers_per_rank``); the caller's code between items sees none."""
    while True:
        with _LogicalWorkers(workers):
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


def interleave(runs: list[tuple[int, int, Iterator[Any]]]) -> Iterator[Any]:
    """The items of several hosted logical workers, ``runs`` of ``(logical id, items
    produced before, items)``: next from the one with the fewest produced, ties to the
    lowest id; one that ends drops out (its ``End`` marker, the item without an
    ``item_index``, is passed on; see ``pipeline/worker.py``).

    >>> from savable_loader.pipeline.worker import End, Item
    >>> a = iter([Item(0, 3, None, "a3"), End(0, 4)])
    >>> b = iter([Item(1, 1, None, "b1"), Item(1, 2, None, "b2"), Item(1, 3, None, "b3"), End(1, 4)])
    >>> [getattr(i, "payload", "end") for i in interleave([(0, 3, a), (1, 1, b)])]
    ['b1', 'b2', 'a3', 'b3', 'end', 'end']
    """
    live: list[tuple[list[int], Iterator[Any]]] = [([produced, logical], items) for logical, produced, items in runs]
    while live:
        entry = min(live, key=lambda e: e[0])
        try:
            item = next(entry[1])
        except StopIteration:  # started exhausted: nothing, not even an end marker
            live.remove(entry)
            continue
        index = getattr(item, "item_index", None)
        if index is None:
            live.remove(entry)
        else:
            entry[0][0] = index + 1
        yield item
