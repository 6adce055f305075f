"""Write README.md from docs/README.in.md, running every command it shows.

In `console` blocks of the template, a `$ command` line is followed by one directive for
the output to show: `<<all>>`, `<<head N>>`, `<<lines A-B,C-D>>` (1-based, inclusive; a
`...` line marks each cut) or `<<none>>`. `python` blocks run as scripts (named by a first
line `# NAME.py`) in the same scratch folder, in order, as tests/test_readme.py does.

    python docs/build_readme.py        # from the repository root, in the project's venv
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
DIRECTIVE = re.compile(r"^<<(all|none|head (\d+)|lines ([\d,\-]+))>>$")


def environment() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    env.pop("JAX_PLATFORMS", None)
    return env


def script_name(body: str, i: int) -> str:
    m = re.match(r"# (\S+\.py)", body)
    return m.group(1) if m else f"readme_{i}.py"


def run(kind: str, text: str, cwd: Path, i: int) -> list[str]:
    if kind == "python":
        path = cwd / script_name(text, i)
        path.write_text(text)
        argv = [sys.executable, str(path)]
    else:
        argv = ["bash", "-o", "pipefail", "-c", text]
    p = subprocess.run(argv, cwd=cwd, env=environment(), capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"README command failed: {text}\n{p.stderr[-3000:]}")
    return [ln.rstrip() for ln in p.stdout.splitlines()]


def select(lines: list[str], directive: str) -> list[str]:
    m = DIRECTIVE.match(directive)
    if m is None:
        raise SystemExit(f"bad directive {directive!r}")
    if m.group(1) == "all":
        return lines
    if m.group(1) == "none":
        return []
    if m.group(2):
        n = int(m.group(2))
        return lines[:n] + (["..."] if len(lines) > n else [])
    out: list[str] = []
    for part in m.group(3).split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if lo > 1 and (not out or out[-1] != "..."):
            out.append("...")
        out += lines[lo - 1:hi]
    if out and len(lines) > hi:
        out.append("...")
    return out


def build(template: str, cwd: Path) -> str:
    pieces, pos = [], 0
    for i, m in enumerate(FENCE.finditer(template)):
        pieces.append(template[pos:m.start()])
        lang, body = m.group(1), m.group(2)
        if lang == "python":
            run("python", body, cwd, i)
        elif lang == "console":
            out: list[str] = []
            lines = body.splitlines()
            for j, line in enumerate(lines):
                if line.startswith("$ "):
                    nxt = lines[j + 1] if j + 1 < len(lines) else "<<none>>"
                    out.append(line)
                    shown = select(run("sh", line[2:], cwd, i), nxt)
                    if any(s.startswith("$ ") for s in shown):
                        raise SystemExit(f"{line}: an output line starts with '$ ' and would "
                                         f"read as a command; change the output's wording")
                    out += shown
            body = "\n".join(out) + "\n"
        pieces.append(f"```{lang}\n{body}```")
        pos = m.end()
    pieces.append(template[pos:])
    return "".join(pieces)


def main() -> None:
    template = (REPO / "docs" / "README.in.md").read_text()
    with tempfile.TemporaryDirectory(prefix="shardscope-readme-") as tmp:
        (Path(tmp) / "experiments").symlink_to(REPO / "experiments")
        (REPO / "README.md").write_text(build(template, Path(tmp)))
    print("wrote README.md")


if __name__ == "__main__":
    main()
