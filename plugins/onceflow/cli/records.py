"""`onceflow produce` and `onceflow import`: records into a source onceflow keeps."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

from onceflow.cli.args import Progress, chosen_pipeline
from onceflow.core import db
from onceflow.core.errors import ConfigError
from onceflow.sources.pglog import check_payload
from onceflow.sources.segments import FileSegments

STDIN_CHUNK = 100_000  # records written at once from standard input at most


def _lines(path: str):
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    try:
        for line in stream:
            yield line.rstrip("\n")
    finally:
        if stream is not sys.stdin:
            stream.close()


def _live_chunks(stream, size: int, flush_s: float):
    """Lists of at most ``size`` lines of ``stream`` (binary, UTF-8), each given at most
    ``flush_s`` after its first line arrived: a live producer's records are written as they
    come, not when a chunk fills. A thread reads what the pipe has (never waiting for more
    than one read), so a quiet producer never holds back the lines it already wrote."""
    lines: queue.Queue = queue.Queue(maxsize=64)
    end = object()

    def read() -> None:
        tail = b""
        try:
            while True:
                data = stream.read1(1 << 16)
                if not data:
                    break
                *whole, tail = (tail + data).split(b"\n")
                if whole:
                    lines.put([line.decode("utf-8") for line in whole])
            if tail:
                lines.put([tail.decode("utf-8")])
            lines.put(end)
        except BaseException as error:  # (bad UTF-8): raised where the chunks are read
            lines.put(error)

    threading.Thread(target=read, name="produce-stdin", daemon=True).start()
    chunk: list[str] = []
    deadline = 0.0
    while True:
        try:
            got = lines.get(timeout=max(0.0, deadline - time.monotonic()) if chunk else None)
        except queue.Empty:
            yield chunk
            chunk = []
            continue
        if got is end:
            if chunk:
                yield chunk
            return
        if isinstance(got, BaseException):
            if isinstance(got, UnicodeDecodeError):
                raise ConfigError(f"standard input is not UTF-8 text ({got.reason}): give "
                                  "one payload per line in UTF-8") from got
            raise got
        if not chunk:
            deadline = time.monotonic() + flush_s
        for line in got:
            chunk.append(line.rstrip("\r") if line.endswith("\r") else line)
            if len(chunk) >= size:
                yield chunk
                chunk = []
                deadline = time.monotonic() + flush_s


def cmd_produce(args) -> int:
    pipeline = chosen_pipeline(args)
    if args.file != "-" and not os.path.isfile(args.file):

        raise ConfigError(f"--file={args.file!r} does not exist: give a file with one payload "
                          "per line, or - for standard input")
    progress = Progress(f"produce {pipeline.topic}")
    sizes = {"chunk_size": args.chunk} if args.chunk else {}
    with db.connection() as conn:
        started = time.monotonic()
        if args.file != "-":
            n = pipeline.source.append(conn, _lines(args.file), **sizes,
                                       progress=lambda total: progress(f"{total} records"))
        else:
            n = 0
            for chunk in _live_chunks(sys.stdin.buffer, args.chunk or STDIN_CHUNK,
                                      args.flush_s):
                for i, payload in enumerate(chunk, n + 1):  # numbered over the whole input
                    check_payload(i, payload)
                n += pipeline.source.append(conn, chunk, **sizes)
                progress(f"{n} records")
    progress.done()
    print(f"produced {n} records to {pipeline.source.describe()} in "
          f"{time.monotonic() - started:.1f}s")
    return 0


def cmd_import(args) -> int:
    pipeline = chosen_pipeline(args)
    if not isinstance(pipeline.source, FileSegments):
        raise ConfigError(f"pipeline {pipeline.name!r} reads {pipeline.source.describe()}: "
                          "import keeps partitions and offsets into file segments only "
                          "(a pipeline with source=FileSegments(...))")
    started = time.monotonic()
    # pyarrow and numpy: loaded for an import, not for every command
    from onceflow.sources.segments.bulk_import import import_segments, read_export

    table = read_export(args.files)
    with db.connection() as conn:
        done = import_segments(conn, pipeline.source.root(), pipeline.topic, table,
                               on_conflict=args.on_conflict)
    kept = ""
    if done.kept or done.before_start:
        kept = (f"; kept the log's records (--on-conflict keep-existing): {done.kept} at "
                f"offsets it holds with another payload, {done.before_start} below a "
                "partition's log start, not imported")
    print(f"imported {done.records} records into {pipeline.source.describe()} as "
          f"{done.segments} segment file(s) in {time.monotonic() - started:.1f}s; "
          f"{done.skipped} were there already (the same payload){kept}; heads now "
          f"{done.heads}")
    return 0
