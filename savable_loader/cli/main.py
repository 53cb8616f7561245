"""Command line: ``python -m savable_loader <command>`` (or ``savable-loader <command>``).

Commands:

``demo``
    Train a tiny model, checkpointing model and loader every few steps; kill the
    training run with SIGKILL in the middle of an epoch, restart it from the checkpoint
    and check that the batches and the loss curve after the restart are bit-identical to
    an uninterrupted run (worker-side random augmentations included); ``--ranks N`` does
    the same on N data-parallel ranks (gloo on 127.0.0.1). Also shows what a plain
    ``torch.utils.data.DataLoader`` does. Exit code 0 if identical, 1 if not.

``inspect FILE [--json]``
    Summarise a state file (or raw encoded state bytes) without importing torch: kind,
    schema version, ranks, workers, epoch, position, the configuration it was saved
    under, sizes and an outline of each worker's dataset state. Exit code 2 if the file
    is not a readable state.

``report RUN.jsonl [RUN.jsonl ...] [--plot PNG]``
    Where the step time went: the stats logs a loader wrote (``stats_log=``) summarised
    per rank, the input wait share, workers' busy shares, each stage's time with the
    slowest named, and what to try; ``--plot`` draws the run (matplotlib, the ``plot``
    extra). Exit code 2 if a log is unreadable.

``index DIR_OR_URL [--storage-options JSON] [--workers N] [--sha256] [--force] [--quiet] [--json]``
    Index a folder of shards where it is (WebDataset tars, Parquet, ``.npy`` / ``.pt`` /
    ``.jsonl``, or an Energon / MosaicML Streaming / LitData folder): write
    ``metadata.json`` and any missing ``.tar.idx``, in parallel, with a progress line;
    a killed run resumes where it stopped. Never writes to a shard. Exit code 2 if the
    data is malformed (the message names the file and the byte offset).

Example::

    python -m savable_loader demo --workers 2 --steps 60 --seed 0
    python -m savable_loader demo --ranks 2 --steps 40
    python -m savable_loader inspect ckpt/loader.state --json
    python -m savable_loader index data/wds --workers 16
    python -m savable_loader report run/stats-0.jsonl --plot run/stats.png

This module imports neither torch nor the loader at import time: a command imports what
it needs when it runs, so commands that only read state files work without torch. To add
a command, write an ``_add_<name>_arguments(parser)`` and a ``_run_<name>(args) -> int``
function and list them in ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["main"]


class _Command(NamedTuple):
    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- demo -------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=_non_negative, default=2, metavar="W", help="loader worker processes (default: 2)"
    )
    parser.add_argument(
        "--steps",
        type=_positive,
        default=60,
        metavar="N",
        help="batches to train on in total, over several epochs (default: 60)",
    )
    parser.add_argument(
        "--kill-at",
        type=_positive,
        default=None,
        metavar="K",
        help="kill the training process once it has logged step K, 1 <= K < N "
        "(default: random in the middle third of the run, drawn from --seed)",
    )
    parser.add_argument("--seed", type=int, default=0, help="loader seed (default: 0)")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="folder for the step logs and the checkpoints (ckpt/step-S/model.pt, "
        "ckpt/step-S/loader.state, ckpt/latest) (default: a temporary folder, removed afterwards)",
    )
    parser.add_argument(
        "--ranks",
        type=_positive,
        default=1,
        metavar="N",
        help="data-parallel ranks, each a process with its own loader and workers, in a "
        "torch.distributed gloo group on 127.0.0.1 (default: 1)",
    )
    parser.add_argument(
        "--save-every",
        type=_positive,
        default=5,
        metavar="S",
        help="checkpoint model and loader every S steps (default: 5)",
    )
    parser.add_argument(
        "--step-ms",
        type=_non_negative_float,
        default=20.0,
        metavar="MS",
        help="extra time per training step, in milliseconds, standing in for a bigger model (default: 20)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=120.0,
        metavar="SEC",
        help="give up on a training process after SEC seconds (default: 120)",
    )
    # Internal: the demo runs its training runs as `demo --_child reference|train|resume`.
    parser.add_argument("--_child", choices=("reference", "train", "resume"), default=None, help=argparse.SUPPRESS)


def _run_demo(args: argparse.Namespace) -> int:
    if args.steps < 2:
        return _usage_error("demo", "--steps must be at least 2")
    if args.kill_at is not None and args.kill_at >= args.steps:
        return _usage_error("demo", f"--kill-at must be below --steps ({args.steps}), got {args.kill_at}")
    from savable_loader.cli import demo as _demo  # imports torch

    if args._child is not None:
        return _demo.child_main(args)
    return _demo.run(args)


# -- inspect ----------------------------------------------------------------------------


def _add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        metavar="FILE",
        help="a state file from savable_loader.state.save_file, or raw encoded state "
        "bytes (savable_loader.state.encode, a loader.state_dict() value)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document instead of the text summary (keys: see docs/debugging.md)",
    )


def _run_inspect(args: argparse.Namespace) -> int:
    import json

    from savable_loader.cli import inspect as _inspect
    from savable_loader.errors import StateError

    try:
        doc = _inspect.summarize(_inspect.read_state(args.file), args.file)
    except StateError as e:
        return _usage_error("inspect", " ".join(str(e).split()))
    print(json.dumps(doc, indent=2) if args.json else _inspect.render_text(doc))
    return 0


# -- index ------------------------------------------------------------------------------


def _add_index_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="DIR_OR_URL", help="the folder of shards: a path or an fsspec URL (s3://...)")
    parser.add_argument(
        "--storage-options",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="fsspec options for a URL, as a JSON object (e.g. '{\"anon\": true}')",
    )
    parser.add_argument("--workers", type=_positive, default=8, metavar="N", help="shards indexed at once (default: 8)")
    parser.add_argument(
        "--sha256", action="store_true", help="record each shard's SHA-256 in metadata.json (reads every byte)"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild every tar index and ignore the journal of an interrupted run"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON document")


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _run_index(args: argparse.Namespace) -> int:
    import json
    from collections import Counter

    from savable_loader.errors import SavableLoaderError
    from savable_loader.sources.indexing import index_folder

    try:
        meta = index_folder(
            args.folder,
            storage_options=args.storage_options,
            workers=args.workers,
            sha256=args.sha256,
            force=args.force,
            progress=not args.quiet,
        )
    except SavableLoaderError as e:
        return _usage_error("index", " ".join(str(e).split()))
    formats = Counter(s.format for s in meta.shards)
    doc = {
        "folder": args.folder,
        "shards": len(meta.shards),
        "samples": sum(s.samples for s in meta.shards),
        "bytes": sum(s.size or 0 for s in meta.shards),
        "formats": dict(formats),
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        kinds = ", ".join(f"{n} {fmt}" for fmt, n in formats.items())
        print(
            f"{args.folder}: {doc['shards']} shards ({kinds}), {doc['samples']} samples, "
            f"{doc['bytes']:,} bytes: wrote metadata.json"
        )
    return 0


# -- report -----------------------------------------------------------------------------


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="RUN.jsonl", help="stats logs (SavableDataLoader(stats_log=...))")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also draw the input wait and each stage's share over the run into PNG (needs matplotlib: "
        "pip install 'savable-loader[plot]')",
    )


def _run_report(args: argparse.Namespace) -> int:
    from savable_loader.errors import SavableLoaderError
    from savable_loader.stats.log import read_log
    from savable_loader.stats.report import plot, render, summarize

    try:
        windows = [w for path in args.logs for w in read_log(path)]
        summaries = summarize(windows)
        print(render(summaries, ", ".join(args.logs)))
        if args.plot is not None:
            plot(summaries, args.plot)
            print(f"wrote {args.plot}")
    except (SavableLoaderError, OSError) as e:
        return _usage_error("report", " ".join(str(e).split()))
    return 0


def _usage_error(command: str, message: str) -> int:
    print(f"savable-loader {command}: error: {message}", file=sys.stderr)
    return 2


# -- registry ---------------------------------------------------------------------------

_COMMANDS: tuple[_Command, ...] = (
    _Command(
        name="demo",
        help="kill a training run mid-epoch, resume it and check the batches are identical",
        description=(
            "Train a tiny model on a synthetic dataset with random augmentations drawn in the "
            "loader's worker processes, checkpointing model and loader state every few steps; "
            "kill the training run with SIGKILL mid-epoch, restart it from the checkpoint and "
            "check that every batch and every loss after the restart is bit-identical to an "
            "uninterrupted run, on every rank. Also shows what a plain torch DataLoader does in "
            "the same situation. CPU only, nothing to download. Exit code 0 if identical, 1 "
            "otherwise."
        ),
        add_arguments=_add_demo_arguments,
        run=_run_demo,
    ),
    _Command(
        name="inspect",
        help="summarise a state file (no torch needed)",
        description=(
            "Print what a loader state file holds: one rank's state or the gathered states "
            "of all ranks, schema version, world size, workers, epoch and position, the "
            "configuration it was saved under, file and encoded sizes, and for savable "
            "pipelines an outline of each worker's dataset state. Reads files written by "
            "savable_loader.state.save_file and raw encoded state bytes. Exit code 2 if "
            "FILE is not a readable state."
        ),
        add_arguments=_add_inspect_arguments,
        run=_run_inspect,
    ),
    _Command(
        name="index",
        help="index a folder of shards where it is (metadata.json, tar indexes)",
        description=(
            "Index a folder of shards for ShardedFileDataset without converting anything: "
            "WebDataset tars (a byte-offset index per tar, Energon's .tar.idx layout), Parquet "
            "files (row groups), .npy/.pt/.jsonl shards, or a folder prepared by Megatron-Energon, "
            "MosaicML Streaming or LitData. Writes metadata.json (format 2: per shard its format, "
            "samples and size) and the missing tar indexes, in parallel, with a progress line. "
            "A killed run resumes where it stopped. Shard files are never written. Exit code 2 "
            "if the data is malformed."
        ),
        add_arguments=_add_index_arguments,
        run=_run_index,
    ),
    _Command(
        name="report",
        help="where the step time went: a stats log in words (and a plot)",
        description=(
            "Read the stats logs a SavableDataLoader wrote (stats_log=...) and print, per rank: "
            "the share of the run the training loop waited for data, throughput, how busy each "
            "worker was, how many batches were ready when the loop asked, each pipeline stage's "
            "time with the slowest named, the same over the run, and what to try. With --plot, "
            "a PNG of the input wait and the stages' shares over the run (matplotlib). Exit "
            "code 2 if a log is unreadable (the message names the file and line)."
        ),
        add_arguments=_add_report_arguments,
        run=_run_report,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m savable_loader``."""
    from savable_loader._version import __version__

    parser = argparse.ArgumentParser(
        prog="savable-loader" if not sys.argv[0].endswith("__main__.py") else "python -m savable_loader",
        description="savable_loader: a checkpointable drop-in for torch.utils.data.DataLoader.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.description)
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    args._started = started
    try:
        code = int(args._run(args))
        sys.stdout.flush()  # here, so that a closed pipe is met inside the try
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... inspect --json STATE | head`: the reader had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would fail again
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a program a pipe stopped


if __name__ == "__main__":
    sys.exit(main())
