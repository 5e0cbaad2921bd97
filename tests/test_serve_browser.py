"""The page in real browsers. Debian's chromium, driven by chromedriver through Selenium: frames
are drawn on the canvas, a key press reaches the next frame's controls, two players at once get
the frames of two headless runs of their actions, and a third past capacity sees the server full
while the two play on. Debian's firefox-esr, driven through its own Marionette protocol
(marionette_driver, no geckodriver): the same page plays, and its frames are a headless run's."""
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from .servers import Server
from .test_serve import FP32, alone, assert_frames_alone

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
FIREFOX = shutil.which("firefox-esr") or shutil.which("firefox")
needs_chromium = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                                                      "(apt-get install chromium chromium-driver)")
needs_firefox = pytest.mark.skipif(not FIREFOX, reason="needs Debian's firefox-esr (apt-get install firefox-esr)")


def browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # headless, and nothing reaching for the network (this machine's is closed)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


READ_CANVAS = """const c = document.getElementById('view');
return [Number(c.dataset.frame || 0), Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)];"""


def shown(driver) -> tuple[int, np.ndarray]:
    """The frame index on the canvas and its pixels (uint8 RGB), read in one go."""
    index, data = driver.execute_script(READ_CANVAS)
    return index, np.array(data, dtype=np.uint8).reshape(64, 64, 4)[..., :3]


def wait(predicate, timeout: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@needs_chromium
def test_two_browsers_play_their_own_sessions_and_a_third_hears_the_server_is_full(tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    actions = tmp_path / "actions"
    with Server("--max-sessions", 2, "--save-actions", actions, env=FP32) as server:
        pages, samples = {}, {31: {}, 32: {}}
        try:
            for seed, extra in ((31, ""), (32, "&level=5")):
                pages[seed] = browser(tmp_path / f"profile{seed}")
                pages[seed].get(f"{server.url}/?seed={seed}&format=png{extra}")
            for seed, page in pages.items():
                wait(lambda: shown(page)[0] >= 3, what=f"frames on page {seed}")
                assert np.asarray(shown(page)[1]).std() > 1  # a picture, not a blank canvas
            # the keys: W held on one page, D then a W tap on the other
            for seed, keys in ((31, "w"), (32, "d")):
                ActionChains(pages[seed]).key_down(keys).perform()
            for _ in range(12):
                for seed, page in pages.items():
                    index, image = shown(page)
                    samples[seed][index] = image
                time.sleep(0.15)
            for seed, keys in ((31, "w"), (32, "d")):
                ActionChains(pages[seed]).key_up(keys).perform()
            overlay = pages[31].find_element("id", "overlay").text
            assert "FPS" in overlay and "KV layout=inplace" in overlay and "players 2/2" in overlay, overlay

            third = browser(tmp_path / "profile33")
            try:
                third.get(server.url + "/")
                notice = wait(lambda: third.find_element("id", "notice").text, what="the full message")
                assert notice == "server full, 2 playing"
            finally:
                third.quit()
            before = {seed: shown(page)[0] for seed, page in pages.items()}
            for seed, page in pages.items():
                wait(lambda: shown(page)[0] > before[seed] + 3, what=f"page {seed} to play on")
                for _ in range(4):
                    index, image = shown(page)
                    samples[seed][index] = image
                    time.sleep(0.1)
        finally:
            for page in pages.values():
                page.quit()
        wait(lambda: server.health()["sessions"] == 0, what="the sessions to close")

    logs = {json.loads(p.read_text())["seed"]: p for p in actions.glob("session-*.json")}
    held = {31: 0, 32: 3}  # W, D
    for seed, start in ((31, ("--clip", "0")), (32, ("--world-seed", "5"))):
        lines = [json.loads(line) for line in logs[seed].with_suffix(".jsonl").read_text().splitlines()]
        assert any(line["buttons"][held[seed]] == 1 for line in lines), "the key press never reached a frame"
        want = alone(tmp_path, seed, str(logs[seed].with_suffix(".jsonl")), len(lines), f"alone{seed}", start)
        assert len(samples[seed]) >= 8
        assert_frames_alone(samples[seed], want, seed)


def firefox(log: Path):
    """Headless firefox-esr under Marionette, on a free port (profile made and removed by mozprofile),
    its log in ``log``."""
    import socket

    from marionette_driver.marionette import Marionette

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    page = Marionette(bin=FIREFOX, headless=True, port=port, startup_timeout=90, gecko_log=str(log))
    page.start_session()
    return page


def key(page, name: str, down: bool):
    from marionette_driver.marionette import Actions

    keys = Actions(page).sequence("key", "keyboard")
    (keys.key_down if down else keys.key_up)(name)
    keys.perform()


@needs_firefox
def test_firefox_plays_the_page_and_its_frames_are_a_headless_runs(tmp_path):
    actions = tmp_path / "actions"
    samples = {}
    with Server("--save-actions", actions, env=FP32) as server:
        page = firefox(tmp_path / "gecko.log")
        try:
            page.navigate(f"{server.url}/?seed=34&format=png")
            wait(lambda: shown(page)[0] >= 3, what="frames in firefox")
            assert np.asarray(shown(page)[1]).std() > 1  # a picture, not a blank canvas
            key(page, "w", True)
            for _ in range(12):
                index, image = shown(page)
                samples[index] = image
                time.sleep(0.15)
            key(page, "w", False)
            overlay = page.find_element("id", "overlay").text
            assert "FPS" in overlay and "players 1/" in overlay, overlay
        finally:
            page.cleanup()
        wait(lambda: server.health()["sessions"] == 0, what="the session to close")

    log = next(actions.glob("session-*.json"))
    lines = [json.loads(line) for line in log.with_suffix(".jsonl").read_text().splitlines()]
    assert any(line["buttons"][0] == 1 for line in lines), "the W press never reached a frame"
    want = alone(tmp_path, 34, str(log.with_suffix(".jsonl")), len(lines), "alone34")
    assert len(samples) >= 8
    assert_frames_alone(samples, want, 34)
