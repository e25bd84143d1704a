"""Look at the MLflow UI the way a user does, in headless Chromium, and print what each page shows.

    make mlflow-ui &                                             # the UI on http://127.0.0.1:5000
    .venv/bin/python benchmarks/mlflow_ui_check.py --url http://127.0.0.1:5000 --target smollm2-135m

Pages, in a user's order: the experiments list (Model training) → the target's experiment (runs table,
with its Dataset column) → the newest training run's Overview, Model metrics, System metrics and Artifacts
tabs → the newest sweep parent run's Artifacts (its plots) → the registered version of that training run
(its description and source run). For each page it prints the title, the lines a user would read and
whether what JetFlow logs is there ("ok" / "MISSING"), and saves a screenshot under --out (outside the
repository). Exit code 0 when everything expected was seen, 1 otherwise.

Needs Debian's Chromium and its driver (`apt-get install -y chromium chromium-driver`) and Selenium
(`.venv/bin/pip install selenium`); nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@dataclass
class Page:
    name: str
    route: str                                       # after the UI's '#'
    expect: list[str] = field(default_factory=list)  # text a user should see there
    show: str = ""                                   # regex: the lines worth printing
    clicks: list[str] = field(default_factory=list)  # what a user clicks there, by its text (a folder, a file)
    image: bool = False                              # an artifact image must be on display


def browser(width: int = 1600, height: int = 2400):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def visit(driver, url: str, page: Page, out: Path, wait_s: float) -> bool:
    """Open the page, wait until the expected text rendered (the UI is a single-page app that fetches
    after load), print what it shows, save a screenshot. True when everything expected was seen."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get("about:blank")  # a fresh load each time: the same route would keep the last page's state
    driver.get(f"{url}/#{page.route}")
    body = lambda: driver.find_element(By.TAG_NAME, "body").text  # noqa: E731
    for label in page.clicks:
        try:
            WebDriverWait(driver, wait_s).until(lambda d: click_text(d, label))
        except TimeoutException:
            print(f"   (could not click {label!r})")
    try:
        WebDriverWait(driver, wait_s).until(lambda d: all(e in body() for e in page.expect) if page.expect
                                            else len(body()) > 200)
    except TimeoutException:
        pass
    time.sleep(1.5)  # charts and images draw after their data arrives
    shot = out / (re.sub(r"[^A-Za-z0-9]+", "-", page.name).strip("-").lower() + ".png")
    driver.save_screenshot(str(shot))  # the page as it first shows, before scrolling
    text = body()
    if not all(e in text for e in page.expect):
        text += "\n" + scrolled_text(driver, body)
    images = driver.execute_script(
        "return [...document.images].filter(i => i.complete && i.naturalWidth > 300).length")  # not icons
    print(f"\n== {page.name}\n   {url}/#{page.route}\n   title: {driver.title!r}; screenshot: {shot}")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    shown = [line for line in lines if page.show and re.search(page.show, line)]
    for line in list(dict.fromkeys(shown))[:25]:
        print(f"   | {line[:160]}")
    ok = True
    for expected in page.expect:
        seen = expected in text
        ok &= seen
        print(f"   {'ok     ' if seen else 'MISSING'} {expected!r}")
    if page.image:
        ok &= images > 0
        print(f"   {'ok     ' if images else 'MISSING'} the image itself ({images} drawn)")
    return ok


def scrolled_text(driver, body, steps: int = 40) -> str:
    """What a user reads by scrolling down: the UI renders long pages (a run's metric charts, grouped in
    sections) only as they come into view, so the text is gathered screen by screen."""
    seen: list[str] = []
    for _ in range(steps):
        moved = driver.execute_script(
            "let moved = false;"
            "for (const e of document.querySelectorAll('*')) {"
            "  if (e.scrollHeight > e.clientHeight + 10 && e.scrollTop + e.clientHeight < e.scrollHeight - 2"
            "      && getComputedStyle(e).overflowY.match(/auto|scroll/)) {"
            "    e.scrollTop += e.clientHeight * 0.8; moved = true; } }"
            "return moved;")
        time.sleep(0.7)
        seen.append(body())
        if not moved:
            break
    return "\n".join(seen)


def click_text(driver, label: str) -> bool:
    """Click the innermost visible element whose own text is `label` (a tree node, a toggle, a tab)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    for element in driver.find_elements(By.XPATH, f"//*[normalize-space(text())='{label}']"):
        try:
            if element.is_displayed():
                element.click()
                time.sleep(0.5)
                return True
        except WebDriverException:
            continue
    return False


def choose_model_training(driver, url: str, wait_s: float) -> None:
    """MLflow 3's sidebar toggles between GenAI and Model training views (kept in the browser's storage);
    JetFlow's runs are model training."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{url}/#/experiments")
    try:
        WebDriverWait(driver, wait_s).until(lambda d: click_text(d, "Model training"))
        print("clicked 'Model training' in the sidebar")
    except TimeoutException:
        print("no 'Model training' toggle found (an MLflow UI without it)")


def pages(url: str, target: str) -> list[Page]:
    """The pages to open, found through the tracking API the UI itself serves."""
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=url, registry_uri=url)
    exp = c.get_experiment_by_name(f"jetflow/{target}")
    if exp is None:
        sys.exit(f"no experiment jetflow/{target} at {url}: run `make demo` (or jobs/train.py) first")
    eid = exp.experiment_id
    newest = lambda kind: next(iter(c.search_runs([eid], f"tags.`jetflow.kind` = '{kind}'", max_results=1,  # noqa: E731
                                                  order_by=["attributes.start_time DESC"])), None)
    train = newest("train")
    out = [Page("Experiments (Model training)", "/experiments", [exp.name], show=r"jetflow/")]
    if train is None:
        return out + [Page("Runs of the experiment", f"/experiments/{eid}", [exp.name])]
    datasets = [d.dataset.name for d in train.inputs.dataset_inputs] if train.inputs else []
    run = f"/experiments/{eid}/runs/{train.info.run_id}"
    out += [
        Page("Runs of the experiment", f"/experiments/{eid}", [train.info.run_name] + datasets[:1],
             show=r"^(train |budget sweep|arch sweep|eval |regen/|features/|Dataset)"),
        Page("Training run: Overview", run, [train.info.run_name, "Duration"] + datasets,
             show=r"(Duration|Status|Created|Source|Parent|Datasets|regen/|features/|Registered|train\.lr|"
                  r"jetflow\.registered)"),
        Page("Training run: Model metrics", f"{run}/model-metrics",
             ["train/loss", "train/lr", "train/draft_tokens_per_s", "eval/tree_tau"], show=r"^(train|eval)/"),
        Page("Training run: System metrics", f"{run}/system-metrics", ["cpu_utilization_percentage"],
             show=r"(cpu|memory|disk|network)"),
        Page("Training run: Artifacts", f"{run}/artifacts", ["config.json", "model.safetensors", "plots"],
             show=r"^(head|plots|\S+\.(json|png|safetensors))$", clicks=["head"]),
    ]
    for kind in ("budget_sweep", "arch_sweep"):
        parent = newest(kind)
        if parent is None:
            continue
        plots = [a.path.removeprefix("plots/") for a in c.list_artifacts(parent.info.run_id, "plots")]
        files = [a.path for a in c.list_artifacts(parent.info.run_id) if not a.is_dir]
        for i, plot in enumerate(plots):  # a user opens the folder, then each plot
            out.append(Page(f"{parent.info.run_name}: Artifacts, {plot}",
                            f"/experiments/{eid}/runs/{parent.info.run_id}/artifacts", plots + files,
                            show=r"\.(png|md|json)$", clicks=["plots", plot], image=True))
    versions = c.search_model_versions(f"run_id = '{train.info.run_id}'")
    if versions:
        mv = versions[0]
        out.append(Page(f"Registered model {mv.name} version {mv.version}", f"/models/{mv.name}/versions/{mv.version}",
                        ["Trained", train.info.run_name, "Evaluated"],
                        show=r"(Trained|Data|Evaluated|Source run|Aliases|jetflow\.(dataset|eval_run_ids|train_run_id))"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:5000", help="a running `mlflow ui` / `mlflow server`")
    p.add_argument("--target", default="smollm2-135m", help="target id: the experiment is jetflow/<target>")
    p.add_argument("--out", default=None, help="screenshot folder (default: a new temporary folder)")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for a page's content")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="mlflow-ui-check-"))
    out.mkdir(parents=True, exist_ok=True)
    url = args.url.rstrip("/")
    todo = pages(url, args.target)
    driver = browser()
    try:
        choose_model_training(driver, url, args.wait)
        results = {page.name: visit(driver, url, page, out, args.wait) for page in todo}
    finally:
        driver.quit()
    print("\nsummary:")
    for name, ok in results.items():
        print(f"  {'ok     ' if ok else 'MISSING'} {name}")
    print(f"screenshots: {out}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
