"""The documentation's screenshot of `jaxagent view` (docs/assets/view.png): builds the static site of RUN_DIR, opens
it in headless Chromium, opens the highest-return stored episode of the last iteration
in the left pane and the lowest-return one in the right (coloured by SIGNAL), and saves
a PNG.

    .venv/bin/python examples/screenshot_view.py RUN_DIR [RUN_DIR] docs/assets/view.png [--signal advantage]
"""

import argparse
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from jaxagent import view


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="+")
    ap.add_argument("out")
    ap.add_argument("--signal", default="advantage")
    ap.add_argument("--width", type=int, default=1500)
    ap.add_argument("--height", type=int, default=1700)
    args = ap.parse_args()
    site = Path(tempfile.mkdtemp(prefix="jaxagent-shot-"))
    index = view.write_site(args.run_dir, site)
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={args.width},{args.height}",
    ):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get(index.as_uri())
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pane0 tr.episode-row"))
        if len(args.run_dir) > 1:
            Select(driver.find_element(By.CSS_SELECTOR, "#pane1 .run-select")).select_by_index(1)
        for k, best in ((0, max), (1, min)):  # the stored episode of the highest / lowest return
            rows = driver.find_elements(By.CSS_SELECTOR, f"#pane{k} tr.episode-row")
            row = best(rows, key=lambda r: float(r.find_elements(By.TAG_NAME, "td")[3].text))
            row.click()
            Select(driver.find_element(By.CSS_SELECTOR, f"#pane{k} .signal-select")).select_by_value(args.signal)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pane1 .segment.policy .tok"))
        driver.save_screenshot(args.out)
    finally:
        driver.quit()
        shutil.rmtree(site, ignore_errors=True)
    print(args.out)


if __name__ == "__main__":
    main()
