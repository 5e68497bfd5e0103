"""The README and the documentation site: the README stays a short front door whose links
resolve, every figure in docs/ is shown by a page, no page shows a path of the machine it
was written on, the generated config reference lists every key of the config schema and
the CLI reference every command, and the built site (`make docs`, which .ci/run runs
first) opens in headless Chromium with its quick start and a config key on the page."""

import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
#: links and images of Markdown: [text](target) / ![alt](target)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: absolute paths of a developer machine, CI or a temporary folder
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:work|root|home|tmp|opt|mnt|Users)/[\w.+-]")


def _schema_keys(cls, prefix=""):
    """The dotted keys of a config dataclass, walked here independently of jaxagent.dataclass_yaml."""
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from _schema_keys(type(default), prefix + f.name + ".")
        else:
            yield prefix + f.name


def _hooks():
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import reference
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    return reference


def test_readme_is_short_and_its_links_resolve():
    readme = ROOT / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: results go to docs/results/, not the README"
    targets = LINK.findall("\n".join(lines))
    assert any(t.startswith("docs/") for t in targets), "the README links into the docs"
    for target in targets:
        if re.match(r"^[a-z]+://", target) or target.startswith("#"):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.exists(), f"README.md links to {target}, which does not exist"


def test_no_page_shows_an_absolute_path_of_the_machine():
    for path in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *PAGES]:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not MACHINE_PATH.search(line), f"{path.relative_to(ROOT)}:{n} shows a machine path: {line.strip()}"


def test_every_image_in_docs_is_shown_by_a_page():
    shown = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if not re.match(r"^[a-z]+://", target):
                shown.add((page.parent / target.split("#")[0]).resolve())
    images = [p for p in DOCS.rglob("*") if p.suffix.lower() in {".png", ".jpg", ".jpeg", ".svg", ".gif"}]
    assert images, "docs/ has figures"
    unused = sorted(str(p.relative_to(ROOT)) for p in images if p.resolve() not in shown)
    assert not unused, f"figures no page shows (delete them or show them): {unused}"


def test_the_config_reference_lists_every_key_with_its_default():
    from jaxagent.train.config import TrainerConfig

    page = _hooks().config_markdown()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| <code>([\w.]+)</code> \|.*$", page, flags=re.M)}
    keys = set(_schema_keys(TrainerConfig))
    assert set(rows) == keys, f"missing {sorted(keys - set(rows))}, extra {sorted(set(rows) - keys)}"
    config = TrainerConfig()
    assert (
        f"| <code>{config.algo.gamma}</code> |" in rows["algo.gamma"] and "| <code>float</code> |" in rows["algo.gamma"]
    )
    assert f"| <code>{config.env.name}</code> |" in rows["env.name"]
    assert "| <code>OptimizerConfig &#124; None</code> |" in rows["critic_optim"]
    assert "<!-- jaxagent:config-keys -->" in (DOCS / "reference" / "config.md").read_text(encoding="utf-8")
    undocumented = [key for key, row in rows.items() if row.rstrip().endswith("|  |")]
    assert not undocumented, f"config keys whose section docstring says nothing of them: {undocumented}"


def test_the_cli_reference_shows_every_command_help():
    from jaxagent.cli import build_parser

    page = _hooks().cli_markdown()
    commands = re.findall(r"^    (\w+) ", build_parser().format_help(), flags=re.M)
    assert {"train", "config", "eval", "export", "plot", "view", "bench", "envs"} <= set(commands)
    for name in commands:
        assert f"## `jaxagent {name}`" in page and f"usage: jaxagent {name} " in page


def _site() -> Path:
    site = ROOT / "site"
    if not (site / "index.html").is_file():
        if os.environ.get("JAXAGENT_DOCS") == "require":
            pytest.fail("JAXAGENT_DOCS=require but site/index.html is missing: run `make docs` first")
        pytest.skip("the documentation site is not built (make docs)")
    return site


def test_the_built_site_in_headless_chromium():
    from browser_testlib import chromium_driver
    from selenium.webdriver.common.by import By

    site = _site()
    driver = chromium_driver()
    try:
        driver.get((site / "index.html").as_uri())
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "Quick start" in body and "make train" in body
        nav = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "nav a") if a.text]
        for section in ("Getting started", "Guides", "Reference", "Explanations", "Results"):
            assert any(section in t for t in nav) or section in body, f"no {section} in the site's navigation"
        driver.get((site / "reference" / "config" / "index.html").as_uri())
        cells = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "td code")]
        assert "update.trim_chunks" in cells and "algo.gamma" in cells
        assert driver.find_element(By.TAG_NAME, "h1").text.startswith("Configuration")
    finally:
        driver.quit()
