"""Every command the README shows is run here, so the README cannot go stale.

README.md is written from docs/README.in.md by docs/build_readme.py (`make readme`), which
runs the same commands. `console` blocks hold `$ command` lines, each followed by the
output the README shows (a line `...` skips output). Each command runs in a scratch folder
where `experiments/` is the repository's, with the project's `shardscope` first on PATH; it
must exit 0, print the shown first (non-blank) line exactly, and every other shown line
somewhere in its output. `python` blocks run as scripts in the same folder (named by a
first line `# NAME.py`), in order with the commands (the HLO dump example runs the script
the block before it wrote).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def commands(body: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) of a console block."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line.rstrip())
    return out


def steps() -> list[tuple[str, str, list[str]]]:
    """("sh" | "python", text, shown output) in README order."""
    out = []
    for lang, body in blocks((REPO / "README.md").read_text()):
        if lang == "console":
            out += [("sh", cmd, shown) for cmd, shown in commands(body)]
        elif lang == "python":
            out.append(("python", body, []))
    return out


def test_the_readme_shows_commands_of_every_kind():
    shown = " ".join(text for kind, text, _ in steps() if kind == "sh")
    for sub in ("run", "configs", "systems", "models", "inspect", "validate", "calibrate",
                "search", "results", "compare"):
        assert f"shardscope {sub}" in shown, sub
    assert any(kind == "python" for kind, _, _ in steps())
    assert "../shared" not in (REPO / "README.md").read_text()


def test_every_readme_command_runs_and_prints_what_it_shows(tmp_path):
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    env.pop("JAX_PLATFORMS", None)  # as a user's shell has it
    for i, (kind, text, shown) in enumerate(steps()):
        if kind == "python":
            m = re.match(r"# (\S+\.py)", text)
            script = tmp_path / (m.group(1) if m else f"readme_{i}.py")
            script.write_text(text)
            argv = [sys.executable, str(script)]
        else:
            argv = ["bash", "-o", "pipefail", "-c", text]
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, f"{text}\n{p.stderr[-2000:]}"
        got = [ln.rstrip() for ln in p.stdout.splitlines() if ln.strip()]
        want = [ln for ln in shown if ln.strip() and ln.strip() != "..."]
        if want:
            assert got and got[0] == want[0], f"{text}: first line\n{got[:1]}\n{want[0]}"
            missing = [ln for ln in want[1:] if ln not in got]
            assert not missing, f"{text}: not in its output: {missing[:3]}"


def test_the_config_reference_lists_every_key():
    from experiments.config import _SECTIONS

    text = (REPO / "README.md").read_text()
    reference = text[text.index("## Config reference"):text.index("## Python API")]
    missing = [f"{section}.{key}" for section, keys in _SECTIONS.items() for key in keys
               if f"`{section}.{key}`" not in reference]
    assert not missing, missing


def test_the_readme_is_built_from_its_template():
    # README.md is docs/README.in.md with each command's output filled in: the prose and
    # the commands are the template's (the outputs are checked by running them, above).
    import docs.build_readme as build

    def skeleton(text):
        return [ln for ln in FENCE.sub(lambda m: m.group(1), text).splitlines()]

    assert skeleton((REPO / "README.md").read_text()) == \
        skeleton((REPO / "docs" / "README.in.md").read_text())
    assert build.DIRECTIVE.match("<<lines 1-7,19-19>>")
