"""A compile cache: what the analysis reads of a compile, kept on disk by the program's hash.

Set `SHARDSCOPE_COMPILE_CACHE=DIR` and the same program compiled again (the same config run
twice, a search or `compare` re-run, a validation case, a search worker's repeat) is read
back instead of compiled: its HLO text, the compiler's memory figures and its warnings.
Off when unset. JAX's own persistent cache (`jax_compilation_cache_dir`) keeps executables,
not the HLO after SPMD partitioning that the CPU path reads, so it cannot serve here.

The key is the lowered program (StableHLO with its shardings), the compile options, the
devices it is compiled for (kind, id, torus coordinates: the TPU and GPU compilers schedule
for them), XLA_FLAGS and the versions of jax, jaxlib and the deviceless compilers: anything
that can change the compiler's output. An entry is one gzip file written whole (a rename),
so processes compiling side by side share a folder; an unreadable entry is compiled again.
A refusal (the program does not fit) is not kept.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Iterable, Mapping

ENV = "SHARDSCOPE_COMPILE_CACHE"
_FORMAT = 2  # 2: target compiles keep the HBM share of their temporaries (hbm_temp)


def folder() -> str:
    """The cache folder, or "" when caching is off."""
    return os.environ.get(ENV, "")


def _versions() -> str:
    out = []
    for package in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt"):
        try:
            out.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ",".join(out)


def _device(d) -> str:
    return ":".join(str(getattr(d, a, "")) for a in
                    ("platform", "device_kind", "id", "coords", "core_on_chip", "slice_index"))


def key(program_text: str, options: Mapping, devices: Iterable, final_hlo: bool) -> str:
    """The entry's name: a hash of everything that can change the compiler's output."""
    h = hashlib.sha256()
    for part in (f"format {_FORMAT}", _versions(), os.environ.get("XLA_FLAGS", ""),
                 json.dumps({k: v for k, v in options.items() if k != "xla_dump_to"},
                            sort_keys=True, default=str),
                 f"final {final_hlo}", ";".join(map(_device, devices)), program_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def load(name: str) -> dict | None:
    """The entry `name` ({hlo_text, memory, warnings}), or None: caching is off, there is
    none, or it cannot be read (then it is compiled again and rewritten)."""
    if not folder():
        return None
    try:
        with gzip.open(os.path.join(folder(), name + ".json.gz"), "rt") as f:
            entry = json.load(f)
        return entry if {"hlo_text", "memory", "warnings"} <= entry.keys() else None
    except (OSError, EOFError, ValueError):
        return None


def store(name: str, entry: Mapping) -> None:
    """Write the entry whole (to a temporary file, then renamed); a folder that cannot be
    written to leaves the compile uncached."""
    if not folder():
        return
    tmp = ""
    try:
        os.makedirs(folder(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder(), prefix=".", suffix=".tmp")
        with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt", compresslevel=1) as f:
            json.dump(dict(entry), f)
        os.replace(tmp, os.path.join(folder(), name + ".json.gz"))
    except OSError:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
