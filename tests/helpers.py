"""What many test files share: a tiny experiment config, the CLI run in-process, and the
headless browser of the HTML tests."""

import importlib.util
import json
import shutil

import pytest

from experiments import cli

TINY = """
name = "t"
[model]
preset = "tiny"
[system]
name = "h100:8"
[parallelism]
data = 2
fsdp = 4
[workload]
seq_len = 32
global_batch = 16
"""

# A 4-layer Llama 3 70B slice decoding on 8 chips (TP 8): the weight and cache reads of
# the deviceless TPU and GPU compilers' programs.
DECODE_70B = """
name = "decode"
[model]
preset = "llama3-70b"
n_layers = 4
[system]
name = "tpu-v6e:2x4"
[parallelism]
tensor = 8
[workload]
kind = "decode"
seq_len = 2048
global_batch = 64
[precision]
params = "bfloat16"
compute = "bfloat16"
"""


def write(tmp_path, text, name="exp.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def run_cli(args, capsys):
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(tmp_path, text, capsys, *args) -> dict:
    """`shardscope run` on the config `text` with `args`: its JSON report (it must exit 0)."""
    out = tmp_path / "run.json"
    code, _, err = run_cli(["run", write(tmp_path, text), *args, "--json", str(out)], capsys)
    assert code == 0, err
    return json.loads(out.read_text())


# The HTML pages are read in a real headless browser: Debian's chromium, driven by
# Playwright (whose own browser download is not reachable everywhere).
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or importlib.util.find_spec("playwright") is None,
    reason="no chromium or playwright: `make test` installs Debian's chromium as root")


def tpu_compiler_refuses(monkeypatch):
    """The TPU compiler's out-of-memory refusal given, not compiled (the real one takes a
    large program): the TPU target's compile raises it, every other compile runs."""
    from sharding import api
    from sharding import compiler as backends

    real = api.compile_to_hlo

    def refusing(fn, *args, final_hlo=False, **kw):
        if final_hlo:  # the TPU target's compile
            raise backends.DoesNotFit("the program does not fit: Ran out of memory on HBM")
        return real(fn, *args, final_hlo=final_hlo, **kw)

    monkeypatch.setattr(api, "compile_to_hlo", refusing)


def filled_store(path, raw, axes=("data", "tensor"), *, label, step=1e-3, unfit=(), errors=()):
    """A results store holding a made-up result for every candidate of `raw` over `axes`, stored
    by a search named `label` (nothing compiles when a search of them runs): each that
    validates ran in `step` s (plus 1 us per candidate, in order), but the shapes in
    `unfit` (refused as too large) and `errors` (failed); the others are the validator's
    refusals."""
    from experiments import search
    from experiments.store import Result, Store, tool_version

    cands = search.enumerate_candidates(raw, 8, axes)
    with Store(path) as s:
        for i, c in enumerate(cands):
            shape = c.name.removeprefix(raw["name"] + "-")
            status, message = ("ok", "") if c.exp else ("refused", c.reason)
            if shape in unfit:
                status, message = "refused", "does not fit: needs 90 GB of HBM per device"
            if shape in errors:
                status, message = "error", "did not finish within 1800 s"
            s.add(Result(config_hash=c.key, tool_version=tool_version(), backend="cpu",
                         search=label, name=c.name, config=c.config, parallelism=c.sizes,
                         varied=c.varied, status=status, message=message,
                         step_time_s=step + 1e-6 * i if status == "ok" else None,
                         tokens_per_s_per_device=1.0, mfu=0.1,
                         memory_per_device_bytes=1e9 if status == "ok" else None,
                         fits=True if status == "ok" else None, bottleneck="compute"))
    return cands


def sync_playwright():
    from playwright.sync_api import sync_playwright

    return sync_playwright()
