"""RedisStreamSource on real data-parallel ranks (torch.distributed, gloo on 127.0.0.1):
states gathered with ``save_state_global`` on 2 ranks, scattered from rank 0 with
``restore_state_global`` on 3 ranks; every entry exactly once."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.dist_harness import run_ranks, values
from tests.redis_server import RedisServer, require_redis

pytestmark = pytest.mark.timeout(150)


def _loader(url: str, stream: str, workers: int) -> Any:
    import savable_loader as sl
    from savable_loader.sources import RedisStreamSource

    wc = sl.WorkerConfig(num_workers=workers, seed=0)  # rank and world size from torch.distributed
    return sl.SavableDataLoader(RedisStreamSource(url, stream, wc, follow=False), batch_size=None, worker_config=wc)


def _save(rank: int, world: int, url: str, stream: str, path: str) -> list[int]:
    from savable_loader.state.codec import encode

    loader = _loader(url, stream, 2)
    it = iter(loader)
    got = [int(next(it)["v"]) for _ in range(3 + 4 * rank)]
    del it
    states = loader.save_state_global(0)
    if rank == 0:
        assert states is not None
        Path(path).write_text(json.dumps([encode(s).hex() for s in states]))
    return got


def _restore(rank: int, world: int, url: str, stream: str, path: str) -> list[int]:
    from savable_loader.state.codec import decode

    states = [decode(bytes.fromhex(h)) for h in json.loads(Path(path).read_text())] if rank == 0 else None
    loader = _loader(url, stream, 1)
    loader.restore_state_global(states, src_rank=0)  # scattered from rank 0
    return [int(s["v"]) for s in loader]


def test_two_ranks_saved_three_ranks_restored_every_entry_once(tmp_path: Path) -> None:
    require_redis()
    stream = f"s-{uuid.uuid4().hex[:10]}"
    path = str(tmp_path / "states.json")
    with RedisServer() as server:
        pipe = server.client().pipeline()
        for i in range(50):
            pipe.xadd(stream, {"v": str(i).encode()})
        pipe.execute()
        before = values(run_ranks(_save, 2, server.url, stream, path, timeout=120))
        after = values(run_ranks(_restore, 3, server.url, stream, path, timeout=120))
    assert before == [list(range(0, 6, 2)), list(range(1, 14, 2))]
    consumed = [x for part in before for x in part]
    left = sorted(set(range(50)) - set(consumed))
    assert [left[r::3] for r in range(3)] == after
    assert sorted(consumed + [x for part in after for x in part]) == list(range(50))
