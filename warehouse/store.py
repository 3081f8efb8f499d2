"""The table store: Parquet snapshots under ``tables/`` and a DuckDB catalog.

Every write makes a new immutable snapshot. Parquet files are written to a temporary
directory, renamed into ``tables/<name>/<snapshot>/`` and only then is the catalog row
committed, under an inter-process file lock, in one DuckDB transaction. A writer that
dies before the commit leaves at most an unreferenced directory that no reader sees
(``gc`` removes it). An ``append`` snapshot references its parent's files plus its own,
so appending never copies old data.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import duckdb
import polars as pl
from filelock import FileLock

from data_specs import SpecError, get_spec, validate_name
from warehouse.paths import posttrain_home

CATALOG_DDL = """
CREATE TABLE IF NOT EXISTS snapshots (
    seq BIGINT PRIMARY KEY,
    name VARCHAR NOT NULL,
    snapshot VARCHAR NOT NULL UNIQUE,
    schema_version INTEGER,
    rows BIGINT NOT NULL,
    content_hash VARCHAR NOT NULL,
    parents VARCHAR NOT NULL,      -- JSON list of "name@snapshot"
    flow_run_id VARCHAR,
    created TIMESTAMP NOT NULL,
    mode VARCHAR NOT NULL,
    files VARCHAR NOT NULL,        -- JSON list of paths relative to home
    note VARCHAR,
    writer VARCHAR                 -- the pipeline stage that wrote it (``recording_writer``)
)
"""
# catalogs made before the ``writer`` column
CATALOG_MIGRATIONS = ("ALTER TABLE snapshots ADD COLUMN IF NOT EXISTS writer VARCHAR",)
# Every directory this home has been opened at (a home copied or moved elsewhere keeps the
# old ones): paths stored before the copy are read as paths in this home (``local_path``).
LOCATIONS_DDL = "CREATE TABLE IF NOT EXISTS locations (path VARCHAR PRIMARY KEY, first_seen TIMESTAMP NOT NULL)"
LOCK_TIMEOUT_S = 120


class WarehouseError(RuntimeError):
    pass


@dataclass(frozen=True)
class TableRef:
    name: str
    snapshot: str
    rows: int = 0
    content_hash: str = ""

    def __str__(self) -> str:
        return f"{self.name}@{self.snapshot}"

    @classmethod
    def parse(cls, text: str) -> TableRef:
        name, sep, snap = text.partition("@")
        if not sep or not snap:
            raise ValueError(f"table reference {text!r} is not of the form name@snapshot")
        return cls(validate_name(name), snap)


def _new_snapshot_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def frame_digest(df: pl.DataFrame) -> str:
    """Content hash of a frame: sha256 of its Arrow IPC bytes (order- and type-sensitive)."""
    return hashlib.sha256(df.write_ipc(None).getvalue()).hexdigest()


class Warehouse:
    def __init__(self, home: str | os.PathLike | None = None):
        self.home = posttrain_home(home)
        self.tables_dir = self.home / "tables"
        self.tables_dir.mkdir(exist_ok=True)
        self.catalog_path = self.home / "warehouse.duckdb"
        self._lock = FileLock(str(self.home / "warehouse.lock"), timeout=LOCK_TIMEOUT_S)
        with self._catalog() as con:
            con.execute(CATALOG_DDL)
            columns = {r[1] for r in con.execute("PRAGMA table_info('snapshots')").fetchall()}
            if "writer" not in columns:
                for statement in CATALOG_MIGRATIONS:
                    con.execute(statement)
            con.execute(LOCATIONS_DDL)
            known = [r[0] for r in con.execute("SELECT path FROM locations ORDER BY first_seen").fetchall()]
            if str(self.home) not in known:
                con.execute("INSERT INTO locations VALUES (?, ?)", [str(self.home), datetime.now(UTC).replace(tzinfo=None)])
        # longest first, so a location inside another maps by its own prefix
        self.former_homes: tuple[str, ...] = tuple(sorted((k for k in known if k != str(self.home)),
                                                          key=len, reverse=True))

    def local_path(self, path: str | os.PathLike) -> str:
        """``path`` as a path in this home: one stored under a directory this home was copied or
        moved from is mapped here (a copied home never reads, trains from or writes into the
        original's files); any other path is returned as it is."""
        text = str(path)
        for old in self.former_homes:
            if text == old or text.startswith(old + os.sep):
                return str(self.home) + text[len(old):]
        return text

    def is_foreign(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` lies under a directory this home was copied or moved from."""
        return self.local_path(path) != str(path)

    # -- places beside the tables -------------------------------------------------------
    def _subdir(self, name: str) -> Path:
        p = self.home / name
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def artifacts_dir(self) -> Path:
        return self._subdir("artifacts")

    @property
    def checkpoints_dir(self) -> Path:
        return self._subdir("checkpoints")

    @property
    def models_dir(self) -> Path:
        return self._subdir("models")

    # -- catalog access -----------------------------------------------------------------
    @contextmanager
    def _catalog(self) -> Iterator[duckdb.DuckDBPyConnection]:
        # DuckDB allows one writing process per file: serialize catalog access across
        # processes with a file lock and keep each connection short-lived.
        with self._lock:
            con = duckdb.connect(str(self.catalog_path))
            try:
                yield con
            finally:
                con.close()

    def _rows(self, query: str, params: Sequence = ()) -> list[dict]:
        with self._catalog() as con:
            cur = con.execute(query, list(params))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def _snapshot_row(self, name: str, snapshot: str | None) -> dict:
        validate_name(name)
        _note_read(name)
        if snapshot is None:
            rows = self._rows("SELECT * FROM snapshots WHERE name = ? ORDER BY seq DESC LIMIT 1", [name])
            if not rows:
                raise KeyError(f"table {name!r} does not exist in {self.home}")
        else:
            rows = self._rows("SELECT * FROM snapshots WHERE name = ? AND snapshot = ?", [name, snapshot])
            if not rows:
                raise KeyError(f"table {name!r} has no snapshot {snapshot!r}")
        _note_read(name, rows[0]["snapshot"])
        return rows[0]

    @staticmethod
    def _ref(row: dict) -> TableRef:
        return TableRef(row["name"], row["snapshot"], int(row["rows"]), row["content_hash"])

    # -- writing ------------------------------------------------------------------------
    def write(self, name: str, df: pl.DataFrame, parents: Sequence[TableRef | str] = (),
              flow_run_id: str | None = None, note: str | None = None) -> TableRef:
        """``df`` as the new snapshot of ``name`` (replacing what the table held); its reference."""
        return self._commit(name, df, "replace", parents, flow_run_id, note)

    def append(self, name: str, df: pl.DataFrame, parents: Sequence[TableRef | str] = (),
               flow_run_id: str | None = None, note: str | None = None) -> TableRef:
        """A new snapshot of ``name``: its latest rows plus ``df`` (the old files are referenced, not copied)."""
        return self._commit(name, df, "append", parents, flow_run_id, note)

    def _commit(self, name: str, df: pl.DataFrame, mode: Literal["replace", "append"],
                parents: Sequence[TableRef | str], flow_run_id: str | None, note: str | None) -> TableRef:
        validate_name(name)
        spec = get_spec(name)
        if spec is not None:
            valid, rejected = spec.validate(df)
            if rejected.height:
                first = rejected.row(0, named=True)
                raise SpecError(
                    f"table {name!r}: {rejected.height} row(s) violate spec v{spec.version}; "
                    f"first: field {first['field']!r}: {first['reason']}"
                )
            df = valid
        flow_run_id = flow_run_id or _current_flow_run_id()
        snapshot = _new_snapshot_id()
        table_dir = self.tables_dir / name
        table_dir.mkdir(exist_ok=True)
        tmp = table_dir / f".tmp-{snapshot}"
        tmp.mkdir()
        try:
            part = tmp / "part-0.parquet"
            df.write_parquet(part, compression="zstd", statistics=True)
            with open(part, "rb") as fh:
                os.fsync(fh.fileno())
            final = table_dir / snapshot
            os.rename(tmp, final)  # atomic on one filesystem
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        own_file = str((final / "part-0.parquet").relative_to(self.home))
        part_hash = frame_digest(df)
        parent_names = [str(p) for p in parents]
        with self._catalog() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                latest = con.execute(
                    "SELECT rows, content_hash, files, snapshot FROM snapshots WHERE name = ? "
                    "ORDER BY seq DESC LIMIT 1", [name]).fetchone()
                files, rows, content_hash = [own_file], df.height, part_hash
                if mode == "append" and latest is not None:
                    prev_files = json.loads(latest[2])
                    if prev_files:
                        prev_schema = pl.read_parquet_schema(self.home / prev_files[-1])
                        if dict(prev_schema) != dict(df.schema) and not _adds_optional_columns(spec, prev_schema,
                                                                                                df.schema):
                            raise SpecError(
                                f"cannot append to {name!r}: schema {dict(df.schema)} differs from "
                                f"the table's {dict(prev_schema)}")
                    files = prev_files + [own_file]
                    rows = int(latest[0]) + df.height
                    content_hash = hashlib.sha256((latest[1] + part_hash).encode()).hexdigest()
                    parent_names = [f"{name}@{latest[3]}"] + parent_names
                seq = con.execute("SELECT coalesce(max(seq), 0) + 1 FROM snapshots").fetchone()[0]
                con.execute(
                    "INSERT INTO snapshots (seq, name, snapshot, schema_version, rows, content_hash, parents, "
                    "flow_run_id, created, mode, files, note, writer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [seq, name, snapshot, spec.version if spec else None, rows, content_hash,
                     json.dumps(parent_names), flow_run_id, datetime.now(UTC).replace(tzinfo=None),
                     mode, json.dumps(files), note, current_writer()],
                )
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                shutil.rmtree(final, ignore_errors=True)
                raise
        ref = TableRef(name, snapshot, rows, content_hash)
        _note_write(ref)
        return ref

    # -- reading ------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        validate_name(name)
        _note_read(name)   # asking is reading: the answer shapes what the caller does
        return bool(self._rows("SELECT 1 FROM snapshots WHERE name = ? LIMIT 1", [name]))

    def ref(self, name: str, snapshot: str) -> TableRef:
        """The reference of one snapshot (rows and content hash from the catalog)."""
        return self._ref(self._snapshot_row(name, snapshot))

    def pinned(self, name: str, sources: Mapping[str, TableRef] | None) -> TableRef | None:
        """The snapshot of ``name`` a caller was handed in ``sources`` (a pipeline stage gets those
        its upstream stages wrote), else the table's newest (None: it does not exist)."""
        return (sources or {}).get(name) or self.latest(name)

    def latest(self, name: str) -> TableRef | None:
        try:
            return self._ref(self._snapshot_row(name, None))
        except KeyError:
            return None

    def files(self, name: str, snapshot: str | None = None) -> list[Path]:
        row = self._snapshot_row(name, snapshot)
        return [self.home / f for f in json.loads(row["files"])]

    def scan(self, name: str, snapshot: str | None = None) -> pl.LazyFrame:
        """A snapshot's rows, lazily. Its newest file has every column (an append may add the
        optional columns its spec gained since), so older files read those as null."""
        files = [str(p) for p in self.files(name, snapshot)]
        if len(files) < 2:
            return pl.scan_parquet(files)
        return pl.scan_parquet(files, schema=pl.read_parquet_schema(files[-1]), missing_columns="insert")

    def read(self, name: str, snapshot: str | None = None, default_empty: bool = False) -> pl.DataFrame:
        """A snapshot (latest by default) as a polars frame.

        With ``default_empty`` a missing table reads as an empty frame of its spec.
        """
        if default_empty and not self.exists(name):
            spec = get_spec(name)
            if spec is None:
                raise KeyError(f"table {name!r} does not exist and has no spec")
            return spec.empty()
        return self.scan(name, snapshot).collect()

    def read_ref(self, ref: TableRef | str) -> pl.DataFrame:
        ref = TableRef.parse(ref) if isinstance(ref, str) else ref
        return self.read(ref.name, ref.snapshot)

    def tables(self) -> pl.DataFrame:
        rows = self._rows(
            "SELECT name, snapshot, rows, schema_version, content_hash, created, "
            "(SELECT count(*) FROM snapshots s2 WHERE s2.name = s.name) AS snapshots "
            "FROM snapshots s WHERE seq = (SELECT max(seq) FROM snapshots s3 WHERE s3.name = s.name) "
            "ORDER BY name")
        return _frame(rows, ["name", "snapshot", "rows", "schema_version", "content_hash", "created", "snapshots"])

    def history(self, name: str) -> pl.DataFrame:
        validate_name(name)
        rows = self._rows(
            "SELECT snapshot, mode, rows, schema_version, content_hash, parents, flow_run_id, created, note "
            "FROM snapshots WHERE name = ? ORDER BY seq DESC", [name])
        if not rows:
            raise KeyError(f"table {name!r} does not exist in {self.home}")
        return _frame(rows, list(rows[0].keys()))

    def writers(self) -> dict[str, str]:
        """``name@snapshot`` -> the pipeline stage that wrote it, for every snapshot written
        inside a stage (``recording_writer``)."""
        rows = self._rows("SELECT name, snapshot, writer FROM snapshots WHERE writer IS NOT NULL")
        return {f"{r['name']}@{r['snapshot']}": r["writer"] for r in rows}

    def parents(self, name: str, snapshot: str) -> list[TableRef]:
        """The snapshots ``name@snapshot`` was written from (its direct lineage)."""
        return [TableRef.parse(p) for p in json.loads(self._snapshot_row(name, snapshot)["parents"] or "[]")]

    def lineage(self, name: str, snapshot: str | None = None) -> list[dict]:
        """Edges (child, parent) from a snapshot back through every ancestor."""
        start = self._snapshot_row(name, snapshot)
        edges, seen = [], set()
        todo = [f"{start['name']}@{start['snapshot']}"]
        while todo:
            ref = todo.pop()
            if ref in seen:
                continue
            seen.add(ref)
            n, _, s = ref.partition("@")
            try:
                row = self._snapshot_row(n, s)
            except KeyError:
                continue
            for parent in json.loads(row["parents"]):
                edges.append({"child": ref, "parent": parent})
                todo.append(parent)
        return edges

    def sql(self, query: str, params: Sequence | None = None) -> pl.DataFrame:
        """Run SQL over the latest snapshot of every table (each a view named like the table).

        The query runs in a private in-memory DuckDB, so it can neither change the catalog
        nor hold its lock; ``catalog`` is a view of all snapshots.
        """
        with self._catalog() as cat:
            latest = cat.execute(
                "SELECT name, files FROM snapshots s WHERE seq = "
                "(SELECT max(seq) FROM snapshots s2 WHERE s2.name = s.name)").fetchall()
            catalog_df = cat.sql("SELECT * EXCLUDE (files) FROM snapshots ORDER BY seq").pl()
        con = duckdb.connect(":memory:")
        try:
            con.register("catalog", catalog_df)
            for tname, files in latest:
                validate_name(tname)
                paths = ", ".join("'" + str(self.home / f).replace("'", "''") + "'" for f in json.loads(files))
                con.execute(f'CREATE VIEW "{tname}" AS SELECT * FROM read_parquet([{paths}], union_by_name = true)')
            rel = con.sql(query, params=list(params) if params else None)
            if rel is None:  # a statement that returns nothing
                return pl.DataFrame()
            return rel.pl()
        finally:
            con.close()

    def gc(self, older_than_s: float = 3600.0) -> list[Path]:
        """Remove snapshot directories no catalog row references (left by crashed writers)."""
        referenced = set()
        for row in self._rows("SELECT files FROM snapshots"):
            referenced.update(str(Path(f).parent) for f in json.loads(row["files"]))
        removed, now = [], time.time()
        for table_dir in self.tables_dir.iterdir():
            for snap_dir in table_dir.iterdir() if table_dir.is_dir() else []:
                rel = str(snap_dir.relative_to(self.home))
                if rel not in referenced and now - snap_dir.stat().st_mtime > older_than_s:
                    shutil.rmtree(snap_dir, ignore_errors=True)
                    removed.append(snap_dir)
        return removed


def _frame(rows: list[dict], columns: list[str]) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame({c: [] for c in columns})
    return pl.DataFrame(rows, infer_schema_length=None)


# The orchestrator's run that is writing (set by the flows layer, ``recording_flow_run``): the
# warehouse records it on every snapshot without knowing which orchestrator that is.
_FLOW_RUN_ID: ContextVar[str | None] = ContextVar("posttrain_flow_run_id", default=None)


@contextmanager
def recording_flow_run(flow_run_id: str | None) -> Iterator[None]:
    """Snapshots written inside this block record ``flow_run_id`` (unless a write names its own)."""
    token = _FLOW_RUN_ID.set(flow_run_id)
    try:
        yield
    finally:
        _FLOW_RUN_ID.reset(token)


def _current_flow_run_id() -> str | None:
    return _FLOW_RUN_ID.get()


# The pipeline stage that is writing (set by the pipeline around each stage, ``recording_writer``;
# in processes a stage starts, such as its training ranks, by the environment variable the
# stage hands them): the catalog records it on every snapshot, so the pipeline knows who wrote a
# snapshot even when the stage was killed before it recorded its run.
WRITER_ENV = "POSTTRAIN_WRITER"
_WRITER: ContextVar[str | None] = ContextVar("posttrain_writer", default=None)


@contextmanager
def recording_writer(stage: str | None) -> Iterator[None]:
    """Snapshots written inside this block (threads started with a copy of this context
    included) record ``stage`` as their writer."""
    token = _WRITER.set(stage)
    try:
        yield
    finally:
        _WRITER.reset(token)


def current_writer() -> str | None:
    """The stage writing here: this context's, else the one this process was started for."""
    return _WRITER.get() or os.environ.get(WRITER_ENV) or None


# Which tables a block of code consults and writes (``recording_tables``): every snapshot
# lookup, read, scan or existence check notes the table's name (and a lookup the snapshot it
# resolved) and every write the snapshot it made, so a builder can be held to the sources it
# declares and the pipeline can key a stage's cache on the snapshots it actually read.
@dataclass
class TableUse:
    read: set[str] = field(default_factory=set)
    snapshots: dict[str, str] = field(default_factory=dict)   # table -> the first snapshot read
    written: list[TableRef] = field(default_factory=list)

    def merge(self, other: TableUse) -> None:
        self.read |= other.read
        for name, snapshot in other.snapshots.items():
            self.snapshots.setdefault(name, snapshot)
        self.written += other.written


_USE: ContextVar[TableUse | None] = ContextVar("posttrain_table_use", default=None)


@contextmanager
def recording_tables() -> Iterator[TableUse]:
    """The tables consulted and the snapshots written inside this block (threads started with
    a copy of this context, as Prefect's task runners do, report to the same record)."""
    outer = _USE.get()
    use = TableUse()
    token = _USE.set(use)
    try:
        yield use
    finally:
        _USE.reset(token)
        if outer is not None:
            outer.merge(use)


def _note_read(name: str, snapshot: str | None = None) -> None:
    use = _USE.get()
    if use is not None:
        use.read.add(name)
        if snapshot is not None:
            use.snapshots.setdefault(name, snapshot)


def _note_write(ref: TableRef) -> None:
    use = _USE.get()
    if use is not None:
        use.written.append(ref)


def note_standing_output(ref: TableRef) -> None:
    """Count ``ref`` among the snapshots the enclosing ``recording_tables`` block wrote, though
    the block wrote nothing: it found its rows there already (written by an earlier run of it,
    killed before the pipeline recorded it). The stages after it are handed ``ref``, which holds
    those rows, as they would be handed a snapshot it wrote; without this they were handed the
    snapshot from before, without its rows."""
    _note_write(ref)


def _adds_optional_columns(spec, table: dict, frame: dict) -> bool:
    """Whether ``frame``'s schema is the table's plus columns its spec declares optional (the
    spec gained them since the table's last append): every existing column kept, same types."""
    if spec is None:
        return False
    added = [c for c in frame if c not in table]
    optional = {c.name for c in spec.columns if not c.required}
    return all(frame.get(c) == t for c, t in table.items()) and bool(added) and set(added) <= optional
