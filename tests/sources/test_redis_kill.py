"""A training process reading a Redis stream, killed with SIGKILL mid-stream and restarted
from its last checkpoint, consumes every entry exactly once, in order.

The trainer checkpoints after every step: the "model" (the values consumed so far) and
the loader's state in one file, written atomically. A producer thread writes the entries
while the trainer runs; the test kills the trainer's whole process group (workers
included) twice, at moments it does not choose precisely.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, require_redis

ROOT = Path(__file__).resolve().parents[2]

TRAINER = r"""
import json, os, sys
import savable_loader as sl
from savable_loader.sources import RedisStreamSource
from savable_loader.state.codec import decode, encode

url, stream, path, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
consumed, state = [], None
if os.path.exists(path):
    with open(path) as f:
        ckpt = json.load(f)
    consumed, state = ckpt["consumed"], bytes.fromhex(ckpt["loader"])
wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
loader = sl.SavableDataLoader(RedisStreamSource(url, stream, wc, follow=True, timeout=60), batch_size=None, worker_config=wc)
if state is not None:
    loader.restore_state_rank(decode(state))
for sample in loader:
    if len(consumed) >= total:
        break
    consumed.append(int(sample["v"]))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"consumed": consumed, "loader": encode(loader.save_state_rank()).hex()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if len(consumed) >= total:
        break
"""


def _progress(path: Path) -> int:
    try:
        return len(json.loads(path.read_text())["consumed"])
    except (OSError, ValueError):
        return 0


@pytest.mark.timeout(150)
def test_sigkill_mid_stream_and_restart_consumes_every_entry_once(tmp_path: Path) -> None:
    require_redis()
    total = 60
    stream = f"s-{uuid.uuid4().hex[:10]}"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    ckpt = tmp_path / "ckpt.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with RedisServer() as server:
        client = server.client()

        def produce() -> None:
            for i in range(total):
                client.xadd(stream, {"v": str(i).encode()})
                time.sleep(0.02)

        producer = threading.Thread(target=produce)
        producer.start()

        def run() -> subprocess.Popen[bytes]:
            args = [sys.executable, str(script), server.url, stream, str(ckpt), str(total)]
            return subprocess.Popen(args, env=env, start_new_session=True)

        kills = 0
        for stop_at in (total // 4, total // 2):
            proc = run()
            deadline = time.monotonic() + 60
            while _progress(ckpt) < stop_at and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert proc.poll() is None, f"the trainer exited with {proc.returncode} before it was killed"
            os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its workers, mid-stream
            proc.wait(10)
            kills += 1
        proc = run()
        assert proc.wait(90) == 0
        producer.join()
    assert kills == 2
    assert json.loads(ckpt.read_text())["consumed"] == list(range(total))
