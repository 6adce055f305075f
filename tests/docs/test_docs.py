"""Every command the README and the pages of docs/ show is run here, so they cannot go stale.

Each page is written from its template in docs/src by docs/build.py (`make docs`), which runs
the same commands. `console` blocks hold `$ command` lines, each followed by the output the
page shows (a line `...` skips output). A page's commands come in groups (`<!-- group: NAME
-->` lines; docs/build.py says how): each group is one test, run in a scratch folder of its
own where `experiments/` is the repository's, with the project's `shardscope` first on PATH,
so that pytest-xdist runs the groups in parallel. Each command must exit 0, print the shown
first (non-blank) line exactly, and every other shown line somewhere in its output. `python`
blocks are scripts written to the same folder (named by a first line `# NAME.py`), in order
with the commands, and run there unless a later command of the group runs them.
"""

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _load_builder():
    # By path: a module named `docs` may mean this folder to pytest's import machinery.
    spec = importlib.util.spec_from_file_location("shardscope_docs_build",
                                                  REPO / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


build = _load_builder()
# Commands that print what they measured (step times vary from run to run): their lines are
# compared with every number, its unit and the spacing masked.
MEASURED = ("shardscope measure",)
_NUMBER = re.compile(r"[+-]?\d[\d.,]*(?: ?(?:ms|us|ns|s|%)\b)?%?")


def _masked(line: str) -> str:
    return " ".join(_NUMBER.sub("#", line).split())
PAGES = build.pages()
GROUPS = [(page, g.name) for page in PAGES
          for g in build.groups(build.output(page).read_text())]


def _group(page: str, name: str):
    return next(g for g in build.groups(build.output(page).read_text()) if g.name == name)


@pytest.mark.slow
@pytest.mark.parametrize("page,group", GROUPS, ids=[f"{p}-{g}" for p, g in GROUPS])
def test_every_command_runs_and_prints_what_it_shows(page, group, tmp_path):
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    env = build.environment(tmp_path)  # as a user's shell has it: no JAX_PLATFORMS
    for step in _group(page, group).steps:
        argv = build.argv(step, tmp_path)  # writes a script; None: a later command runs it
        if argv is None:
            continue
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, f"{page}: {step.text}\n{p.stderr[-2000:]}"
        got = [ln.rstrip() for ln in p.stdout.splitlines() if ln.strip()]
        want = [ln for ln in step.shown if ln.strip() and ln.strip() != "..."]
        if any(m in step.text for m in MEASURED):
            got, want = [_masked(ln) for ln in got], [_masked(ln) for ln in want]
        if want:
            assert got and got[0] == want[0], \
                f"{page}: {step.text}: first line\n{got[:1]}\n{want[0]}"
            missing = [ln for ln in want[1:] if ln not in got]
            assert not missing, (f"{page}: {step.text}: not in its output: {missing[:3]}\n"
                                 f"its output:\n" + "\n".join(got[:60]))


@pytest.mark.parametrize("page", PAGES)
def test_each_page_is_built_from_its_template(page):
    # A page is its template with each command's output filled in: the prose, the group
    # lines and the commands are the template's (the outputs are checked by running them).
    def skeleton(text):
        return build.FENCE.sub(lambda m: m.group(1),
                               build.without_generated(text)).splitlines()

    assert skeleton(build.output(page).read_text()) == \
        skeleton(build.source(page).read_text())
    assert [(g.name, [s.text for s in g.steps]) for g in
            build.groups(build.output(page).read_text())] == \
        [(g.name, [s.text for s in g.steps]) for g in
         build.groups(build.source(page).read_text())]


def test_the_readme_is_a_front_door():
    # The pitch, the quick start, one report and one example per command; the rest is in
    # docs/, each page linked from it.
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 400, "README.md past 400 lines: move detail to docs/"
    assert "../shared" not in readme
    for page in PAGES:
        if page != "README":
            assert f"](docs/{page}.md)" in readme, page
    written = {p.stem for p in (REPO / "docs").glob("*.md")}
    assert written == set(PAGES) - {"README"}, "a page of docs/ without a template"


def test_the_links_between_pages_resolve():
    # Relative links of the pages and ARCHITECTURE.md, and their #anchors (GitHub's: a
    # heading lowercased, without punctuation, spaces as hyphens).
    def anchors(path):
        text = build.FENCE.sub("", path.read_text())
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", text, re.M)}

    broken = []
    for page in [*map(build.output, PAGES), REPO / "ARCHITECTURE.md"]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = link.partition("#")
            target = (page.parent / path) if path else page
            if "://" not in link and not (target.exists() and (
                    not anchor or target.suffix != ".md" or anchor in anchors(target))):
                broken.append(f"{page.name}: {link}")
    assert not broken, broken


def test_the_readme_shows_commands_of_every_kind():
    steps = [s for g in build.groups((REPO / "README.md").read_text()) for s in g.steps]
    shown = " ".join(s.text for s in steps if s.kind == "sh")
    for sub in ("run", "configs", "systems", "models", "inspect", "validate", "calibrate",
                "search", "results", "compare", "diff", "measure"):
        assert f"shardscope {sub}" in shown, sub
    assert any(s.kind == "python" for s in steps)


def test_the_config_reference_is_generated_from_the_code():
    # docs/config.md's tables are `shardscope keys --markdown`: the descriptions on the
    # config dataclasses' fields, every key with one.
    from experiments import reference as generated

    page = (REPO / "docs" / "config.md").read_text()
    region = build.GENERATED.search(page).group(0).splitlines()[1:-1]
    assert "\n".join(region).strip() == generated.markdown().strip()
    assert generated.missing_descriptions() == []


def test_the_config_reference_lists_every_key():
    from experiments.config import _SECTIONS

    reference = (REPO / "docs" / "config.md").read_text()
    missing = [f"{section}.{key}" for section, keys in _SECTIONS.items() for key in keys
               if f"`{section}.{key}`" not in reference]
    assert not missing, missing


def test_the_builder_reads_directives_and_groups():
    assert build.DIRECTIVE.match("<<lines 1-7,19-19>>")
    assert build.select([str(i) for i in range(1, 6)], "<<lines 2-3>>") == \
        ["...", "2", "3", "..."]
    page = ("a\n```console\n$ echo 1\n<<all>>\n```\n<!-- group: two -->\n"
            "```python\n# s.py\n```\n```console\n$ cat s.py\n<<all>>\n```\n")
    assert [(g.name, [(s.kind, s.write_only) for s in g.steps])
            for g in build.groups(page)] == \
        [("main", [("sh", False)]), ("two", [("python", False), ("sh", False)])]
    run_later = build.groups("```python\n# s.py\n```\n```console\n$ python s.py\n```\n")
    assert [(s.name, s.write_only) for s in run_later[0].steps] == \
        [("s.py", True), ("", False)]
    with pytest.raises(ValueError):
        build.groups("<!-- group: a -->\n```console\n$ true\n```\n<!-- group: a -->\n")
    assert build.output("README") == REPO / "README.md"
    assert build.output("cli") == REPO / "docs" / "cli.md"
