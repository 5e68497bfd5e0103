"""`jaxagent view`: the static site of a tiny real run, read back in Python and driven in
headless Chromium (selenium; the OS packages `chromium` and `chromium-driver`, which
`.ci/run` installs): open an episode, switch the colouring, compare the shown values
with the stored ones, filter, and put two runs side by side."""

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from browser_testlib import chromium_driver

from jaxagent import view
from jaxagent.train.rundir.episodes import read_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(stored_run):
    return stored_run.run_dir


def _load_js(path: Path, call: str):
    text = path.read_text(encoding="utf-8")
    assert text.startswith(call + "(") and text.endswith(");\n")
    return text[len(call) + 1 : -3]


def test_the_site_holds_the_runs_metrics_and_stored_episodes(run_dir, tmp_path):
    index = view.write_site([run_dir], tmp_path / "site")
    assert index.name == "index.html" and (tmp_path / "site" / "viewer.js").is_file()
    runs = json.loads(_load_js(tmp_path / "site" / "data" / "runs.js", "JAXAGENT.setRuns"))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert runs[0]["metrics"] == metrics and runs[0]["id"] == "run0"
    stored = read_store(run_dir)
    assert sorted(runs[0]["iterations"]) == ["1", "2"]
    assert sum(len(v) for v in runs[0]["iterations"].values()) == len(stored) == 12
    body = _load_js(tmp_path / "site" / "data" / "run0" / "iter_2.js", "JAXAGENT.loaded")
    run_id, it, episodes = json.loads(f"[{body}]")
    assert (run_id, it) == ("run0", 2) and episodes == [r for r in stored if r["iteration"] == 2]
    # nothing of the page comes from outside the site
    for name in view.STATIC_FILES:
        text = (tmp_path / "site" / name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text


def test_a_run_that_just_started_or_is_being_written_shows(run_dir, tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("seed: 0\n")
    (fresh / "metrics.jsonl").write_text("")  # a fresh run's empty file
    run, by_iter = view.read_run(fresh)
    assert run["metrics"] == [] and by_iter == {} and run["iterations"] == {}
    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    whole = (live / "metrics.jsonl").read_text()
    (live / "metrics.jsonl").write_text(whole + '{"iteration": 3, "succ')  # a line being appended
    run, _ = view.read_run(live)
    assert [m["iteration"] for m in run["metrics"]] == [1, 2]
    (live / "metrics.jsonl").write_text('{"iteration": 1}\nnot json\n{"iteration": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not valid JSON"):
        view.read_run(live)
    # a NaN metric is shown as a gap (None), never written as NaN
    (live / "metrics.jsonl").write_text(whole.replace('"approx_kl": ', '"approx_kl": NaN, "x": ', 1))
    site = view.write_site([live, fresh], tmp_path / "site")
    text = (site.parent / "data" / "runs.js").read_text()
    assert "NaN" not in text and '"approx_kl": null' in text


def test_bad_run_directories_are_named(tmp_path):
    with pytest.raises(view.ViewError, match="no such run directory"):
        view.write_site([tmp_path / "nope"], tmp_path / "site")
    (tmp_path / "empty").mkdir()
    with pytest.raises(view.ViewError, match="neither metrics.jsonl nor an episode store"):
        view.write_site([tmp_path / "empty"], tmp_path / "site")
    assert not (tmp_path / "site").exists()  # nothing written when a run cannot be read
    out = subprocess.run(
        [sys.executable, "-m", "jaxagent", "view", str(tmp_path / "nope"), "--out", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and "jaxagent view: error:" in out.stderr and "nope" in out.stderr


def test_serve_rebuilds_the_site_on_every_page_load(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    urls = []
    thread = threading.Thread(target=view.serve, args=([copy],), kwargs={"port": 0, "ready": urls.append}, daemon=True)
    thread.start()
    for _ in range(100):
        if urls:
            break
        time.sleep(0.05)
    url = urls[0]
    assert b"viewer.js" in urllib.request.urlopen(url, timeout=10).read()
    first = urllib.request.urlopen(url + "data/runs.js", timeout=10).read()
    with (copy / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iteration": 3, "success_rate": 0.5}) + "\n")
    urllib.request.urlopen(url, timeout=10).read()
    second = urllib.request.urlopen(url + "data/runs.js", timeout=10).read()
    assert second != first and b'"iteration": 3' in second


# ---------------------------------------------------------------------------- in a browser
def test_the_page_in_headless_chromium(run_dir, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    fresh = tmp_path / "fresh"  # a run that has just started: no metrics, no store
    fresh.mkdir()
    (fresh / "config.yaml").write_text("seed: 0\n")
    index = view.write_site([run_dir, other, fresh], tmp_path / "site")
    stored = [r for r in read_store(run_dir) if r["iteration"] == 2]
    driver = chromium_driver()
    try:
        driver.get(index.as_uri())
        wait = WebDriverWait(driver, 20)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pane0 tr.episode-row"))
        assert driver.execute_script("return window.JAXAGENT.state.runs.length") == 3
        # the curves: one chart per metric present, a line per run
        titles = [c.get_attribute("data-title") for c in driver.find_elements(By.CSS_SELECTOR, ".chart")]
        assert "training success" in titles and "entropy" in titles
        chart = driver.find_element(By.CSS_SELECTOR, '.chart[data-title="training success"]')
        assert len(chart.find_elements(By.CSS_SELECTOR, "polyline")) == 2
        # any other metric can be drawn: the phase times, for one
        Select(driver.find_element(By.CSS_SELECTOR, ".metric-select")).select_by_value("time_update_s")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '.chart[data-title="time_update_s"] polyline'))
        # both panes show the last iteration's stored episodes
        for k in (0, 1):
            rows = driver.find_elements(By.CSS_SELECTOR, f"#pane{k} tr.episode-row")
            assert sorted(int(r.get_attribute("data-index")) for r in rows) == sorted(r["index"] for r in stored)
        Select(driver.find_element(By.CSS_SELECTOR, "#pane1 .run-select")).select_by_index(2)
        assert "no episode store" in driver.find_element(By.CSS_SELECTOR, "#pane1 .episode-list").text
        Select(driver.find_element(By.CSS_SELECTOR, "#pane1 .run-select")).select_by_index(1)
        assert len(driver.find_elements(By.CSS_SELECTOR, "#pane1 tr.episode-row")) == len(stored)
        # open the first episode; its policy tokens carry the stored advantages
        rec = stored[0]
        driver.find_element(By.CSS_SELECTOR, f'#pane0 tr.episode-row[data-index="{rec["index"]}"]').click()
        policy = [s for s in rec["segments"] if s["kind"] == "policy"]

        def shown():
            spans = driver.find_elements(By.CSS_SELECTOR, "#pane0 .segment.policy .tok")
            return [float(s.get_attribute("data-value")) for s in spans]

        wait.until(lambda d: len(shown()) == sum(len(s["tokens"]) for s in policy))
        assert shown() == pytest.approx([v for s in policy for v in s["advantage"]], abs=1e-9)
        for signal in ("logp", "entropy", "ratio"):
            Select(driver.find_element(By.CSS_SELECTOR, "#pane0 .signal-select")).select_by_value(signal)
            want = [v for s in policy for v in s[signal]]
            wait.until(lambda d, want=want: shown() == pytest.approx(want, abs=1e-9))
        # hovering a token shows every signal of it
        first = driver.find_element(By.CSS_SELECTOR, "#pane0 .segment.policy .tok")
        ActionChains(driver).move_to_element(first).perform()
        tip = driver.find_element(By.ID, "tooltip")
        wait.until(lambda d: tip.is_displayed())
        text = tip.text
        assert f"id {policy[0]['tokens'][0]}" in text
        # the page prints a value as JavaScript's +v.toFixed(5)
        entropy = float(f"{policy[0]['entropy'][0]:.5f}")
        assert f"entropy      {entropy!r}" in text
        # per-turn rewards and the episode's header
        heads = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#pane0 .turn-head")]
        assert len(heads) == len(policy) and all("reward" in h for h in heads)
        # a return filter that excludes everything, then one that keeps the best only
        best = max(r["return"] for r in stored)
        box = driver.find_element(By.CSS_SELECTOR, "#pane0 .filter-min")
        box.send_keys(str(best + 1))
        wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#pane0 tr.episode-row"))
        box.clear()
        box.send_keys(repr(best))
        wait.until(
            lambda d: (
                len(d.find_elements(By.CSS_SELECTOR, "#pane0 tr.episode-row"))
                == sum(r["return"] >= best for r in stored)
            )
        )
        driver.save_screenshot(str(tmp_path / "page.png"))
        assert (tmp_path / "page.png").stat().st_size > 10_000
    finally:
        driver.quit()
