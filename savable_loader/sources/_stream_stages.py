"""The arithmetic of a stream epoch's stages: which worker owns an entry, and what is left
when the ranks' states move to another world size.

A stream source deals the entries of an epoch out by their ordinal (``n``: the entry's
number since the stream's creation, 0-based, the same for every reader whenever it reads;
entries removed from the stream's start keep their numbers): worker ``w`` of rank ``r`` (``K`` workers per rank, ``W`` ranks) owns the
entries with ``n % (W * K) == r + W * w`` (its *residue*). An epoch starts as stage 0.
When the ranks' states are restored on another world size, the stage ends: residue ``g``
had consumed its first ``consumed[g]`` entries (a prefix of its progression). The next
stage is made of the entries no worker had consumed, in stream order, numbered from 0
again and dealt out the same way over the new ranks. A stage is ``W * K`` counts,
whatever the length of the stream: mapping an ordinal through it is O(1) past the point
where every residue's consumed prefix ends and O(W * K) before it.

Example::

    stage = Stage(world=2, workers=1, consumed=[2, 1])   # rank 0 took 0 and 2, rank 1 took 1
    [stage.next_ordinal(n) for n in range(6)]             # [None, None, None, 0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from savable_loader.core.elastic import ALL_CONSUMED
from savable_loader.errors import StateError

__all__ = ["ORIGIN", "Stage", "check_id", "checked_fields", "current_ordinal", "parse_id", "resplit_state", "stages_of"]

#: The id before every entry: an origin at the stream's head (its first entry then; its
#: ordinal is recorded once the reader has read, -1 before).
ORIGIN = "0-0"
#: The consumed count of a worker that had ended its epoch (every entry of its share).
_EVERYTHING = 2**62


def parse_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def check_id(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise StateError(f"RedisStreamSource state {what} is {value!r}, expected an entry id string '<ms>-<seq>'")
    try:
        ms, seq = parse_id(value)
    except ValueError:
        raise StateError(f"RedisStreamSource state {what} is {value!r}, expected an entry id '<ms>-<seq>'") from None
    if ms < 0 or seq < 0:
        raise StateError(f"RedisStreamSource state {what} is {value!r}, expected non-negative id parts")
    return value


class Stage:
    """An earlier stage of the epoch: ``world`` ranks of ``workers`` logical workers had
    consumed ``consumed[g]`` entries of residue ``g = rank + world * worker`` (of the
    stage's numbering). Maps a stage ordinal to the next stage's (None: consumed)."""

    def __init__(self, world: int, workers: int, consumed: Sequence[int]) -> None:
        self.period = world * workers
        self.consumed = list(consumed)
        self.total = sum(self.consumed)
        # from this ordinal on, every residue's consumed prefix lies behind
        self.flat = max((g + c * self.period for g, c in enumerate(self.consumed)), default=0)

    def next_ordinal(self, n: int) -> int | None:
        if n >= self.flat:
            return n - self.total
        g, m = n % self.period, n // self.period
        if m < self.consumed[g]:
            return None
        below = 0
        for h, c in enumerate(self.consumed):
            if n > h:
                below += min(c, -(-(n - h) // self.period))
        return n - below


def current_ordinal(stages: Sequence[Stage], ordinal: int) -> int | None:
    """The ordinal of the epoch's entry ``ordinal`` in the current stage (None: an
    earlier stage consumed it)."""
    n: int | None = ordinal
    for stage in stages:
        if n is None:
            return None
        n = stage.next_ordinal(n)
    return n


def checked_fields(fields: dict[str, Any]) -> tuple[list[Stage], tuple[str, int]]:
    """The stages and origin of a source state, after checking every field (a state is
    data from a file: malformed values are a StateError naming the field)."""
    for name in ("after", "end"):
        value = fields.get(name)
        if value != "":
            check_id(value, name)
    ordinal = fields.get("ordinal")
    if not isinstance(ordinal, int) or isinstance(ordinal, bool) or ordinal < -1:
        raise StateError(f"RedisStreamSource state ordinal is {ordinal!r}, expected an int >= -1")
    origin = fields.get("origin")
    if not (
        isinstance(origin, (list, tuple))
        and len(origin) == 2
        and isinstance(origin[1], int)
        and not isinstance(origin[1], bool)
        and origin[1] >= -1
    ):
        raise StateError(f"RedisStreamSource state origin is {origin!r}, expected [entry id, ordinal >= -1]")
    return stages_of(fields.get("stages")), (check_id(origin[0], "origin"), origin[1])


def _cursor_ordinal(origin: tuple[str, int]) -> int:
    """The ordinal of the entry a reader at ``origin`` reads after: the origin's own for an
    entry id; one before the recorded start at the stream's head; -2 for a reader that
    had not read (it starts wherever the head is, before any recorded position)."""
    entry_id, ordinal = origin
    if entry_id != ORIGIN:
        return ordinal
    return ordinal - 1 if ordinal >= 0 else -2


def stages_of(plain: Any) -> list[Stage]:
    if not isinstance(plain, list):
        raise StateError(f"RedisStreamSource state stages is {plain!r}, expected a list")
    out = []
    for i, st in enumerate(plain):
        ok = (
            isinstance(st, dict)
            and all(isinstance(st.get(k), int) and st[k] >= 1 for k in ("world_size", "workers"))
            and isinstance(st.get("consumed"), list)
            and len(st["consumed"]) == st["world_size"] * st["workers"]
            and all(isinstance(c, int) and c >= 0 for c in st["consumed"])
        )
        if not ok:
            raise StateError(
                f"RedisStreamSource state stages[{i}] is {st!r}, expected "
                "{'world_size': W, 'workers': K, 'consumed': [W * K counts >= 0]}"
            )
        out.append(Stage(st["world_size"], st["workers"], st["consumed"]))
    return out


def resplit_state(
    fields: Sequence[Sequence[dict[str, Any] | None]],
    world_size: int,
    new_world_size: int,
) -> dict[str, Any]:
    """The source state every new worker starts from when the states of ``world_size``
    ranks (``fields[r][w]``: the source fields of rank ``r``'s logical worker ``w`` at
    what the loop consumed, None for a worker that consumed nothing in the epoch) are
    restored on ``new_world_size`` ranks.

    The stage that ends adds ``{'world_size', 'workers', 'consumed'}`` (per residue
    ``r + world_size * w``, the entries of its progression up to the last it consumed:
    those before its first read had been removed from the stream); the new stage starts
    at the earliest position any old worker stopped at (the stream's head, wherever it
    is, if one had not read). What no old worker
    consumed, in stream order, is the new stage, numbered from 0 and split as usual
    (``n % new_world_size``, then by worker).
    """
    workers = {len(per_rank) for per_rank in fields}
    if len(fields) != world_size or len(workers) != 1:
        raise StateError(
            f"resplit needs {world_size} ranks with the same number of logical workers, got {[len(f) for f in fields]}"
        )
    k = workers.pop()
    present = [f for per_rank in fields for f in per_rank if f is not None and not f.get(ALL_CONSUMED)]
    checked = [checked_fields(f) for f in present]
    stages = present[0]["stages"] if present else []
    for p in present:
        if p["stages"] != stages:
            raise StateError("the ranks' RedisStreamSource states disagree on the earlier stages of the epoch")
    chain = stages_of(stages)
    period = world_size * k
    consumed = [0] * period
    # where each worker would read on: (the ordinal of its cursor, [id, ordinal] of the origin form)
    starts: list[tuple[int, list[Any]]] = []
    origins = iter(checked)
    for r, per_rank in enumerate(fields):
        for w, f in enumerate(per_rank):
            g = r + world_size * w
            if f is not None and f.get(ALL_CONSUMED):  # it had ended its epoch: all of its share
                consumed[g] = _EVERYTHING
                continue
            origin = next(origins)[1] if f is not None else (ORIGIN, -1)
            if f is None or not f["after"]:
                starts.append((_cursor_ordinal(origin), list(origin)))
                continue
            n = current_ordinal(chain, f["ordinal"])
            if n is None or n % period != g:
                raise StateError(
                    f"rank {r} worker {w}'s RedisStreamSource state is at ordinal {f['ordinal']}, which is not one "
                    f"of its entries (residue {g} of {period})"
                )
            consumed[g] = n // period + 1
            starts.append((f["ordinal"], [f["after"], f["ordinal"]]))
    if not starts:
        raise StateError("resplit needs a worker that had not ended its epoch")
    start = min(starts, key=lambda s: (s[0], s[1][0] == ORIGIN))[1]
    ends = [f["end"] for f in present if f["end"]]
    return {
        "after": "",
        "ordinal": -1,
        "end": max(ends, key=parse_id) if ends else "",
        "origin": start,
        "stages": [*stages, {"world_size": world_size, "workers": k, "consumed": consumed}],
    }
