"""The pygame window with SDL's dummy video driver and posted events."""
import os
import subprocess
import sys

import pytest

from .conftest import REPO

pygame = pytest.importorskip("pygame")


@pytest.fixture
def dummy_video(monkeypatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    monkeypatch.setenv("SDL_AUDIODRIVER", "dummy")


class SpyPipeline:
    """Wraps the real pipeline; posts events from inside frame calls, records controls."""

    def __init__(self, pipe, script):
        self.pipe, self.script, self.calls = pipe, script, []
        self.world, self.settings = pipe.world, pipe.settings

    def restart_from_buffer(self):
        self.calls.append("restart")
        self.pipe.restart_from_buffer()

    def __call__(self, mouse, buttons):
        self.calls.append((list(mouse), list(buttons)))
        for event in self.script.get(len([c for c in self.calls if c != "restart"]), []):
            pygame.event.post(event)
        return self.pipe(mouse, buttons)


def test_keys_mouse_and_quit_drive_the_pipeline(dummy_video):
    from inference.causvid_pipeline import CausvidPipeline
    from inference.play import play

    E = pygame.event.Event
    script = {
        1: [E(pygame.KEYDOWN, key=pygame.K_w), E(pygame.MOUSEBUTTONDOWN, button=3, pos=(0, 0)),
            E(pygame.MOUSEMOTION, rel=(5, -2), pos=(0, 0), buttons=(0, 0, 0))],
        2: [E(pygame.KEYUP, key=pygame.K_w), E(pygame.KEYDOWN, key=pygame.K_LSHIFT), E(pygame.KEYDOWN, key=pygame.K_F5)],
        3: [E(pygame.QUIT)],
    }
    spy = SpyPipeline(CausvidPipeline.from_checkpoint(verbose=False), script)
    assert play(spy, scale=2) == 0
    frames = [c for c in spy.calls if c != "restart"]
    assert frames[1] == ([5.0, -2.0], [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])  # W + RMB, mouse (dx, dy)
    assert "restart" in spy.calls  # F5 restarts the clip
    assert frames[2] == ([0.0, 0.0], [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1])  # W released, LSHIFT held
    assert len(frames) == 3  # QUIT ends the loop before another frame


def test_no_display_gives_a_clear_message_not_a_traceback():
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER")}
    r = subprocess.run([sys.executable, "-m", "inference.game_cv"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "--headless" in r.stderr and "SDL_VIDEODRIVER" in r.stderr and "Traceback" not in r.stderr
