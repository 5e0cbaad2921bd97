"""A minimal pygame window: scaled frames, relative mouse, keys -> the 11 buttons, Esc quits,
F5 restarts the clip. Held keys are tracked from KEYDOWN/KEYUP events."""
from __future__ import annotations

import pygame

from .causvid_pipeline import CausvidPipeline

KEYS = {pygame.K_w: 0, pygame.K_a: 1, pygame.K_s: 2, pygame.K_d: 3, pygame.K_LSHIFT: 4, pygame.K_SPACE: 5,
        pygame.K_r: 6, pygame.K_f: 7, pygame.K_e: 8}
MOUSE_BUTTONS = {1: 9, 3: 10}  # left -> LMB, right -> RMB


class Controls:
    def __init__(self, sensitivity: float = 1.0):
        self.buttons = [0] * 11
        self.dx = self.dy = 0.0
        self.sensitivity = sensitivity

    def handle(self, event) -> None:
        if event.type in (pygame.KEYDOWN, pygame.KEYUP) and event.key in KEYS:
            self.buttons[KEYS[event.key]] = int(event.type == pygame.KEYDOWN)
        elif event.type in (pygame.MOUSEBUTTONDOWN, pygame.MOUSEBUTTONUP) and event.button in MOUSE_BUTTONS:
            self.buttons[MOUSE_BUTTONS[event.button]] = int(event.type == pygame.MOUSEBUTTONDOWN)
        elif event.type == pygame.MOUSEMOTION:
            self.dx += event.rel[0]
            self.dy += event.rel[1]

    def take(self):
        """Controls for the frame about to start; mouse motion is consumed."""
        mouse = [self.dx * self.sensitivity, self.dy * self.sensitivity]
        self.dx = self.dy = 0.0
        return mouse, list(self.buttons)


def play(pipe: CausvidPipeline, scale: int = 4, max_frames: int | None = None) -> int:
    pygame.init()
    try:
        first, _ = pipe([0.0, 0.0], [0] * 11)
        h, w = first.shape[:2]
        screen = pygame.display.set_mode((w * scale, h * scale))
    except pygame.error as exc:
        from .game_cv import no_display_message

        print(no_display_message() + f"\n  (SDL said: {exc})")
        pygame.quit()
        return 2
    pygame.display.set_caption(f"{pipe.world.name} - kv {pipe.settings.kv_cache} - Esc quits, F5 restarts")
    pygame.event.set_grab(True)
    pygame.mouse.set_visible(False)
    controls, frame, frames = Controls(), first, 1
    try:
        while max_frames is None or frames < max_frames:
            for event in pygame.event.get():
                if event.type == pygame.QUIT or (event.type == pygame.KEYDOWN and event.key == pygame.K_ESCAPE):
                    return 0
                if event.type == pygame.KEYDOWN and event.key == pygame.K_F5:
                    pipe.restart_from_buffer()
                controls.handle(event)
            surface = pygame.surfarray.make_surface(frame.numpy().swapaxes(0, 1))
            screen.blit(pygame.transform.scale(surface, screen.get_size()), (0, 0))
            pygame.display.flip()
            frame, _ = pipe(*controls.take())
            frames += 1
        return 0
    finally:
        pygame.quit()
