"""The HTML report: self-contained, the expected charts, hostile text escaped, opens in Chromium."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import GENUINE
from conftest import run_cli as rlscope

from rlscope.analysis import analyze
from rlscope.metrics._common import pass_at_k
from rlscope.plots import PlotData, plot_data
from rlscope.render.html import render_html, write_report
from rlscope.report import MetricResult
from rlscope.synth import generate

RUN_ID = "</svg><script>document.title='pwned'</script>$x$"
ALGORITHM = "<img src=x onerror=\"document.title='pwned'\">"
PROMPT = "<svg onload=\"document.title='pwned'\">\x1b[2J"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Tags(HTMLParser):
    """Every start tag with its attributes, as the browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data


def parse(page: str) -> Tags:
    tags = Tags()
    tags.feed(page)
    return tags


def assert_inert(page: str) -> Tags:
    tags = parse(page)
    names = {t for t, _ in tags.tags}
    assert not names & {"script", "iframe", "object", "embed", "foreignobject", "img", "link"}
    for tag, attrs in tags.tags:
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        for key in ("href", "src", "xlink:href"):
            value = attrs.get(key) or ""
            assert not value or value.startswith(("#", "data:image/png")), (tag, key, value)
    assert tags.title == "rlscope report"
    return tags


def _fingerprint(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("report")
    healthy = generate(
        root / "healthy", "healthy", steps=20, prompts_per_step=6, seed=3, tokens=False
    )
    hostile = generate(root / "hostile", "grad-spike", steps=30, prompts_per_step=8, tokens=False)
    meta = json.loads((hostile / "run.json").read_text())
    meta.update(run_id=RUN_ID, algorithm=ALGORITHM)
    (hostile / "run.json").write_text(json.dumps(meta))
    (path,) = (hostile / "rollouts").glob("*.parquet")
    table = pq.read_table(path)
    prompt = pa.array([PROMPT + p for p in table["prompt_id"].to_pylist()])
    table = table.set_column(table.schema.get_field_index("prompt_id"), "prompt_id", prompt)
    pq.write_table(table, path)
    return healthy, hostile


@pytest.fixture(scope="module")
def page(runs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html") / "report.html"
    before = [_fingerprint(r) for r in runs]
    write_report(list(runs), out)
    assert [_fingerprint(r) for r in runs] == before  # read-only
    return out


EXPECTED_CHARTS = [
    "chart-stability.grad_norm",
    "chart-behavior.entropy",
    "chart-signal.pass_at_1",
    "chart-signal.zero_std_frac",
    "chart-length-0",  # accuracy by length bin
    "chart-length-1",  # correct vs incorrect lengths
    "chart-sigma-0",
    "chart-sigma-1",
    "chart-pass-k",
    "chart-entropy-decay",
    "chart-faithfulness",
]


def test_report_is_self_contained_with_the_expected_charts(page: Path) -> None:
    text = page.read_text()
    tags = assert_inert(text)
    ids = {attrs.get("id") for _, attrs in tags.tags}
    assert set(EXPECTED_CHARTS) <= ids
    assert sum(1 for t, _ in tags.tags if t == "svg") >= 20
    assert "Content-Security-Policy" in text and "script-src 'none'" in text
    # URLs only as XML namespace names (identifiers, never fetched).
    assert re.findall(r"\S*https?://", text) == re.findall(r'xmlns(?::\w+)?="https?://', text)
    # The grad spike is marked on its metric's chart; the healthy band is shaded.
    assert "grad-spike" in text and "healthy band" in text


def test_hostile_text_is_escaped_in_page_and_charts(page: Path) -> None:
    text = page.read_text()
    assert "<img" not in text and "<svg onload" not in text  # only as escaped text
    assert "&lt;/svg&gt;&lt;script&gt;" in text  # the run id, shown as text
    assert "\x1b" not in text
    assert "<script" not in text.lower()


def test_pass_curve_and_plot_data_match_the_metrics(runs: tuple[Path, Path]) -> None:
    healthy, _ = runs
    report = analyze(healthy)
    data = plot_data(healthy)
    assert data.pass_k is not None and data.pass_k.ks == tuple(range(1, 9))
    components = report.metrics["signal.pass_at_k"].extra["components"]
    # The final-window pass@k curve at k = 1 and k = N equals the metric's summary.
    assert data.pass_k.final[0] == pytest.approx(components["pass@1"])
    assert data.pass_k.final[-1] == pytest.approx(components["pass@8"])
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    assert data.length is not None and sum(data.length.counts) == report.run.n_groups * 8  # train
    assert data.sigma is not None and len(data.sigma.steps) == report.run.n_steps
    assert all(sum(row) <= 6 for row in data.sigma.counts)


def test_faithfulness_curve_is_plotted_when_present(runs: tuple[Path, Path]) -> None:
    report = analyze(runs[0], metrics=["behavior.entropy"])
    curve = {"fraction": [0.0, 0.25, 0.5, 1.0], "unchanged": [0.2, 0.4, 0.7, 1.0]}
    metric = MetricResult(
        "reasoning.early_answer_aoc", "L6", "AOC", 0.5, (0,), (0.5,), extra={"curve": curve}
    )
    without = render_html([report], [PlotData(None, None, None)])
    report = type(report)(report.run, {**report.metrics, metric.id: metric}, (), (), (), ())
    assert "no probes" in without
    page = render_html([report], [PlotData(None, None, None)])
    tags = assert_inert(page)
    start = page.index('id="chart-faithfulness"')
    assert "<svg" in page[start : start + 400] and "no probes" not in page
    assert ("details", {"id": "L6"}) in tags.tags  # a layer: folded unless flagged


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium_and_no_data_script_runs(
    page: Path, tmp_path: Path
) -> None:
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=2000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    tags = parse(dom)
    assert tags.title == "rlscope report"  # a data script would have set it to 'pwned'
    assert "pwned</title>" not in dom
    names = [t for t, _ in tags.tags]
    assert "script" not in names
    assert names.count("svg") >= 20
    ids = {attrs.get("id") for _, attrs in tags.tags}
    assert set(EXPECTED_CHARTS) <= ids


def test_cli_report(runs: tuple[Path, Path], tmp_path: Path) -> None:
    healthy, _ = runs
    out = tmp_path / "one.html"
    done = rlscope(
        "report", str(healthy), "-o", str(out), "--metrics", "behavior.entropy", "--align",
        "progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and out.is_file()
    assert_inert(out.read_text())
    inside = healthy / "report.html"
    done = rlscope("report", str(healthy), "-o", str(inside))
    assert done.returncode == 2 and "inside the run directory" in done.stderr
    assert not inside.exists()
    done = rlscope("report", str(tmp_path / "absent"), "-o", str(tmp_path / "x.html"))
    assert done.returncode == 2 and "Traceback" not in done.stderr


def test_report_output_errors_come_before_any_analysis(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlscope import analysis

    def no_analysis(*args: object, **kwargs: object) -> None:
        raise AssertionError("analysed before checking the output path")

    monkeypatch.setattr(analysis, "analyze", no_analysis)
    healthy, _ = runs
    folder = rlscope("report", str(healthy), "-o", str(tmp_path))
    assert folder.returncode == 2 and "is a directory" in folder.stderr
    missing = rlscope("report", str(healthy), "-o", str(tmp_path / "no" / "r.html"))
    assert missing.returncode == 2 and "no such folder" in missing.stderr


TRL_RUN = GENUINE / "trl-real" / "lr-too-high"
SHOTS = Path(__file__).resolve().parent.parent / ".screenshots"  # gitignored: for a person


@pytest.fixture(scope="module")
def pages(runs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The report of one run, of two runs, and of the real TRL fixture."""
    folder = tmp_path_factory.mktemp("pages")
    return {
        "one": write_report([runs[1]], folder / "one.html"),
        "two": write_report(list(runs), folder / "two.html"),
        "trl": write_report([TRL_RUN], folder / "trl.html", from_format="trl"),
    }


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
@pytest.mark.parametrize("width", [1400, 390])
@pytest.mark.parametrize("name", ["one", "two", "trl"])
def test_report_layout_in_chromium(
    pages: dict[str, Path], name: str, width: int, tmp_path: Path
) -> None:
    """Measured in the browser at a desktop and a phone width: the findings come first, no chart
    label is cut by its chart, no legend lies on a plotting area, nothing scrolls sideways; a
    screenshot of each is kept in .screenshots/ for a person to look at."""
    from chromium import LAYOUT, Browser

    with Browser(tmp_path / "profile") as browser:
        page = browser.open(pages[name].as_uri(), width)
        facts = page.evaluate(LAYOUT)
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(SHOTS / f"report-{name}-{width}.png")
    assert facts["title"] == "rlscope report"
    assert facts["order"][0] == "Findings", facts["order"][:3]
    if name == "two":
        assert facts["order"][1] == "Comparison with the baseline"
    assert facts["charts"] >= 15 and facts["labels"] > 5 * facts["charts"]  # ticks, titles
    assert facts["legends"] > 0
    assert facts["clipped"] == [], facts["clipped"][:5]
    assert facts["covered"] == [], facts["covered"][:5]
    overflow = facts["scrollWidth"] - width
    assert overflow <= 0, f"{overflow} px of horizontal scroll at {width} px"


def test_rolling_mean_wilson_and_window_against_direct_computations() -> None:
    import math

    from rlscope.render.html import rolling_mean, smoothing_window, wilson

    values = [1.0, None, 3.0, 4.0, float("nan"), 6.0, 7.0]
    got = rolling_mean(values, 3)
    defined = [None if v is None or math.isnan(v) else v for v in values]
    for i, value in enumerate(got):
        window = [v for v in defined[max(0, i - 1) : i + 2] if v is not None]
        assert value == pytest.approx(sum(window) / len(window))
    assert rolling_mean([None, None], 3)[0] != rolling_mean([None, None], 3)[0]  # NaN: no value
    assert rolling_mean([1.0, 2.0], 1) == [1.0, 2.0]
    assert smoothing_window(11, None) == 1 and smoothing_window(200, None) == 11
    assert smoothing_window(60, None) == 3 and smoothing_window(200, 0) == 1
    # Wilson 95% intervals (Agresti & Coull 1998, Table 1 style values).
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson(5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert wilson(10, 10)[1] == pytest.approx(1.0)


def test_report_smooth_option(runs: tuple[Path, Path], tmp_path: Path) -> None:
    healthy, _ = runs
    raw = rlscope("report", str(healthy), "-o", str(tmp_path / "raw.html"), "--smooth", "0")
    assert raw.returncode == 0, raw.stderr
    smooth = rlscope("report", str(healthy), "-o", str(tmp_path / "s.html"), "--smooth", "5")
    assert smooth.returncode == 0, smooth.stderr
    # Smoothing draws a second line per series: the smoothed page has more paths.
    paths = [(tmp_path / n).read_text().count("<polyline") for n in ("raw.html", "s.html")]
    assert paths[1] > paths[0]
    assert "rolling mean (5 steps)" in (tmp_path / "s.html").read_text()
    bad = rlscope("report", str(healthy), "-o", str(tmp_path / "b.html"), "--smooth", "-1")
    assert bad.returncode == 2 and "--smooth" in bad.stderr and not (tmp_path / "b.html").exists()
