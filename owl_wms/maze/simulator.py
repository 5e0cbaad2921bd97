"""A first-person maze world (numpy raycaster, no assets): ground truth for our world model.

Controls are the model's: mouse (dx, dy) and 11 buttons [W, A, S, D, LSHIFT, SPACE, R, F,
E, LMB, RMB]. Every control has a visible effect:
  mouse x turns (yaw), mouse y tilts (horizon shift), W/S forward/back, A/D strafe,
  LSHIFT sprints, SPACE jumps (camera rises), R plays a reload animation (weapon lowers),
  F toggles a flashlight (press), E opens the door or flips the switch ahead (press; a
  switch recolours the walls), LMB fires (muzzle flash, recoil), RMB zooms (narrower FOV).
Same seed and actions, same frames: everything is float64 numpy with no hidden state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..controls import N_BUTTONS

W_, A_, S_, D_, SHIFT, SPACE, R_, F_, E_, LMB, RMB = range(N_BUTTONS)  # owl_wms/controls.py's order

EMPTY, WALL, DOOR, SWITCH = 0, 1, 2, 3
# Wall palettes (per wall kind 1..4); a switch cycles the palette index.
PALETTES = np.array([
    [[0.72, 0.32, 0.24], [0.30, 0.48, 0.72], [0.36, 0.62, 0.30], [0.70, 0.62, 0.28]],
    [[0.30, 0.62, 0.66], [0.70, 0.36, 0.62], [0.78, 0.52, 0.22], [0.44, 0.40, 0.76]],
    [[0.60, 0.60, 0.62], [0.78, 0.30, 0.30], [0.28, 0.56, 0.42], [0.86, 0.80, 0.40]],
])
DOOR_COLOR = np.array([0.45, 0.28, 0.12])
SWITCH_COLOR = np.array([0.95, 0.85, 0.10])
# How walls and floor are drawn: "brick" (mortar lines, a half-unit floor checker: the first worlds)
# or "flat" (plain shaded walls with a seam where wall units meet, a one-unit floor checker): the
# same levels with far less fine texture, which a small autoencoder and world model can keep.
LOOKS = ("brick", "flat")


@dataclass(frozen=True)
class SimConfig:
    width: int = 64
    height: int = 64
    maze_cells: int = 7  # maze of cells x cells rooms -> grid of (corridor+1)*cells+1
    corridor: int = 1  # floor width of a maze cell (and of the passage between two) in grid units
    fov_deg: float = 70.0
    zoom_fov_deg: float = 38.0
    walk_speed: float = 0.07  # grid units per frame
    sprint_mult: float = 1.8
    turn_per_px: float = 0.012  # radians per mouse unit
    tilt_per_px: float = 0.02  # fraction of height per mouse unit
    door_prob: float = 0.12
    switch_prob: float = 0.08
    supersample: int = 2  # render at this multiple and box-filter down: no aliased mortar/checker speckle
    look: str = "brick"  # one of LOOKS

    def __post_init__(self):
        if self.look not in LOOKS:
            raise ValueError(f"SimConfig.look must be one of {', '.join(LOOKS)}, got {self.look!r}")
        for name in ("width", "height", "maze_cells", "corridor", "supersample"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SimConfig.{name} must be a whole number >= 1, got {value!r}")


@dataclass
class SimState:
    x: float
    y: float
    yaw: float
    tilt: float = 0.0  # horizon shift, fraction of frame height
    z: float = 0.0  # jump height
    vz: float = 0.0
    flashlight: bool = False
    palette: int = 0
    reload: int = 0  # frames left of the reload animation
    fire: int = 0  # frames left of muzzle flash
    recoil: float = 0.0
    bob: float = 0.0
    prev_buttons: tuple = (0,) * N_BUTTONS
    frame: int = 0


def generate_maze(seed: int, cells: int, door_prob: float, switch_prob: float, corridor: int = 1):
    """Recursive-backtracker maze; wall cells carry a kind (1..4 colour), doors and switches.

    Each maze cell is a ``corridor`` x ``corridor`` block of floor and walls are one unit thick,
    so a passage between two cells is a wall segment of ``corridor`` units, opened (or made a
    door) as a whole. ``corridor`` = 1 is the one-cell maze the first worlds were trained on,
    drawn with the same random numbers."""
    if corridor < 1:
        raise ValueError(f"corridor must be >= 1 grid unit, got {corridor}")
    rng = np.random.default_rng(seed)
    pitch = corridor + 1
    n = pitch * cells + 1
    grid = np.full((n, n), WALL, dtype=np.int64)
    kinds = rng.integers(0, 4, size=(n, n))

    def block(cx, cy):
        return slice(pitch * cx + 1, pitch * cx + 1 + corridor), slice(pitch * cy + 1, pitch * cy + 1 + corridor)

    def between(a, b):  # the wall segment between adjacent cells a and b
        (ax, ay), (bx, by) = sorted((a, b))
        if bx > ax:
            return slice(pitch * bx, pitch * bx + 1), block(ax, ay)[1]
        return block(ax, ay)[0], slice(pitch * by, pitch * by + 1)

    seen = np.zeros((cells, cells), dtype=bool)
    stack = [(0, 0)]
    seen[0, 0] = True
    grid[block(0, 0)] = EMPTY
    while stack:
        cx, cy = stack[-1]
        nbrs = [(cx + dx, cy + dy) for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1))
                if 0 <= cx + dx < cells and 0 <= cy + dy < cells and not seen[cx + dx, cy + dy]]
        if not nbrs:
            stack.pop()
            continue
        nx, ny = nbrs[rng.integers(len(nbrs))]
        seen[nx, ny] = True
        grid[block(nx, ny)] = EMPTY
        grid[between((cx, cy), (nx, ny))] = DOOR if rng.random() < door_prob else EMPTY
        stack.append((nx, ny))
    # Loops make the maze less tunnel-like: knock out some of the closed segments (in the order
    # of their first grid cell, row by row).
    segments = [between((cx, cy), (cx + dx, cy + dy)) for cx in range(cells) for cy in range(cells)
                for dx, dy in ((1, 0), (0, 1)) if cx + dx < cells and cy + dy < cells]
    closed = sorted((s for s in segments if (grid[s] == WALL).all()), key=lambda s: (s[0].start, s[1].start))
    for idx in rng.permutation(len(closed))[: len(closed) // 6]:
        grid[closed[idx]] = EMPTY
    walls = np.argwhere(grid == WALL)
    for i, j in walls[rng.random(len(walls)) < switch_prob]:
        if 0 < i < n - 1 and 0 < j < n - 1:
            grid[i, j] = SWITCH
    return grid, kinds


class MazeSim:
    def __init__(self, seed: int, config: SimConfig | None = None):
        self.seed = seed
        self.cfg = config or SimConfig()
        self.grid, self.kinds = generate_maze(seed, self.cfg.maze_cells, self.cfg.door_prob, self.cfg.switch_prob,
                                             self.cfg.corridor)
        rng = np.random.default_rng(seed + 7919)
        free = np.argwhere(self.grid == EMPTY)
        i, j = free[rng.integers(len(free))]
        # Face the longest open corridor so the first frames show depth, not a wall.
        runs = []
        for di, dj in ((1, 0), (0, 1), (-1, 0), (0, -1)):
            k = 1
            while self.grid[i + k * di, j + k * dj] == EMPTY:
                k += 1
            runs.append(k)
        yaw = int(np.argmax(runs)) * np.pi / 2 + float(rng.uniform(-0.3, 0.3))
        self.state = SimState(x=i + 0.5, y=j + 0.5, yaw=float((yaw + np.pi) % (2 * np.pi) - np.pi))
        self.depth = None  # per-column wall distance of the last render
        ss = self.cfg.supersample
        h, w = self.cfg.height * ss, self.cfg.width * ss
        self._rows = np.arange(h)[:, None] + 0.5
        self._cols = (np.arange(w) + 0.5) / w * 2 - 1  # -1..1 across the screen

    # -- dynamics ----------------------------------------------------------------------------
    def _solid(self, x: float, y: float) -> bool:
        i, j = int(np.floor(x)), int(np.floor(y))
        if not (0 <= i < self.grid.shape[0] and 0 <= j < self.grid.shape[1]):
            return True
        return self.grid[i, j] != EMPTY

    def _move(self, dx: float, dy: float, radius: float = 0.2):
        s = self.state
        if not self._solid(s.x + dx + np.sign(dx) * radius, s.y):
            s.x += dx
        if not self._solid(s.x, s.y + dy + np.sign(dy) * radius):
            s.y += dy

    def _ahead(self, reach: float = 1.4):
        s = self.state
        for d in np.linspace(0.3, reach, 24):
            i, j = int(np.floor(s.x + np.cos(s.yaw) * d)), int(np.floor(s.y + np.sin(s.yaw) * d))
            if self.grid[i, j] != EMPTY:
                return i, j
        return None

    def step(self, mouse, buttons) -> np.ndarray:
        s, c = self.state, self.cfg
        b = tuple(int(v != 0) for v in buttons)
        if len(b) != N_BUTTONS or len(mouse) != 2:
            raise ValueError(f"controls must be mouse[2] and buttons[11], got {len(mouse)} and {len(b)}")
        pressed = [b[k] and not s.prev_buttons[k] for k in range(N_BUTTONS)]
        s.yaw = float((s.yaw + float(mouse[0]) * c.turn_per_px + np.pi) % (2 * np.pi) - np.pi)
        s.tilt = float(np.clip(s.tilt - float(mouse[1]) * c.tilt_per_px, -0.35, 0.35))
        speed = c.walk_speed * (c.sprint_mult if b[SHIFT] else 1.0)
        fwd, side = b[W_] - b[S_], b[D_] - b[A_]
        if fwd or side:
            norm = np.hypot(fwd, side)
            cy, sy = np.cos(s.yaw), np.sin(s.yaw)
            # screen right is (-sin, cos) in grid coordinates (x rows, y columns)
            dx = (fwd * cy - side * sy) / norm * speed
            dy = (fwd * sy + side * cy) / norm * speed
            self._move(dx, dy)
            s.bob += speed * 9
        if pressed[SPACE] and s.z == 0.0:
            s.vz = 0.09
        s.z = max(0.0, s.z + s.vz)
        s.vz = 0.0 if s.z == 0.0 else s.vz - 0.012
        if pressed[R_] and s.reload == 0:
            s.reload = 18
        s.reload = max(0, s.reload - 1)
        if pressed[F_]:
            s.flashlight = not s.flashlight
        if pressed[E_]:
            hit = self._ahead()
            if hit is not None and self.grid[hit] == DOOR:
                self._open_door(hit)
            elif hit is not None and self.grid[hit] == SWITCH:
                s.palette = (s.palette + 1) % len(PALETTES)
        if b[LMB] and s.fire == 0 and s.reload == 0:
            s.fire, s.recoil = 4, 1.0
        s.fire = max(0, s.fire - 1)
        s.recoil *= 0.6
        s.prev_buttons = b
        s.frame += 1
        return self.render()

    def _open_door(self, cell):
        """Open the whole door: the run of door cells through ``cell`` (a passage is ``corridor``
        cells wide; pillars keep two doors apart)."""
        todo = [tuple(cell)]
        while todo:
            i, j = todo.pop()
            if self.grid[i, j] == DOOR:
                self.grid[i, j] = EMPTY
                todo += [(i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)]

    # -- rendering -----------------------------------------------------------------------------
    def _cast(self, fov: float):
        """DDA over all columns at once: perpendicular distance, hit cell, side, texture u."""
        s = self.state
        half = np.tan(fov / 2)
        ang = s.yaw + np.arctan(self._cols * half)
        rx, ry = np.cos(ang), np.sin(ang)
        rx = np.where(np.abs(rx) < 1e-9, 1e-9, rx)
        ry = np.where(np.abs(ry) < 1e-9, 1e-9, ry)
        mx, my = np.full(rx.shape, int(np.floor(s.x))), np.full(rx.shape, int(np.floor(s.y)))
        ddx, ddy = np.abs(1 / rx), np.abs(1 / ry)
        stx, sty = np.sign(rx).astype(int), np.sign(ry).astype(int)
        sdx = np.where(rx < 0, (s.x - mx) * ddx, (mx + 1 - s.x) * ddx)
        sdy = np.where(ry < 0, (s.y - my) * ddy, (my + 1 - s.y) * ddy)
        hit = np.zeros(rx.shape, dtype=bool)
        side = np.zeros(rx.shape, dtype=int)
        n = self.grid.shape[0]
        for _ in range(4 * n):
            stepx = (sdx < sdy) & ~hit
            stepy = ~stepx & ~hit
            sdx = np.where(stepx, sdx + ddx, sdx)
            mx = np.where(stepx, mx + stx, mx)
            sdy = np.where(stepy, sdy + ddy, sdy)
            my = np.where(stepy, my + sty, my)
            side = np.where(stepx, 0, np.where(stepy, 1, side))
            mx, my = np.clip(mx, 0, n - 1), np.clip(my, 0, n - 1)
            hit |= self.grid[mx, my] != EMPTY
            if hit.all():
                break
        dist = np.where(side == 0, sdx - ddx, sdy - ddy)
        dist = np.maximum(dist * np.cos(ang - s.yaw), 1e-3)  # perpendicular: no fisheye
        along = np.where(side == 0, s.y + dist / np.cos(ang - s.yaw) * ry, s.x + dist / np.cos(ang - s.yaw) * rx)
        return dist, mx, my, side, along - np.floor(along), ang

    def render(self) -> np.ndarray:
        s, c = self.state, self.cfg
        ss = c.supersample
        h, w = c.height * ss, c.width * ss
        fov = np.radians(c.zoom_fov_deg if s.prev_buttons[RMB] else c.fov_deg)
        dist, mx, my, side, u, ang = self._cast(fov)
        self.depth, self.fov = dist.reshape(c.width, ss).mean(1), fov
        focal = (w / 2) / np.tan(fov / 2)
        horizon = h / 2 + s.tilt * h + s.recoil * 0.04 * h
        eye = 0.5 + s.z  # eye height in wall units
        rows = self._rows
        top = horizon - (1 - eye) * focal / dist
        bottom = horizon + eye * focal / dist
        wall = (rows >= top) & (rows < bottom)
        v = (rows - top) / np.maximum(bottom - top, 1e-6)

        cell = self.grid[mx, my]
        base = PALETTES[s.palette][self.kinds[mx, my]]
        base = np.where((cell == DOOR)[:, None], DOOR_COLOR, base)
        base = np.where((cell == SWITCH)[:, None], SWITCH_COLOR, base)
        door_panel = (cell == DOOR) & ((np.abs(u - 0.5) < 0.3) & (np.abs(v - 0.5) < 0.35))
        if c.look == "brick":  # mortar lines every 1/4 height, staggered vertical joints
            course = np.floor(v * 4)
            mortar = (np.abs(v * 4 - np.round(v * 4)) < 0.08) | (np.abs(((u * 2 + course * 0.5) % 1) - 0.5) > 0.46)
            tex = np.where(mortar, 0.55, 1.0)
        else:  # a seam where one wall unit meets the next, so a wall of one colour still slides when turning
            tex = np.where(np.minimum(u, 1 - u) < 0.04, 0.8, 1.0)
        tex = tex * np.where(door_panel, 0.7, 1.0)
        shade = np.where(side == 1, 0.78, 1.0) / (1 + 0.16 * dist)

        # Floor and ceiling: project each pixel to the ground/ceiling plane (checkerboard floor).
        below = rows >= horizon
        rel = np.where(below, rows - horizon, horizon - rows) + 1e-6
        plane_d = np.where(below, eye, 1 - eye) * focal / rel / np.cos(ang - s.yaw)
        gx, gy = s.x + np.cos(ang) * plane_d, s.y + np.sin(ang) * plane_d
        tiles = 2 if c.look == "brick" else 1  # floor tiles per grid unit
        checker = ((np.floor(gx * tiles) + np.floor(gy * tiles)) % 2)
        floor = np.stack([0.34 + 0.1 * checker, 0.30 + 0.08 * checker, 0.26 + 0.05 * checker], -1)
        ceil = np.stack([0.18 + 0 * gx, 0.20 + 0 * gx, 0.28 + 0 * gx], -1)
        plane_shade = 1 / (1 + 0.16 * plane_d * np.cos(ang - s.yaw))
        img = np.where(below[..., None], floor, ceil) * plane_shade[..., None]
        img = np.where(wall[..., None], (base[None] * tex[..., None]) * shade[None, :, None], img)

        # Lighting: dim ambient; the flashlight brightens a cone around the crosshair.
        yy, xx = np.mgrid[0:h, 0:w]
        r2 = ((xx - w / 2) / (w * 0.35)) ** 2 + ((yy - horizon) / (h * 0.35)) ** 2
        light = 0.75 + (0.9 * np.exp(-r2) + 0.25 if s.flashlight else np.zeros_like(r2))
        img = img * light[..., None]
        self._draw_weapon(img)
        img = img.reshape(c.height, ss, c.width, ss, 3).mean((1, 3))
        return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)

    def _draw_weapon(self, img: np.ndarray):
        s = self.state
        h, w = img.shape[:2]
        bob_x = np.sin(s.bob) * w * 0.03
        bob_y = abs(np.cos(s.bob)) * h * 0.03
        lower = (np.sin(np.pi * s.reload / 18) * h * 0.35) if s.reload else 0.0
        kick = s.recoil * h * 0.06
        cx = w * 0.62 + bob_x
        y0 = h * 0.74 + bob_y + lower + kick
        yy, xx = np.mgrid[0:h, 0:w]
        barrel = (np.abs(xx - cx) < w * 0.045) & (yy >= y0) & (yy < y0 + h * 0.3)
        body = (np.abs(xx - cx - w * 0.03) < w * 0.09) & (yy >= y0 + h * 0.1)
        img[barrel | body] = np.array([0.22, 0.22, 0.25])
        img[barrel & (yy < y0 + h * 0.04)] = np.array([0.5, 0.5, 0.55])
        if s.fire:
            flash = ((xx - cx) ** 2 + (yy - y0 + h * 0.03) ** 2) < (w * 0.09) ** 2
            img[flash] = np.array([1.0, 0.9, 0.45])

    def snapshot(self) -> dict:
        return {"state": dataclasses.replace(self.state), "grid": self.grid.copy()}
