"""The results store of `shardscope search`: SQLite (stdlib, WAL), one row per (config hash,
tool version, backend), committed one result at a time.

A row keeps the config that ran, its status (ok / refused / error) and one-line message, the
headline figures (for ranking without reading the reports), the JSON report, the timings,
and the compiled HLO (zlib) with what the estimate was made from and the program as read
(sharding/plan.py), so that `--reestimate` re-times it without compiling or reading the HLO
again (a store written before plans were kept gains the column when opened), and the
calibration its figures were made under (`calibration`: `Calibration.to_dict()` as JSON, the
catalog's too; a store from before it was kept gains the column, its rows NULL, and rows from
before the catalog's was written out read "": a rerun re-estimates both).
Re-estimates on another system of the same size are kept per system beside it (table
`estimates`). Reading (`results`, `diff`) opens the file read-only and changes nothing.
Several searches may write one store at once: SQLite's lock serialises the writes and the
primary key keeps each result once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import time
import zlib
from collections.abc import Collection
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    config_hash TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    backend TEXT NOT NULL,
    search TEXT NOT NULL,
    name TEXT NOT NULL,
    config TEXT NOT NULL,
    parallelism TEXT NOT NULL,
    varied TEXT NOT NULL,
    status TEXT NOT NULL,
    message TEXT NOT NULL,
    step_time_s REAL,
    tokens_per_s_per_device REAL,
    mfu REAL,
    memory_per_device_bytes REAL,
    fits INTEGER,
    bottleneck TEXT,
    report TEXT,
    inputs TEXT,
    hlo BLOB,
    timings TEXT,
    created REAL NOT NULL,
    plan BLOB,
    calibration TEXT,
    PRIMARY KEY (config_hash, tool_version, backend)
)
"""

# Re-estimates of a stored program on another system of the same device count (`search
# --reestimate --system S`), one row per program and system.
ESTIMATES = """
CREATE TABLE IF NOT EXISTS estimates (
    config_hash TEXT NOT NULL,
    tool_version TEXT NOT NULL,
    backend TEXT NOT NULL,
    system TEXT NOT NULL,
    step_time_s REAL,
    tokens_per_s_per_device REAL,
    mfu REAL,
    memory_per_device_bytes REAL,
    fits INTEGER,
    bottleneck TEXT,
    report TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (config_hash, tool_version, backend, system)
)
"""

COLUMNS = ("config_hash", "tool_version", "backend", "search", "name", "config", "parallelism",
           "varied", "status", "message", "step_time_s", "tokens_per_s_per_device", "mfu",
           "memory_per_device_bytes", "fits", "bottleneck", "report", "inputs", "hlo", "timings",
           "created", "plan", "calibration")

FIGURES = ("step_time_s", "tokens_per_s_per_device", "mfu", "memory_per_device_bytes", "fits",
           "bottleneck")


def calibration_key(calibration) -> str:
    """How a row records the calibration its figures were made under: the calibration's
    tables as JSON, the catalog's (meshes/calibration.toml) for None -- so that rows made
    before a refit of the catalog are re-estimated too (stores written before this kept
    "" for the catalog's, which now reads as another calibration)."""
    if calibration is None:
        from meshes.calibration import catalog_calibration

        calibration = catalog_calibration()
    return json.dumps(calibration.to_dict(), sort_keys=True, default=str)


def tool_version() -> str:
    """The installed shardscope's version (a store keeps results per version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardscope")
    except PackageNotFoundError:
        return "unknown"


def config_hash(config: dict) -> str:
    """A config's identity: its tables with every default filled in, the name left out
    (the same sharding under another name is the same program)."""
    body = {k: v for k, v in config.items() if k != "name"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """One searched config and how it went."""

    config_hash: str
    tool_version: str
    backend: str
    search: str
    name: str
    config: dict
    parallelism: dict
    varied: dict
    status: str  # "ok" | "refused" | "error"
    message: str = ""
    step_time_s: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None
    memory_per_device_bytes: float | None = None
    fits: bool | None = None
    bottleneck: str = ""
    report: dict | None = None
    inputs: dict | None = None
    hlo_text: str = ""
    plan: bytes = b""  # sharding.plan.Plan.to_bytes()
    timings: dict = dataclasses.field(default_factory=dict)
    created: float = 0.0
    retimed_on: str = ""  # the system of a re-estimate; "" when as compiled
    calibration: str = ""  # calibration_key() of the figures' calibration

    @property
    def system(self) -> str:
        """The system the figures are for."""
        return self.retimed_on or self.config.get("system", {}).get("name", "?")

    def summary(self) -> dict:
        """The fields of `search --json`'s results."""
        return {"name": self.name, "parallelism": self.parallelism, **self.varied,
                "varied": self.varied, "status": self.status, "message": self.message,
                **{k: getattr(self, k) for k in FIGURES}}


class Store:
    """A results store on disk; `with Store(path) as s: ...`."""

    def __init__(self, path: str | Path, *, read_only: bool = False):
        """`read_only`: only read a store that exists (`results`, `diff`): nothing is
        created or changed, and an SQLite file that is not a results store is refused."""
        self.path = Path(path)
        if not self.path.parent.exists():
            raise ValueError(f"results store {str(path)!r}: folder {str(self.path.parent)!r} "
                             f"does not exist; create it or store elsewhere")
        if self.path.is_dir():
            raise ValueError(f"results store {str(path)!r} is a folder; give a file, e.g. "
                             f"{str(self.path / 'search.sqlite')!r}")
        if read_only:
            self._open_read_only()
        else:
            self._open_read_write()
        self.columns = {row[1] for row in self.db.execute("PRAGMA table_info(results)")}
        self.tables = {r[0] for r in self.db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}

    def _open_read_write(self) -> None:
        existed = self.path.exists() and self.path.stat().st_size > 0
        try:
            self.db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            tables = {r[0] for r in self.db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and "results" not in tables:  # someone else's database: left alone
                self.db.close()
                raise ValueError(f"{self.path}: an SQLite file but not a results store (no "
                                 f"results table); give a new file or one `shardscope "
                                 f"search --store` wrote")
            self._setup("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self._setup(SCHEMA)
            self._setup(ESTIMATES)
            columns = {row[1] for row in self.db.execute("PRAGMA table_info(results)")}
            for column, kind in (("plan", "BLOB"), ("calibration", "TEXT")):
                if column not in columns:  # a store from before the column was kept
                    try:
                        self.db.execute(f"ALTER TABLE results ADD COLUMN {column} {kind}")
                    except sqlite3.OperationalError as e:  # another search added it first
                        if "duplicate column" not in str(e):
                            raise
        except sqlite3.DatabaseError as e:
            if getattr(self, "db", None) is not None:
                self.db.close()
            if getattr(e, "sqlite_errorname", "") == "SQLITE_NOTADB":
                # a file of something else: left as it is
                raise ValueError(f"{self.path}: not a results store ({e}); give a new file "
                                 f"or one `shardscope search --store` wrote") from None
            read = f"; `shardscope results {self.path}` reads it" if existed else ""
            raise ValueError(f"results store {str(self.path)!r}: cannot write it ({e}); "
                             f"store in a folder you can write (--store DIR/NAME.sqlite)"
                             f"{read}") from None

    def _open_read_only(self) -> None:
        """Read-only, and without the write-ahead log's index file where the folder cannot
        be written (a store someone else made): SQLite then reads the file as it is, which
        is all of it unless a writer left a log behind."""
        uri = self.path.resolve().as_uri()
        wal = Path(f"{self.path}-wal")
        tries = [f"{uri}?mode=ro"]
        if not (wal.exists() and wal.stat().st_size):
            tries.append(f"{uri}?mode=ro&immutable=1")
        for k, address in enumerate(tries):
            self.db = sqlite3.connect(address, uri=True, timeout=60.0)
            try:
                tables = {r[0] for r in self.db.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'")}
                break
            except sqlite3.DatabaseError as e:
                self.db.close()
                if getattr(e, "sqlite_errorname", "") == "SQLITE_NOTADB":
                    raise ValueError(f"{self.path}: not a results store ({e}); give a file "
                                     f"`shardscope search --store` wrote") from None
                if k == len(tries) - 1:
                    raise ValueError(f"results store {str(self.path)!r}: cannot read it "
                                     f"({e}); copy it (with its -wal file) to a folder you "
                                     f"can write and read the copy") from None
        if "results" not in tables:
            self.db.close()
            raise ValueError(f"{self.path}: an SQLite file but not a results store (no "
                             f"results table); `shardscope search CONFIG --store "
                             f"{self.path.name}` writes one")

    def _setup(self, statement: str, tries: int = 200) -> None:
        """A statement that sets the store up: switching a new file to WAL needs it to
        itself for a moment and SQLite may answer 'locked' at once rather than wait, when
        another search is opening the same new store; wait a little and try again."""
        for k in range(tries):
            try:
                self.db.execute(statement)
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or k == tries - 1:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    def stored(self, tool_version: str, backend: str) -> dict[str, tuple[str, str]]:
        """{config hash: (status, message)} of the rows stored for this tool version and
        backend (what a rerun decides on: reuse, compile again, re-estimate)."""
        rows = self.db.execute("SELECT config_hash, status, message FROM results WHERE "
                               "tool_version = ? AND backend = ?", (tool_version, backend))
        return {h: (status, message) for h, status, message in rows}

    def searches(self) -> list[str]:
        """The names of the searches that wrote rows (the first writer's name of each)."""
        return [r[0] for r in self.db.execute(
            "SELECT search FROM results GROUP BY search ORDER BY MIN(created)")]

    def add(self, r: Result, *, replace: bool = False) -> bool:
        """Commit one result; False when the store already had it (another search).
        `replace`: in place of the stored one (a rerun that compiled it again), under the
        search and name that stored it first (rankings select rows by them)."""
        how = "REPLACE" if replace else "IGNORE"
        if replace:
            first = self.db.execute(
                "SELECT search, name FROM results WHERE config_hash = ? AND tool_version = ? "
                "AND backend = ?", (r.config_hash, r.tool_version, r.backend)).fetchone()
            if first is not None:
                r = dataclasses.replace(r, search=first[0], name=first[1])
        cur = self.db.execute(
            f"INSERT OR {how} INTO results ({', '.join(COLUMNS)}) VALUES "
            f"({', '.join('?' * len(COLUMNS))})",
            (r.config_hash, r.tool_version, r.backend, r.search, r.name,
             json.dumps(r.config, default=str), json.dumps(r.parallelism),
             json.dumps(r.varied), r.status, r.message, r.step_time_s,
             r.tokens_per_s_per_device, r.mfu, r.memory_per_device_bytes,
             None if r.fits is None else int(r.fits), r.bottleneck,
             None if r.report is None else json.dumps(r.report, default=str),
             None if r.inputs is None else json.dumps(r.inputs, default=str),
             zlib.compress(r.hlo_text.encode()) if r.hlo_text else None,
             json.dumps(r.timings), r.created or time.time(), r.plan or None,
             r.calibration or None))
        return cur.rowcount == 1

    def update_estimate(self, r: Result) -> None:
        """Replace a stored result's figures and report (a re-estimate; the HLO stays)."""
        self.db.execute(
            "UPDATE results SET step_time_s=?, tokens_per_s_per_device=?, mfu=?, "
            "memory_per_device_bytes=?, fits=?, bottleneck=?, report=?, inputs=?, "
            "plan=COALESCE(?, plan), calibration=? WHERE config_hash=? AND tool_version=? "
            "AND backend=?",
            (r.step_time_s, r.tokens_per_s_per_device, r.mfu, r.memory_per_device_bytes,
             None if r.fits is None else int(r.fits), r.bottleneck,
             json.dumps(r.report, default=str), json.dumps(r.inputs, default=str),
             r.plan or None, r.calibration or None, r.config_hash, r.tool_version, r.backend))

    def add_estimate(self, r: Result, system: str) -> None:
        """Keep a re-estimate of a stored program on `system` (replacing an older one)."""
        self.db.execute(
            "INSERT OR REPLACE INTO estimates VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (r.config_hash, r.tool_version, r.backend, system, r.step_time_s,
             r.tokens_per_s_per_device, r.mfu, r.memory_per_device_bytes,
             None if r.fits is None else int(r.fits), r.bottleneck,
             json.dumps(r.report, default=str), time.time()))

    def hlo(self, r: Result) -> str:
        """A stored result's compiled HLO ("" when none was kept)."""
        row = self.db.execute("SELECT hlo FROM results WHERE config_hash=? AND "
                              "tool_version=? AND backend=?",
                              (r.config_hash, r.tool_version, r.backend)).fetchone()
        return zlib.decompress(row[0]).decode() if row and row[0] else ""

    def results(self, *, search: str | None = None, with_hlo: bool = False,
                with_plan: bool = False, system: str | None = None,
                tool_version: str | None = None, backend: str | None = None,
                keys: Collection[str] | None = None) -> list[Result]:
        """Every stored result (of one search when given: the rows that search wrote
        first), oldest first; the compiled HLO and the program as read only when asked
        for. `system`: the re-estimates kept for it instead of the figures as compiled
        (only the programs re-timed on it). `tool_version`, `backend`, `keys` (config
        hashes): only those rows (a search's own candidates, whoever stored them)."""
        if system and "estimates" not in self.tables:  # a store from before re-estimates
            return []
        cols = ("r.config_hash, r.tool_version, r.backend, r.search, r.name, r.config, "
                "r.parallelism, r.varied, r.status, r.message, "
                + ("e" if system else "r") + ".step_time_s, "
                + ", ".join(f"{'e' if system else 'r'}.{c}" for c in (
                    "tokens_per_s_per_device", "mfu", "memory_per_device_bytes", "fits",
                    "bottleneck", "report"))
                + ", r.inputs, r.timings, r.created, "
                + ("r.hlo" if with_hlo else "NULL") + ", "
                + ("r.plan" if with_plan and "plan" in self.columns else "NULL") + ", "
                + ("r.calibration" if "calibration" in self.columns else "NULL"))
        query = f"SELECT {cols} FROM results r"
        args: list = []
        if system:
            query += (" JOIN estimates e ON e.config_hash = r.config_hash AND "
                      "e.tool_version = r.tool_version AND e.backend = r.backend AND "
                      "e.system = ?")
            args.append(system)
        where = [(f"r.{c} = ?", v) for c, v in (("search", search),
                                                ("tool_version", tool_version),
                                                ("backend", backend)) if v]
        if where:
            query += " WHERE " + " AND ".join(w for w, _ in where)
            args += [v for _, v in where]
        wanted = None if keys is None else set(keys)
        out = []
        for row in self.db.execute(query + " ORDER BY r.created", args):
            (h, version, backend_, name_s, name, config, par, varied, status, message, step,
             tps, mfu, mem, fits, bottleneck, report, inputs, timings, created) = row[:20]
            if wanted is not None and h not in wanted:
                continue
            out.append(Result(
                config_hash=h, tool_version=version, backend=backend_, search=name_s,
                name=name, config=json.loads(config), parallelism=json.loads(par),
                varied=json.loads(varied), status=status, message=message, step_time_s=step,
                tokens_per_s_per_device=tps, mfu=mfu, memory_per_device_bytes=mem,
                fits=None if fits is None else bool(fits), bottleneck=bottleneck or "",
                report=json.loads(report) if report else None,
                inputs=json.loads(inputs) if inputs else None,
                hlo_text=zlib.decompress(row[20]).decode() if with_hlo and row[20] else "",
                plan=row[21] or b"", calibration=row[22] or "",
                timings=json.loads(timings), created=created, retimed_on=system or ""))
        return out
