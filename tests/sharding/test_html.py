"""The HTML report (sharding/html.py): one file with its plots, and in a real headless browser
(Debian's chromium, driven by Playwright) the roofline has matmul points, none above its
roof, ticks on both axes, and the page is read as a user sees it, not as a string."""

from experiments import cli
from tests.helpers import CHROMIUM, TINY, needs_browser, run_cli, sync_playwright, write


def test_html_report_is_one_file_with_its_plots(tmp_path, capsys, cpu_devices):
    out = tmp_path / "r.html"
    code, _, err = run_cli(["run", write(tmp_path, TINY), "--html", str(out)], capsys)
    assert code == 0, err
    page = out.read_text()
    assert page.count("<svg") == 3  # step breakdown, bytes per link, roofline
    assert "Roofline" in page and "<circle" in page and "polyline" in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


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
    barLabels: Array.from(document.querySelectorAll('svg.bars text.label')).map(t => ({
      text: t.textContent, x: t.getBBox().x})),
  };
}"""


@needs_browser
def test_html_report_in_a_headless_browser(tmp_path, capsys, cpu_devices):
    page_path = tmp_path / "r.html"
    # Two Llama-size layers: matmuls large enough to run near the roof, most of the step.
    text = TINY.replace('preset = "tiny"', 'preset = "tiny"\nd_model = 4096\nd_ff = 14336\n'
                        'n_heads = 32\nn_kv_heads = 8\nhead_dim = 128').replace(
        "seq_len = 32", "seq_len = 2048").replace(
        # two nodes of 4: collectives over InfiniBand too, the longest bar label
        'name = "h100:8"', 'name = "h100:8"\ngpus_per_domain = 4')
    assert cli.main(["run", write(tmp_path, text), "--quiet", "--html", str(page_path)]) == 0
    capsys.readouterr()
    with sync_playwright() as p:
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
    # every bar's label drawn whole, inside its chart ("nvlink collectives (overlapped or
    # not)" was cut at the left edge)
    labels = g["barLabels"]
    assert any("infiniband collectives" in b["text"] for b in labels)
    assert all(b["x"] >= 0 for b in labels), labels


def test_html_report_of_a_run_past_one_compile_says_how_it_was_read(cpu_devices):
    # 8 devices as 4 data-parallel replicas, compiled with 2 of them (4 devices): the page
    # says so, as the terminal report's `extrapolated:` line does.
    import html

    from experiments import config, runner
    from meshes import get_system
    from sharding.html import render_html

    exp = config.load("tiny-h100-dp-tp", ["parallelism.data=4", "parallelism.tensor=2"])
    report = runner.run(exp, max_compile_devices=4)
    assert report.extrapolated_from.startswith("compiled on 4 devices (2 of the 4 ")
    page = render_html(report, chip=get_system("h100:8").chip)
    assert html.escape(report.extrapolated_from) in page
    # the model it stands for, as the terminal report's `model:` line names it
    assert report.model == "tiny (n_kv_heads 4)" and "<p>Model tiny (n_kv_heads 4); " in page
