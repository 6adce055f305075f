"""Write README.md and the pages of docs/ from their templates, running every command shown.

Each page has a template in docs/src: `docs/src/README.md` writes `README.md`, and
`docs/src/NAME.md` writes `docs/NAME.md`. In `console` blocks of a template, a `$ command`
line is followed by one directive for the output to show: `<<all>>`, `<<head N>>`,
`<<lines A-B,C-D>>` (1-based, inclusive; a `...` line marks each cut) or `<<none>>`.
`python` blocks are scripts written to the same scratch folder (named by a first line
`# NAME.py`), in order with the commands; a script runs where it stands unless a later
command of its group names it (`$ python NAME.py`, which runs it instead).

A line `<!-- group: NAME -->` (outside code blocks) starts a group: the commands from it to
the next such line run in order in one scratch folder of their own, where `experiments/` is
the repository's; commands before a page's first group line are its group `main`. Commands
that read what an earlier one wrote (a search store, a script's dump) must share a group;
different groups share nothing, so tests/docs/test_docs.py runs them in parallel. The group
lines stay in the written page (they do not render), and the tests read them there.

    python docs/build.py             # every page, from the repository root, in the venv
    python docs/build.py README cli  # these pages only (`make readme`: README)

Each page's commands are timed: the CPU seconds of each group are printed (the tests run
them all, so they are the suite's cost).
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "docs" / "src"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
GROUP = re.compile(r"^<!-- group: ([\w.-]+) -->$", re.M)
DIRECTIVE = re.compile(r"^<<(all|none|head (\d+)|lines ([\d,\-]+))>>$")
# A region written from the code: `<!-- generated: COMMAND -->`, the command's output as
# markdown, `<!-- end generated -->` (the config reference, from the fields' descriptions).
GENERATED = re.compile(r"^<!-- generated: (.+?) -->\n.*?^<!-- end generated -->$", re.M | re.S)


def pages() -> list[str]:
    """Every page with a template, README first."""
    names = sorted(p.stem for p in SRC.glob("*.md"))
    return sorted(names, key=lambda n: n != "README")


def source(page: str) -> Path:
    return SRC / f"{page}.md"


def output(page: str) -> Path:
    return REPO / "README.md" if page == "README" else REPO / "docs" / f"{page}.md"


@dataclass
class Step:
    kind: str  # "sh" (a `$ ` line of a console block) or "python" (a script block)
    text: str
    shown: list[str] = field(default_factory=list)  # what the page shows after it
    name: str = ""  # a script's file name
    write_only: bool = False  # a script that a later command runs


@dataclass
class Group:
    name: str
    steps: list[Step] = field(default_factory=list)


def script_name(body: str, i: int) -> str:
    m = re.match(r"# (\S+\.py)", body)
    return m.group(1) if m else f"doc_{i}.py"


def _mark_scripts(steps: list[Step]) -> None:
    for i, step in enumerate(steps):
        if step.kind == "python":
            step.name = script_name(step.text, i)
            runs = re.compile(rf"\bpython3?\s+(\S*/)?{re.escape(step.name)}(\s|$)")
            step.write_only = any(s.kind == "sh" and runs.search(s.text) for s in steps[i + 1:])


def _items(text: str):
    """Group lines and code blocks of a page in order, as ("group", match) and
    ("fence", match); a group line inside a code block is text of that block."""
    fences = list(FENCE.finditer(text))
    inside = [(m.start(), m.end()) for m in fences]
    groups = [m for m in GROUP.finditer(text)
              if not any(a <= m.start() < b for a, b in inside)]
    return sorted([("group", m) for m in groups] + [("fence", m) for m in fences],
                  key=lambda item: item[1].start())


def groups(text: str) -> list[Group]:
    """The commands of a page (a template or a written page) by group, in page order.
    Each step's `shown` is the lines after a `$ ` line up to the next (in a template: its
    directive)."""
    out = [Group("main")]
    for what, m in _items(text):
        if what == "group":
            if any(g.name == m.group(1) for g in out):
                raise ValueError(f"group {m.group(1)!r} appears twice")
            out.append(Group(m.group(1)))
        elif m.group(1) == "python":
            out[-1].steps.append(Step("python", m.group(2)))
        elif m.group(1) == "console":
            for line in m.group(2).splitlines():
                if line.startswith("$ "):
                    out[-1].steps.append(Step("sh", line[2:]))
                elif out[-1].steps and out[-1].steps[-1].kind == "sh":
                    out[-1].steps[-1].shown.append(line.rstrip())
    for g in out:
        _mark_scripts(g.steps)
    return [g for g in out if g.steps]


def environment(cwd: Path | None = None) -> dict[str, str]:
    """A user's shell: this repository's code and the project's `shardscope` first; with
    `cwd`, the user's cache folder in it (the host-cpu benchmark's, meshes/host.py)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    env.pop("JAX_PLATFORMS", None)
    if cwd is not None:
        env["XDG_CACHE_HOME"] = str(cwd / ".cache")
    return env


def scratch() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="shardscope-docs-")
    (Path(tmp.name) / "experiments").symlink_to(REPO / "experiments")
    return tmp


def argv(step: Step, cwd: Path) -> list[str] | None:
    """The command line of a step (a script is written first); None for a script that a
    later command runs."""
    if step.kind == "python":
        path = cwd / step.name
        path.write_text(step.text)
        return None if step.write_only else [sys.executable, str(path)]
    return ["bash", "-o", "pipefail", "-c", step.text]


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(step: Step, cwd: Path) -> list[str]:
    args = argv(step, cwd)
    if args is None:
        return []
    p = subprocess.run(args, cwd=cwd, env=environment(cwd), capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"command failed: {step.text}\n{p.stderr[-3000:]}")
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


class Timer:
    """CPU seconds of the commands of each group."""

    def __init__(self, page: str):
        self.page, self.rows = page, []

    def group(self, name: str):
        self.rows.append([name, 0, cpu_of_children(), time.perf_counter()])

    def step(self):
        self.rows[-1][1] += 1

    def report(self) -> str:
        lines, total = [], 0.0
        for i, (name, n, cpu0, t0) in enumerate(self.rows):
            end = self.rows[i + 1][2:] if i + 1 < len(self.rows) else \
                [cpu_of_children(), time.perf_counter()]
            total += end[0] - cpu0
            if n:
                lines.append(f"  {name:<16} {n:>3} commands  {end[0] - cpu0:7.1f} CPU-s  "
                             f"{end[1] - t0:7.1f} s")
        return "\n".join([f"{self.page}: {total:.1f} CPU-s", *lines])


def without_generated(text: str) -> str:
    """The text with each generated region's content left out (its markers kept)."""
    return GENERATED.sub(lambda m: f"<!-- generated: {m.group(1)} -->\n<!-- end generated -->",
                         text)


def fill_generated(text: str) -> str:
    """Each generated region filled with its command's output."""
    def fill(m):
        out = run(Step("sh", m.group(1)), REPO)
        return "\n".join([f"<!-- generated: {m.group(1)} -->", *out, "<!-- end generated -->"])
    return GENERATED.sub(fill, text)


def build(template: str, page: str = "page") -> tuple[str, Timer]:
    timer = Timer(page)
    scripts = iter([s for g in groups(template) for s in g.steps if s.kind == "python"])
    tmp = scratch()
    timer.group("main")
    pieces, pos = [], 0
    try:
        for what, m in _items(template):
            if what == "group":
                tmp.cleanup()
                tmp = scratch()
                timer.group(m.group(1))
                continue
            pieces.append(template[pos:m.start()])
            lang, body, cwd = m.group(1), m.group(2), Path(tmp.name)
            if lang == "python":
                script = next(scripts)
                run(script, cwd)
                if not script.write_only:
                    timer.step()
            elif lang == "console":
                out: list[str] = []
                lines = body.splitlines()
                for j, line in enumerate(lines):
                    if line.startswith("$ "):
                        nxt = lines[j + 1] if j + 1 < len(lines) else "<<none>>"
                        out.append(line)
                        shown = select(run(Step("sh", line[2:]), cwd), nxt)
                        timer.step()
                        if any(s.startswith("$ ") for s in shown):
                            raise SystemExit(f"{line}: an output line starts with '$ ' and "
                                             f"would read as a command; change its wording")
                        out += shown
                body = "\n".join(out) + "\n"
            pieces.append(f"```{lang}\n{body}```")
            pos = m.end()
    finally:
        tmp.cleanup()
    pieces.append(template[pos:])
    return fill_generated("".join(pieces)), timer


def main(argv: list[str]) -> None:
    chosen = argv or pages()
    unknown = [p for p in chosen if p not in pages()]
    if unknown:
        raise SystemExit(f"no template for {unknown}: the pages are {', '.join(pages())}")
    for page in chosen:
        groups(source(page).read_text())  # refuses a group named twice
        text, timer = build(source(page).read_text(), page)
        output(page).write_text(text)
        print(f"wrote {output(page).relative_to(REPO)}")
        print(timer.report(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
