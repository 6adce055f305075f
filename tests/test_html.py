"""The HTML report in a real headless browser (Debian's chromium, driven by Playwright):
the roofline has matmul points, none above its roof, ticks on both axes, and the page is
read as a user sees it, not as a string."""

import shutil

import pytest

from experiments import cli
from tests.test_cli import TINY, write

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: `make test` installs Debian's package as root")

# Points and roof compared where the browser drew them: each circle's centre against the
# roof polyline interpolated at its x (SVG y grows downwards: above the roof is smaller y).
GEOMETRY = """() => {
  const svg = document.querySelector('svg.roofline');
  const roof = Array.from(svg.querySelector('polyline.roof').points);
  const roofY = x => {
    for (let i = 1; i < roof.length; i++) {
      if (x <= roof[i].x + 1e-6) {
        const a = roof[i - 1], b = roof[i];
        return a.y + (b.y - a.y) * (x - a.x) / (b.x - a.x);
      }
    }
    return roof[roof.length - 1].y;
  };
  const frame = svg.querySelector('rect').getBBox();
  return {
    points: Array.from(svg.querySelectorAll('circle.point')).map(c => ({
      cx: c.cx.baseVal.value, cy: c.cy.baseVal.value, roof: roofY(c.cx.baseVal.value),
      kind: c.classList.contains('matmul') ? 'matmul' : 'memory',
      title: c.querySelector('title').textContent})),
    yticks: Array.from(svg.querySelectorAll('text.ytick')).map(t => t.textContent),
    frame: {x: frame.x, y: frame.y, w: frame.width, h: frame.height},
    roofLabel: svg.textContent,
  };
}"""


def test_html_report_in_a_headless_browser(tmp_path, capsys, cpu_devices):
    page_path = tmp_path / "r.html"
    # Two Llama-size layers: matmuls large enough to run near the roof, most of the step.
    text = TINY.replace('preset = "tiny"', 'preset = "tiny"\nd_model = 4096\nd_ff = 14336\n'
                        'n_heads = 32\nn_kv_heads = 8\nhead_dim = 128').replace(
        "seq_len = 32", "seq_len = 2048")
    assert cli.main(["run", write(tmp_path, text), "--quiet", "--html", str(page_path)]) == 0
    capsys.readouterr()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_path.as_uri())
        g = page.evaluate(GEOMETRY)
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        browser.close()
    assert errors == []
    points = g["points"]
    assert points, "empty roofline"
    assert any(pt["kind"] == "matmul" for pt in points), "no matmul points"
    for pt in points:
        assert pt["cy"] >= pt["roof"] - 0.5, f"above the roof: {pt['title']}"
        f = g["frame"]
        assert f["x"] <= pt["cx"] <= f["x"] + f["w"] and f["y"] <= pt["cy"] <= f["y"] + f["h"]
    assert len(g["yticks"]) >= 4 and "T" in "".join(g["yticks"])
    assert "roofs as the model times them" in g["roofLabel"] and "of the 989 peak" in \
        g["roofLabel"]
    assert (tmp_path / "report.png").stat().st_size > 10_000


def _result(name, step, mem, fits=True, status="ok"):
    from experiments.store import Result

    return Result(config_hash=name, tool_version="t", backend="cpu", search="s", name=name,
                  config={}, parallelism={}, varied={}, status=status,
                  message="" if status == "ok" else "refused: why",
                  step_time_s=step if status == "ok" else None,
                  tokens_per_s_per_device=1.0, mfu=0.4,
                  memory_per_device_bytes=mem if status == "ok" else None, fits=fits,
                  bottleneck="compute")


def test_search_page_in_a_headless_browser(tmp_path):
    # Five configs that ran: a (1 s, 40 GB), b (2 s, 20 GB), c (3 s, 10 GB) are the front;
    # d (2.5 s, 30 GB) is beaten by b on both; e does not fit. One refused.
    from experiments import search

    results = [_result("a", 1.0, 40e9), _result("b", 2.0, 20e9), _result("c", 3.0, 10e9),
               _result("d", 2.5, 30e9), _result("e", 0.5, 90e9, fits=False),
               _result("f", 0, 0, status="refused")]
    assert [r.name for r in search.pareto(results)] == ["e", "a", "b", "c"]
    page_path = tmp_path / "search.html"
    page_path.write_text(search.render_html(results, "t"))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(page_path.as_uri())
        g = page.evaluate("""() => {
          const svg = document.querySelector('svg.pareto');
          const f = svg.querySelector('rect').getBBox();
          return {
            points: Array.from(svg.querySelectorAll('circle.config')).map(c => ({
              x: c.cx.baseVal.value, y: c.cy.baseVal.value, front: c.classList.contains(
                'on-front'), hollow: c.getAttribute('fill') === 'none'})),
            front: svg.querySelector('polyline.front').points.length,
            frame: [f.x, f.y, f.width, f.height],
            ranking: Array.from(document.querySelectorAll('table.ranking tr')).length - 1,
            others: document.querySelector('table.others').innerText};
        }""")
        browser.close()
    assert len(g["points"]) == 5 and g["front"] == 4
    assert sum(p["front"] for p in g["points"]) == 4
    assert sum(p["hollow"] for p in g["points"]) == 1
    x, y, w, h = g["frame"]
    assert all(x <= p["x"] <= x + w and y <= p["y"] <= y + h for p in g["points"])
    # Step time grows upwards, memory to the right: c (3 s, 10 GB) is above and left of
    # a (1 s, 40 GB).
    a, _, c = sorted((p for p in g["points"] if p["front"] and not p["hollow"]),
                     key=lambda p: p["x"], reverse=True)
    assert c["y"] < a["y"] and c["x"] < a["x"]
    assert g["ranking"] == 4 and "refused: why" in g["others"] and "does not fit" in g["others"]


def test_compare_page_in_a_headless_browser(tmp_path, capsys, cpu_devices):
    # The tiny config on three 8-device systems (compiled once, re-timed on the others);
    # the TPU has no public power figure or price, so its per-MW and USD bars are left out
    # and said; the B200 has no public price either.
    page_path = tmp_path / "compare.html"
    assert cli.main(["compare", write(tmp_path, TINY), "--systems",
                     "h100:8,b200:8,tpu-v5e:2x4", "--quiet", "--html", str(page_path)]) == 0
    capsys.readouterr()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(page_path.as_uri())
        charts = page.evaluate("""() => Array.from(document.querySelectorAll('svg.bars')).map(
          svg => ({cls: svg.getAttribute('class'),
                   bars: Array.from(svg.querySelectorAll('rect.bar')).map(r => ({
                     w: r.width.baseVal.value, best: r.classList.contains('best'),
                     label: r.querySelector('title').textContent})),
                   missing: svg.nextElementSibling && svg.nextElementSibling.tagName === 'P'
                            ? svg.nextElementSibling.innerText : ''}))""")
        table = page.inner_text("pre.table")
        browser.close()
    by = {c["cls"].split()[1]: c for c in charts}
    assert set(by) == {"step", "tokens", "mfu", "per-mw", "usd"}
    for name in ("step", "tokens", "mfu"):
        bars = by[name]["bars"]
        assert len(bars) == 3 and sum(b["best"] for b in bars) == 1
        assert all(b["w"] > 0 for b in bars)
    # Lower is better for the step: the best bar is the shortest; higher for tokens/s.
    step, tokens = by["step"]["bars"], by["tokens"]["bars"]
    assert min(step, key=lambda b: b["w"])["best"]
    assert max(tokens, key=lambda b: b["w"])["best"]
    assert len(by["per-mw"]["bars"]) == 2 and "tpu-v5e:2x4" in by["per-mw"]["missing"]
    assert len(by["usd"]["bars"]) == 1 and "b200:8, tpu-v5e:2x4" in by["usd"]["missing"]
    assert "step time" in table and "b200:8" in table
