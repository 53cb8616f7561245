"""Property test: random savable pipelines resume exactly, types and dtypes included.

Hypothesis builds random pipelines from the exported wrappers (``sl.wrappers.__all__``)
over ``IterableSource`` with and without ``seek`` and over a source without restore
keys; samples are tensors of several dtypes, NumPy scalars and arrays (0-d included),
nested dicts and tuples, strings, or token sequences; sources and maps draw from the
three global RNGs. For each pipeline it takes the uninterrupted stream of two epochs,
saves at random points (between epochs too), encodes and decodes the state, restores it
into a fresh loader and checks that the rest of the stream is the reference's, bit for
bit, types and dtypes included (``tests.common.assert_same``), with 0 or 2 worker
processes and with both snapshot policies (the default one, which mostly replays from an
older snapshot, and a snapshot before every item).

Profiles (environment variable ``SAVABLE_LOADER_PROPERTY_PROFILE``):

* ``ci`` (the default): the pipelines earlier runs found (``FOUND``), then a fixed set of
  450 examples (``derandomize``, about 365 of them non-empty pipelines, 76 with worker
  processes; 40 s on an idle core, up to 2 minutes on two cores shared with other jobs),
  so that CI is reproducible. They run the same lines and branches of ``savable_loader``
  as 600 did, worker processes included (measured with coverage.py); 300 did not (the
  best-fit packing paths among others);
* ``long``: random examples, in Hypothesis runs of 40, for
  ``SAVABLE_LOADER_PROPERTY_MINUTES`` minutes (default 30) or until
  ``SAVABLE_LOADER_PROPERTY_EXAMPLES`` pipelines (default 100,000), whichever comes
  first; failures are kept in the local Hypothesis database (``.hypothesis/``) and
  replayed first on the next run. At the end it prints how many pipelines it ran. For
  example::

      SAVABLE_LOADER_PROPERTY_PROFILE=long SAVABLE_LOADER_PROPERTY_MINUTES=20 \\
          python -m pytest -q -s -p no:cacheprovider tests/pipeline/test_pipeline_properties.py

A failure prints the pipeline (``Pipeline(...)``) and the save points; the same
arguments rebuild it with :func:`build_loader` (``check_resume_everywhere(lambda:
build_loader(p, tmp_dir), 2)`` replays it at every step).

Not generated (see docs/custom_dataset.md and the wrappers' docstrings):
``EpochizeDataset`` over a source without keys, whose epoch-boundary replay is exact only
when the inner state does not depend on global random draws other than those re-seeded
by keys.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import savable_loader as sl
import savable_loader.pipeline.worker as worker_module
from savable_loader import wrappers as w
from savable_loader.sources import IterableSource, StreamInfo
from tests.common import check_resume_everywhere, epochs_of

PROFILE = os.environ.get("SAVABLE_LOADER_PROPERTY_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"SAVABLE_LOADER_PROPERTY_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
LONG_MINUTES = float(os.environ.get("SAVABLE_LOADER_PROPERTY_MINUTES", "30"))
LONG_EXAMPLES = int(os.environ.get("SAVABLE_LOADER_PROPERTY_EXAMPLES", "100000"))
LONG_CHUNK_DEFAULT = 40

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "savable-loader-ci",
    max_examples=450,
    derandomize=True,
    database=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    **_COMMON,
)
settings.register_profile("savable-loader-long", max_examples=LONG_CHUNK_DEFAULT, print_blob=True, **_COMMON)

pytestmark = [
    pytest.mark.timeout(int(LONG_MINUTES * 60 * 2 + 600) if PROFILE == "long" else 900),
    pytest.mark.filterwarnings("ignore::savable_loader.sources.ReplayWarning"),
    pytest.mark.filterwarnings("ignore::savable_loader.wrappers.EpochizeReplayWarning"),
]

# The wrappers the generator draws from: every exported one (the test below checks).
GENERATED_WRAPPERS = {
    "BatchDataset",
    "BlendDataset",
    "ConcatDataset",
    "EpochizeDataset",
    "FilterDataset",
    "GcDataset",
    "GroupBatchDataset",
    "LimitDataset",
    "LogSampleDataset",
    "MapDataset",
    "MicroBatchDataset",
    "PackingDataset",
    "RepeatDataset",
    "ShuffleBufferDataset",
}

# -- samples ------------------------------------------------------------------------------

TORCH_DTYPES = ["float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "uint8", "bool", "complex64"]
NUMPY_DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


@dataclass(frozen=True)
class Samples:
    """The kind of sample every source of a pipeline yields, with its dtypes."""

    kind: str  # "tensor", "numpy", "nested", "tokens"
    torch_dtype: str = "float32"
    numpy_dtypes: tuple[str, ...] = ("float32", "int32", "int16")


def _np_value(dtype: str, value: float) -> Any:
    """``value`` as a NumPy scalar of ``dtype`` (integers wrap, bools are parity)."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return np.bool_(int(value) % 2)
    if kind in "iu":
        return np.array(int(value)).astype(dtype)[()]
    if kind == "c":
        return np.array(complex(value, -value / 2)).astype(dtype)[()]
    return np.array(value).astype(dtype)[()]


def _tensor(dtype: str, values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    if dtype == "bool":
        return (t.long() % 2).bool()
    if dtype == "complex64":
        return torch.complex(t, -t).to(torch.complex64)
    target = getattr(torch, dtype)
    if not target.is_floating_point:
        return (t.long() % 100).to(target)
    return t.to(target)


def make_sample(spec: Samples, source: int, i: int) -> Any:
    """Sample ``i`` of source ``source``; draws from Python's, NumPy's and torch's global RNGs."""
    a, b, c = random.randrange(1000), int(np.random.randint(0, 1000)), int(torch.randint(0, 1000, ()))
    base = 1000 * source + i
    if spec.kind == "tokens":
        return torch.arange(i % 4, dtype=torch.int64) + base + a % 7
    if spec.kind == "tensor":
        return _tensor(spec.torch_dtype, [base + a / 1000, b / 1000])
    x, y, z = spec.numpy_dtypes
    if spec.kind == "numpy":
        return {
            "x": _np_value(x, base + c / 1000),
            "y": np.array([a, b], dtype=np.int64).astype(y),
            "z": np.array(_np_value(z, i + 0.5)),
        }
    return {
        "a": (_tensor(spec.torch_dtype, [base, c]), _np_value(x, a)),
        "b": {"s": f"s{base}-{a % 10}", "n": np.str_(f"n{b % 10}"), "t": (i, "x")},
        "i": base,
    }


def augment(x: Any) -> Any:
    """A random augmentation that keeps every type and dtype (draws from all three RNGs)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return x ^ (torch.rand(x.shape) < 0.5)
        if x.is_floating_point() or x.is_complex():
            return x + torch.rand(x.shape).to(x.dtype)
        return (x.to(torch.int64) + torch.randint(0, 3, x.shape)).to(x.dtype)  # torch cannot add uint16
    if isinstance(x, np.ndarray):
        noise = np.random.randint(0, 3, x.shape)
        out = x ^ (noise == 0) if x.dtype.kind == "b" else x + noise
        return np.array(out).astype(x.dtype)  # np.array: a 0-d array stays one (x + 1 is a scalar)
    if isinstance(x, np.generic):
        if isinstance(x, np.str_):
            return np.str_(x + chr(97 + random.randrange(26)))
        return (
            _np_value(x.dtype.name, float(np.real(x)) + random.randrange(3))
            if x.dtype.kind != "b"
            else np.bool_(x ^ (random.random() < 0.5))
        )
    if isinstance(x, bool):
        return x
    if isinstance(x, int):
        return x + random.randrange(3)
    if isinstance(x, str):
        return x + chr(97 + random.randrange(26))
    if isinstance(x, tuple):
        return tuple(augment(v) for v in x)
    if isinstance(x, list):
        return [augment(v) for v in x]
    if isinstance(x, dict):
        return {k: augment(v) for k, v in x.items()}
    return x


def checksum(x: Any) -> int:
    """A deterministic number read from a sample or batch (group keys, filters)."""
    if isinstance(x, torch.Tensor):
        return int(x.to(torch.complex128).real.abs().sum()) if x.numel() else 0
    if isinstance(x, np.ndarray):
        return int(np.abs(np.real(x.astype(np.complex128))).sum()) if x.size else 0
    if isinstance(x, (str, np.str_)):
        return len(x)
    if isinstance(x, (np.generic, int, float)):
        return abs(int(np.real(x)))  # int first: abs(np.int8(-128)) overflows
    if isinstance(x, (list, tuple)):
        return sum(checksum(v) for v in x)
    if isinstance(x, dict):
        return sum(checksum(v) for v in x.values())
    return 0


def parity(x: Any) -> int:
    return checksum(x) % 2


def parity_as_numpy(x: Any) -> tuple[Any, ...]:
    """A group key of NumPy scalars in a tuple (the bucket holds it as plain values)."""
    return (np.int64(checksum(x) % 2), np.bool_(True))


def keep_most(x: Any) -> bool:
    return checksum(x) % 4 != 1


def keep_at_random(x: Any) -> bool:
    return random.random() < 0.75


def as_tuple(batch: list[Any]) -> tuple[Any, ...]:
    return tuple(batch)


def keep(item: Any) -> Any:
    return item


# -- pipelines ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    kind: str  # "seek", "no_seek", "keyless"
    n: int
    index: int  # distinguishes the sources of one pipeline


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[Any, ...] = ()
    children: tuple[tuple[Source, tuple[Step, ...]], ...] = ()  # blend / concat: (source, steps) each


@dataclass(frozen=True)
class Pipeline:
    samples: Samples
    base: Step | Source  # a Source, or a blend / concat Step
    steps: tuple[Step, ...]
    num_workers: int
    seed: int
    policy: str  # "default" or "every"


class KeylessSource(sl.SavableDataset):
    """This worker's samples without restore keys; draws from the global RNGs when it runs out."""

    _savable_fields = ("pos",)

    def __init__(self, spec: Samples, n: int, index: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.spec, self.n, self.index = spec, n, index
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self) -> Any:
        while self.pos < self.n:
            i = self.pos
            self.pos += self.worker_config.workers_per_rank
            yield make_sample(self.spec, self.index, i)
        random.random(), np.random.rand(), torch.rand(())

    def config(self) -> dict[str, Any]:
        return {"n": self.n, "index": self.index}


def build_source(samples: Samples, source: Source, wc: sl.WorkerConfig) -> sl.SavableDataset:
    if source.kind == "keyless":
        return KeylessSource(samples, source.n, source.index, wc)

    def fn(info: StreamInfo) -> Any:
        return (make_sample(samples, source.index, i) for i in info.split(range(source.n)))

    def seek(info: StreamInfo, position: int) -> Any:
        step = info.num_global_workers
        return (
            make_sample(samples, source.index, i) for i in range(info.global_worker + position * step, source.n, step)
        )

    return IterableSource(fn, wc, seek=seek if source.kind == "seek" else None)


def apply(step: Step, ds: sl.SavableDataset, log_dir: str) -> sl.SavableDataset:
    name, args = step.name, step.args
    if name == "map":
        return w.MapDataset(ds, augment)
    if name == "filter":
        return w.FilterDataset(ds, keep_at_random if args[0] == "random" else keep_most)
    if name == "shuffle":
        return w.ShuffleBufferDataset(ds, args[0])
    if name == "batch":
        size, drop_last, collate = args
        return w.BatchDataset(ds, size, drop_last=drop_last, collate_fn=default_collate if collate else as_tuple)
    if name == "group":
        size, drop_last, collate, *key = args  # key: older examples have none
        key_fn = parity_as_numpy if key == ["numpy"] else parity
        return w.GroupBatchDataset(
            ds, size, key_fn, drop_last=drop_last, collate_fn=default_collate if collate else as_tuple
        )
    if name == "micro":
        return w.MicroBatchDataset(ds, args[0])
    if name == "packing":
        row, strategy, buffer, bos = args
        return w.PackingDataset(ds, row, strategy=strategy, buffer_size=buffer, bos=bos)
    if name == "limit":
        return w.LimitDataset(ds, args[0])
    if name == "repeat":
        return w.RepeatDataset(ds, args[0])
    if name == "endless":  # an endless repetition, cut by a limit or into epochs
        how, length = args
        repeated = w.RepeatDataset(ds)
        return w.LimitDataset(repeated, length) if how == "limit" else w.EpochizeDataset(repeated, length)
    if name == "epochize":
        return w.EpochizeDataset(ds, args[0])
    if name == "gc":
        return w.GcDataset(ds, args[0], generation=0, freeze=args[1])
    if name == "log":
        return w.LogSampleDataset(ds, log_dir)
    raise ValueError(name)


def build_dataset(p: Pipeline, log_dir: str) -> sl.SavableDataset:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=p.num_workers, seed=p.seed)

    def chain(source: Source, steps: tuple[Step, ...]) -> sl.SavableDataset:
        ds = build_source(p.samples, source, wc)
        for step in steps:
            ds = apply(step, ds, log_dir)
        return ds

    if isinstance(p.base, Source):
        ds = build_source(p.samples, p.base, wc)
    else:
        parts = [chain(source, steps) for source, steps in p.base.children]
        if p.base.name == "blend":
            weights, exhausted = p.base.args
            ds = w.BlendDataset(parts, list(weights), exhausted=exhausted)
        else:
            ds = w.ConcatDataset(parts)
    for step in p.steps:
        ds = apply(step, ds, log_dir)
    return ds


def build_loader(p: Pipeline, log_dir: str) -> sl.SavableDataLoader:
    """A loader over pipeline ``p``; the loader hands items over as they are (no conversion
    of NumPy scalars to tensors), so that their types are compared too."""
    kw: dict[str, Any] = {"multiprocessing_context": "fork"} if p.num_workers else {}
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=p.num_workers, seed=p.seed)
    return sl.SavableDataLoader(build_dataset(p, log_dir), batch_size=None, worker_config=wc, collate_fn=keep, **kw)


# -- strategies -----------------------------------------------------------------------------


@st.composite
def sample_specs(draw: st.DrawFn) -> Samples:
    kind = draw(st.sampled_from(["tensor", "numpy", "nested", "tokens"]))
    return Samples(
        kind=kind,
        torch_dtype=draw(st.sampled_from(TORCH_DTYPES)),
        numpy_dtypes=tuple(draw(st.lists(st.sampled_from(NUMPY_DTYPES), min_size=3, max_size=3))),
    )


@dataclass
class _Stream:
    """What the steps drawn so far yield (to draw only steps that apply)."""

    tokens: bool  # 1-D token tensors (packing applies)
    stackable: bool  # items of one shape (default_collate applies)
    keyless: bool  # some source gives no keys
    after_default_batch: int = 0  # batch size if the last step was a default-collated BatchDataset
    names: list[str] = field(default_factory=list)
    bos: bool = False  # a packing step put BOS in: a later one must not (its documents start with it)


@st.composite
def step_lists(draw: st.DrawFn, stream: _Stream, max_steps: int) -> tuple[Step, ...]:
    steps: list[Step] = []
    for _ in range(draw(st.integers(0, max_steps))):
        # maps twice: random draws above a wrapper are what a resume most easily gets wrong
        options = ["map", "map", "filter", "shuffle", "batch", "group", "limit", "repeat", "endless", "gc", "log"]
        if stream.tokens:
            options.append("packing")
        if stream.after_default_batch:
            options.append("micro")
        if not stream.keyless:
            options.append("epochize")
        name = draw(st.sampled_from(options))
        batch_size = stream.after_default_batch
        stream.after_default_batch = 0
        if name == "filter":
            step = Step(name, (draw(st.sampled_from(["random", "hash"])),))
        elif name == "shuffle":
            step = Step(name, (draw(st.integers(1, 5)),))
        elif name in ("batch", "group"):
            size = draw(st.integers(1, 4))
            drop_last = draw(st.booleans())
            collate = stream.stackable and draw(st.booleans())
            step = Step(
                name,
                (size, drop_last, collate)
                if name == "batch"
                else (size, drop_last, collate, draw(st.sampled_from(["int", "numpy"]))),
            )
            stream.stackable = collate and drop_last
            stream.tokens = False
            if name == "batch" and collate:
                stream.after_default_batch = size
        elif name == "micro":
            step = Step(name, (draw(st.integers(1, batch_size)),))
            stream.stackable = False
        elif name == "packing":
            step = Step(
                name,
                (
                    draw(st.integers(1, 6)),
                    draw(st.sampled_from(["greedy", "best_fit"])),
                    draw(st.integers(1, 4)),
                    None if stream.bos else draw(st.sampled_from([None, -1])),
                ),
            )
            stream.bos = stream.bos or step.args[3] is not None
            stream.stackable = True
        elif name == "limit":
            step = Step(name, (draw(st.integers(0, 12)),))
        elif name == "repeat":
            step = Step(name, (draw(st.integers(0, 3)),))
        elif name == "endless":
            how = draw(st.sampled_from(["limit", "epochize"] if not stream.keyless else ["limit"]))
            step = Step(name, (how, draw(st.integers(1, 12))))
        elif name == "epochize":
            step = Step(name, (draw(st.integers(1, 12)),))
        elif name == "gc":
            step = Step(name, (draw(st.integers(1, 4)), draw(st.booleans())))
        else:
            step = Step(name)
        stream.names.append(name)
        steps.append(step)
    return tuple(steps)


@st.composite
def pipelines(draw: st.DrawFn) -> Pipeline:
    samples = draw(sample_specs())
    source_kinds = st.sampled_from(["seek", "no_seek", "keyless"])
    layout = draw(st.sampled_from(["single", "single", "blend", "concat"]))
    tokens = samples.kind == "tokens"
    if layout == "single":
        base: Step | Source = Source(draw(source_kinds), draw(st.integers(0, 10)), 0)
        keyless = base.kind == "keyless"
    else:
        children = []
        keyless = False
        for index in range(draw(st.integers(2, 3))):
            source = Source(draw(source_kinds), draw(st.integers(0, 8)), index)
            keyless |= source.kind == "keyless"
            inner = _Stream(tokens=tokens, stackable=not tokens, keyless=source.kind == "keyless")
            # per-source steps that keep samples samples (a blend of batches and samples would not collate)
            steps = tuple(s for s in draw(step_lists(inner, 2)) if s.name in ("map", "filter", "shuffle", "repeat"))
            children.append((source, steps))
        if layout == "blend":
            weights = tuple(
                draw(st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=len(children), max_size=len(children)))
            )
            base = Step("blend", (weights, draw(st.sampled_from(["drop", "stop"]))), tuple(children))
        else:
            base = Step("concat", (), tuple(children))
    stream = _Stream(tokens=tokens, stackable=not tokens, keyless=keyless)
    steps = draw(step_lists(stream, 5))
    return Pipeline(
        samples=samples,
        base=base,
        steps=steps,
        num_workers=draw(st.sampled_from([0, 0, 0, 2])),
        seed=draw(st.integers(0, 2**31)),
        policy=draw(st.sampled_from(["default", "every", "every"])),
    )


# -- the property -----------------------------------------------------------------------------

RUNS = {"pipelines": 0, "save_points": 0, "items": 0, "with_workers": 0, "started": time.monotonic()}

#: Examples per Hypothesis run in the long profile, which runs them until its time is up.
LONG_CHUNK = LONG_CHUNK_DEFAULT


#: Save points, in thousandths of the reference stream (the first two only with workers).
SAVE_POINTS = st.lists(st.integers(0, 1000), min_size=1, max_size=6, unique=True)

# The pipelines the first runs found (issue #21 and what the property test found since),
# run first by every profile; each also has its own regression test.
FOUND = [
    # finding 1: a random map above a draining shuffle buffer over a source without seek
    (
        Pipeline(
            Samples("numpy", numpy_dtypes=("bool", "bool", "bool")),
            Source("no_seek", 2, 0),
            (Step("shuffle", (3,)), Step("map")),
            num_workers=0,
            seed=0,
            policy="default",
        ),
        [126],
    ),
    # an EpochizeDataset inside a RepeatDataset, saved between epochs
    (
        Pipeline(
            Samples("tensor"),
            Step("blend", ((0.5, 0.5), "drop"), ((Source("seek", 1, 0), ()), (Source("seek", 1, 1), ()))),
            (Step("epochize", (1,)), Step("endless", ("limit", 9))),
            num_workers=0,
            seed=0,
            policy="default",
        ),
        [0, 500],
    ),
    # a source without keys beside a drained shuffle buffer in a blend
    (
        Pipeline(
            Samples("tensor"),
            Step(
                "blend",
                ((0.5, 0.5, 0.5), "drop"),
                (
                    (Source("keyless", 3, 0), ()),
                    (Source("seek", 1, 1), (Step("shuffle", (2,)),)),
                    (Source("seek", 0, 2), ()),
                ),
            ),
            (),
            num_workers=0,
            seed=1,
            policy="default",
        ),
        [250],
    ),
]


def check_pipeline(p: Pipeline, where: list[int]) -> None:
    """The property: for every save point drawn, the resumed stream is the reference's."""
    note(repr(p))
    where = where[:2] if p.num_workers else where
    log_dir = tempfile.mkdtemp(prefix="sl-prop-")
    saved_budget = worker_module.SNAPSHOT_BUDGET
    try:
        if p.policy == "every":
            worker_module.SNAPSHOT_BUDGET = 1e12
        reference = epochs_of(build_loader(p, log_dir), 2)
        total = sum(len(e) for e in reference)
        if total == 0 or total > 120:
            return  # nothing to resume / too long for the budget
        steps = sorted({round(f * total / 1000) for f in where})
        note(f"save after {steps} of {total} items")
        checked = check_resume_everywhere(lambda: build_loader(p, log_dir), 2, steps=steps, reference=reference)
    finally:
        worker_module.SNAPSHOT_BUDGET = saved_budget
        shutil.rmtree(log_dir, ignore_errors=True)
    RUNS["pipelines"] += 1
    RUNS["save_points"] += checked
    RUNS["items"] += total
    RUNS["with_workers"] += bool(p.num_workers)


def run_examples(profile: settings) -> None:
    """One Hypothesis run of :func:`check_pipeline` under ``profile``."""
    test = given(pipelines(), SAVE_POINTS)(check_pipeline)
    for p, where in FOUND:
        test = example(p, where)(test)
    settings(profile)(test)()


def test_random_pipelines_resume_exactly() -> None:
    if PROFILE == "ci":
        run_examples(settings.get_profile("savable-loader-ci"))
        return
    stop = RUNS["started"] + LONG_MINUTES * 60
    long = settings.get_profile("savable-loader-long")
    while time.monotonic() < stop and RUNS["pipelines"] < LONG_EXAMPLES:
        run_examples(settings(long, max_examples=LONG_CHUNK))


def test_zz_report_runs() -> None:
    """Prints what the property test ran (run with ``-s`` to see it)."""
    minutes = (time.monotonic() - RUNS["started"]) / 60
    print(
        f"\n[{PROFILE} profile] {RUNS['pipelines']} random pipelines ({RUNS['with_workers']} with 2 workers), "
        f"{RUNS['save_points']} save points, {RUNS['items']} reference items, {minutes:.1f} min"
    )


def test_every_exported_wrapper_is_generated() -> None:
    assert set(w.__all__) - {"BaseWrapperDataset", "EpochizeReplayWarning"} == GENERATED_WRAPPERS


def test_the_generator_builds_every_step_kind() -> None:
    # a pipeline of every kind of step, built and iterated (the generator draws from these)
    samples = Samples("tokens")
    base = Step(
        "blend",
        ((1.0, 2.0), "drop"),
        ((Source("seek", 5, 0), (Step("map"),)), (Source("no_seek", 4, 1), (Step("shuffle", (2,)),))),
    )
    steps = (
        Step("packing", (3, "best_fit", 2, -1)),
        Step("filter", ("hash",)),
        Step("gc", (2, False)),
        Step("log"),
        Step("endless", ("epochize", 6)),
        Step("batch", (2, True, True)),
        Step("micro", (1,)),
        Step("group", (2, False, False, "numpy")),
        Step("repeat", (2,)),
        Step("limit", (5,)),
    )
    p = Pipeline(samples, base, steps, num_workers=0, seed=1, policy="default")
    log_dir = tempfile.mkdtemp(prefix="sl-prop-")
    try:
        assert check_resume_everywhere(lambda: build_loader(p, log_dir), 2) >= 5
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_the_resume_checker_expects_empty_epochs_right() -> None:
    # found by this module: a save between epochs at k=0 after an empty first epoch
    from tests.common import expected_chunks

    assert expected_chunks([0, 1], 0, True) == [1]
    assert expected_chunks([0, 0, 2], 0, True) == [0, 2]
    assert expected_chunks([2, 0, 3], 2, True) == [0, 3]
    assert expected_chunks([1, 0, 2], 1, False) == [0, 0, 2]
    assert expected_chunks([0, 1], 0, False) == [0, 1]


@pytest.mark.parametrize(("mode", "length"), [("stop", 7), ("drop", 6)])
def test_epochize_in_repeat_resumes_from_a_carried_end_state(mode, length, monkeypatch):
    """Found by the CI profile under load: a restored run whose snapshots are sparse hands
    the next epoch its end state (carried); restored outside the pass it was taken in,
    the EpochizeDataset inside the RepeatDataset rebuilt the next epoch by a replay under
    other seeds, so the blend below drew other samples. Here the policy is exact: no
    snapshot after a restore until the epoch's end."""
    monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 1e12)
    monkeypatch.setattr(worker_module, "REPLAY_FRACTION", 0.0)
    monkeypatch.setattr(worker_module, "REPLAY_FLOOR_SECONDS", 3600.0)
    sources = tuple((Source(kind="seek", n=n, index=i), ()) for i, n in enumerate((0, 4, 8)))
    p = Pipeline(
        samples=Samples(kind="tensor", torch_dtype="float32", numpy_dtypes=("bool", "bool", "bool")),
        base=Step(name="blend", args=((0.5, 0.5, 0.5), mode), children=sources),
        steps=(Step(name="epochize", args=(length,), children=()), Step(name="repeat", args=(3,), children=())),
        num_workers=0,
        seed=0,
        policy="every",
    )
    log_dir = tempfile.mkdtemp(prefix="sl-prop-")
    try:
        assert check_resume_everywhere(lambda: build_loader(p, log_dir), 2) >= 20
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
