"""The playground page in real headless Chromium (selenium + chromedriver).

Sends a prompt, waits for the stream, checks that the tokens arrive as spans coloured by
how they were made and that α, τ, tokens/s and the speedup against plain appear.
Skips, saying why, where no Chromium or chromedriver can be had (CI installs them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from server_helpers import start_server, tiny_chat_folder

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1280,800",
)  # fmt: skip
KINDS = ("accepted", "recovered", "bonus", "target")


def browser_paths() -> tuple[str, str]:
    """Chromium and chromedriver, or skip with the reason."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip(
            "no headless browser here: install Debian's chromium and chromium-driver "
            "(.ci/run does) to run the playground test"
        )
    return browser, driver


@pytest.fixture
def browser(tmp_path: Path):
    binary, driver_path = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}")
    service = webdriver.ChromeService(executable_path=driver_path)
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()


def drive_playground(driver, url: str, prompt: str, max_tokens: int, screenshot: Path) -> dict:
    """Generate, then compare with plain; returns what the page shows."""
    driver.get(url + "/")
    wait = WebDriverWait(driver, 120)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#draft option"))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    tokens = driver.find_element(By.ID, "max_tokens")
    tokens.clear()
    tokens.send_keys(str(max_tokens))
    driver.find_element(By.ID, "send").click()
    wait.until(lambda d: d.find_element(By.ID, "compare").is_enabled())  # the stream ended
    assert driver.find_element(By.ID, "status").text.startswith("done")
    driver.find_element(By.ID, "compare").click()
    wait.until(lambda d: d.find_element(By.ID, "speedup").text.endswith("×"))
    spans = driver.find_elements(By.CSS_SELECTOR, "#output span.tok")
    shown = {
        "error": driver.find_element(By.ID, "error").text,
        "kinds": [s.get_attribute("class").split("tok-")[-1] for s in spans],
        "backgrounds": {
            s.get_attribute("class"): s.value_of_css_property("background-color") for s in spans
        },
        "text": driver.find_element(By.ID, "output").text,
        **{k: driver.find_element(By.ID, k).text for k in ("alpha", "tau", "tps", "speedup")},
    }
    driver.save_screenshot(str(screenshot))
    return shown


def check_page(shown: dict) -> None:
    assert shown["error"] == ""
    assert shown["text"].strip() and len(shown["kinds"]) >= 5
    assert set(shown["kinds"]) <= set(KINDS)
    assert "accepted" in shown["kinds"]  # drafted tokens the target kept, coloured as such
    for cls in ("tok tok-accepted", "tok tok-recovered", "tok tok-bonus"):
        if cls in shown["backgrounds"]:
            assert shown["backgrounds"][cls] not in ("rgba(0, 0, 0, 0)", "transparent")
    assert 0 <= float(shown["alpha"]) <= 1 and float(shown["tau"]) >= 1
    assert float(shown["tps"]) > 0 and float(shown["speedup"].rstrip("×")) > 0


def test_playground_streams_coloured_tokens(browser, tmp_path: Path) -> None:
    folder = tiny_chat_folder(tmp_path / "tiny")
    with start_server(folder) as server:
        shown = drive_playground(
            browser, server.url, "red blue red blue red blue red", 60, tmp_path / "page.png"
        )
    check_page(shown)
    assert (tmp_path / "page.png").stat().st_size > 10_000


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SPECULATIVE_PLAYGROUND_SCREENSHOT"),
    reason="makes the README screenshot: set SPECULATIVE_PLAYGROUND_SCREENSHOT=docs/playground.png",
)
def test_playground_on_the_default_model(browser, tmp_path: Path) -> None:
    """The default model, for the screenshot in docs/playground.png (the tiny-model test
    above checks the same page in the suite)."""
    from speculative.models.loading import resolve_model
    from speculative.server import ServerConfig, create_app, load_state
    from speculative.server.background import serve_in_background

    try:
        resolve_model("default")
    except Exception as exc:  # the model package is not installed
        pytest.skip(f"the default model is not available: {exc}")
    state = load_state(ServerConfig(drafts=("ngram", "none"), max_batch=4, gamma=4))
    target = Path(os.environ["SPECULATIVE_PLAYGROUND_SCREENSHOT"])
    prompt = (
        "Put a dash before each item of this list and write the whole list:\n"
        "apples are red\nbananas are yellow\ncherries are dark red\ndates are brown\n"
        "figs are purple\ngrapes are green\nlemons are yellow\nmangoes are orange"
    )
    with serve_in_background(create_app(state)) as server:
        shown = drive_playground(browser, server.url, prompt, 96, target)
    check_page(shown)


def test_playground_keeps_a_conversation(browser, tmp_path: Path) -> None:
    """With "keep the conversation", each prompt continues the chat: the second turn's
    prompt holds the first exchange, and the server found the first turn in its cache."""
    import re

    folder = tiny_chat_folder(tmp_path / "tiny")
    with start_server(folder) as server:
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 120)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#draft option"))
        browser.find_element(By.ID, "converse").click()
        turns = []
        for prompt in ("red blue red blue", "and then the cat"):
            box = browser.find_element(By.ID, "prompt")
            box.clear()
            box.send_keys(prompt)
            browser.find_element(By.ID, "send").click()
            wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done"))
            status = browser.find_element(By.ID, "status").text
            turns.append(re.search(r"turn (\d+): prompt (\d+) tokens, (\d+) cached", status))
            wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
        assert browser.find_element(By.ID, "error").text == ""
    first, second = (tuple(int(g) for g in match.groups()) for match in turns)
    assert first[0] == 1 and second[0] == 2
    assert second[1] > first[1] + 2  # the first exchange is in the second prompt
    assert second[2] >= first[1] - 1  # all of the first prompt but its generation prompt
