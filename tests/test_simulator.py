"""The maze simulator: determinism and a visible effect for every control."""
import copy

import numpy as np
import pytest

from owl_wms.maze.data import ExplorerPolicy, rollout_episode
from owl_wms.maze.simulator import DOOR, EMPTY, SWITCH, MazeSim, SimConfig

NONE = [0] * 11


def press(*idx):
    b = [0] * 11
    for i in idx:
        b[i] = 1
    return b


W, A, S, D, SHIFT, SPACE, R, F, E, LMB, RMB = range(11)


def test_same_seed_same_frames_and_levels_differ():
    a = rollout_episode(5, 60)
    b = rollout_episode(5, 60)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = rollout_episode(6, 60)
    assert not np.array_equal(a[0], c[0])
    assert a[0].shape == (60, 64, 64, 3) and a[0].dtype == np.uint8


def test_configurable_resolution():
    sim = MazeSim(1, SimConfig(width=96, height=48))
    assert sim.render().shape == (48, 96, 3)


def column_shift(before, after, max_shift=12):
    """Horizontal shift (pixels) that best maps `before` onto `after`, from the top half."""
    a, b = before[:32].astype(float).mean(axis=(0, 2)), after[:32].astype(float).mean(axis=(0, 2))
    errs = {s: np.abs(np.roll(a, s)[max_shift:-max_shift] - b[max_shift:-max_shift]).mean()
            for s in range(-max_shift, max_shift + 1)}
    return min(errs, key=errs.get)


def test_turning_right_shifts_the_view_left():
    sim = MazeSim(2)
    before = sim.step([0, 0], NONE)
    after = sim.step([3, 0], NONE)
    assert column_shift(before, after) < 0 and sim.state.yaw != 0


def test_w_brings_the_wall_ahead_closer_and_s_backs_off():
    sim = MazeSim(2)
    sim.step([0, 0], NONE)
    d0 = sim.depth[32]
    f0 = sim.render()
    for _ in range(5):
        f1 = sim.step([0, 0], press(W))
    assert sim.depth[32] < d0 and not np.array_equal(f0, f1)
    for _ in range(5):
        sim.step([0, 0], press(S))
    assert abs(sim.depth[32] - d0) < 1e-6


def test_strafe_sprint_and_collisions():
    sim = MazeSim(3)
    x0, y0, yaw = sim.state.x, sim.state.y, sim.state.yaw
    sim.step([0, 0], press(D))
    right = np.array([-np.sin(yaw), np.cos(yaw)])
    moved = np.array([sim.state.x - x0, sim.state.y - y0])
    assert moved @ right > 0.05 or sim._solid(x0 + right[0] * 0.3, y0 + right[1] * 0.3)
    walk, sprint = MazeSim(4), MazeSim(4)
    for _ in range(3):
        walk.step([0, 0], press(W))
        sprint.step([0, 0], press(W, SHIFT))
    dist = lambda s: np.hypot(s.state.x - MazeSim(4).state.x, s.state.y - MazeSim(4).state.y)  # noqa: E731
    assert dist(sprint) > dist(walk) > 0
    for _ in range(200):  # walking into walls never enters them
        sprint.step([1.5, 0], press(W, SHIFT))
        assert sprint.grid[int(sprint.state.x), int(sprint.state.y)] == EMPTY


def test_mouse_y_tilts_the_horizon_and_space_jumps():
    sim = MazeSim(2)
    level = sim.step([0, 0], NONE)
    tilted = sim.step([0, 10], NONE)
    assert sim.state.tilt < 0 and not np.array_equal(level, tilted)
    sim = MazeSim(2)
    f0 = sim.step([0, 0], NONE)
    f1 = sim.step([0, 0], press(SPACE))
    f2 = sim.step([0, 0], press(SPACE))  # held: no double jump
    assert sim.state.z > 0 and not np.array_equal(f0, f2)
    for _ in range(40):
        sim.step([0, 0], NONE)
    assert sim.state.z == 0 and np.array_equal(sim.render(), f0)


def test_f_toggles_flashlight_brightness():
    sim = MazeSim(2)
    dark = sim.step([0, 0], NONE)
    lit = sim.step([0, 0], press(F))
    held = sim.step([0, 0], press(F))
    assert lit.mean() > dark.mean() + 5 and np.array_equal(lit, held)
    sim.step([0, 0], NONE)
    assert np.array_equal(sim.step([0, 0], press(F)), dark)


def test_rmb_narrows_the_view():
    sim = MazeSim(2)
    wide = sim.step([0, 0], NONE)
    zoom = sim.step([0, 0], press(RMB))
    assert sim.fov < np.radians(sim.cfg.fov_deg) and not np.array_equal(wide, zoom)
    assert np.array_equal(sim.step([0, 0], NONE), wide)


def test_lmb_fires_with_flash_and_recoil_and_r_reloads():
    sim = MazeSim(2)
    idle = sim.step([0, 0], NONE)
    fire = sim.step([0, 0], press(LMB))
    yellow = lambda f: ((f[..., 0] > 230) & (f[..., 1] > 200) & (f[..., 2] < 150)).sum()  # noqa: E731
    assert yellow(fire) > 10 and yellow(idle) == 0 and sim.state.recoil > 0
    sim = MazeSim(2)
    idle = sim.step([0, 0], NONE)
    weapon = lambda f: (np.abs(f[40:].astype(int) - [56, 56, 64]).sum(-1) < 20).sum()  # noqa: E731
    for _ in range(9):
        mid = sim.step([0, 0], press(R))
    assert weapon(mid) < weapon(idle)


def face(sim, kind):
    """Stand in front of the first cell of ``kind`` with a free cell beside it."""
    for i, j in np.argwhere(sim.grid == kind):
        for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            if sim.grid[i + di, j + dj] == EMPTY:
                sim.state.x, sim.state.y = i + di + 0.5, j + dj + 0.5
                sim.state.yaw = float(np.arctan2(-dj, -di))
                return i, j
    pytest.skip(f"level has no reachable cell of kind {kind}")


def test_e_opens_doors_and_flips_switches():
    for seed in range(20):
        sim = MazeSim(seed)
        if (sim.grid == DOOR).any() and (sim.grid == SWITCH).any():
            break
    door = face(sim, DOOR)
    before = sim.render()
    after = sim.step([0, 0], press(E))
    assert sim.grid[door] == EMPTY and not np.array_equal(before, after)
    sim.step([0, 0], NONE)  # release E: interaction is on the press, not while held
    face(sim, SWITCH)
    twin = copy.deepcopy(sim)
    palette = sim.state.palette
    sim.step([0, 0], press(E))
    twin.step([0, 0], NONE)
    assert sim.state.palette != palette and twin.state.palette == palette
    turn = (np.pi / 2) / sim.cfg.turn_per_px  # look along the corridor: other walls are recoloured
    assert not np.array_equal(sim.step([turn, 0], NONE), twin.step([turn, 0], NONE))


def test_policy_uses_every_button():
    _, mouse, buttons = rollout_episode(9, 600)
    assert (buttons.sum(0) > 0).all() and np.abs(mouse[:, 0]).mean() > 1


def test_lively_policy_turns_faster_and_less_predictably():
    def lag1(x):
        return np.corrcoef(x[:-1], x[1:])[0, 1]

    explore, lively = (rollout_episode(9, 600, style=style)[1][:, 0] for style in ("explore", "lively"))
    assert np.diff(lively).std() > 2 * np.diff(explore).std()  # larger frame-to-frame changes of the turn rate
    assert lag1(lively) < lag1(explore) - 0.1  # that the turn so far predicts less
    with pytest.raises(ValueError, match="unknown policy style 'calm'.*explore"):
        rollout_episode(9, 2, style="calm")


def test_still_policy_lets_go_of_the_mouse_and_the_others_stay_as_they_were():
    """explore never sends a mouse at rest, exactly (0, 0), which every built-in walk script and a
    resting player send; "still" does in about a quarter of its frames, in stretches, and takes the
    mouse back to turn away from a close wall. explore and lively draw the same episodes as before
    the style existed (digests of HEAD's episodes then)."""
    import hashlib

    wide = SimConfig(corridor=2)
    for style, digest in (("explore", "c8651a8a6254781a"), ("lively", "c483fde85ce13cef")):
        f, m, b = rollout_episode(5, 120, style=style, config=wide)
        assert hashlib.sha256(m.tobytes() + b.tobytes() + f.tobytes()).hexdigest()[:16] == digest
    at_rest = {style: np.concatenate([(rollout_episode(s, 256, style=style, config=wide)[1] == 0).all(1)
                                      for s in range(4)]) for style in ("explore", "still")}
    assert not at_rest["explore"].any()
    assert 0.15 < at_rest["still"].mean() < 0.35
    from owl_wms.maze.data import turn_wall_statistics

    assert turn_wall_statistics("still", levels=1, frames=256, corridor=2)["at_rest_share"] == at_rest["still"][:256].mean()
    starts = np.flatnonzero(np.diff(at_rest["still"].astype(int)) == 1)
    assert at_rest["still"].sum() / len(starts) > 4  # stretches, not single frames
    sim, frames = MazeSim(3, wide), []
    policy = ExplorerPolicy(1, "still")
    for _ in range(400):
        mouse, buttons = policy.act(sim)
        if mouse == [0.0, 0.0]:  # at rest only while no wall is close ahead
            frames.append(policy.turn == 0.0)
        sim.step(mouse, buttons)
    assert frames and all(frames)


def test_sweep_and_roam_policies_turn_in_the_open_and_still_stays_as_it_was():
    """still turns hard only at a close wall; sweep also holds turns in the open (as walk_turn
    does), in stretches of one sign, and keeps still's mouse at rest; roam turns away from walls
    early, so its steady frames seldom face a near one. still draws the episodes it drew before
    sweep and roam existed (digest of HEAD's episode then)."""
    import hashlib

    from owl_wms.maze.data import turn_wall_statistics

    wide = SimConfig(corridor=2)
    f, m, b = rollout_episode(5, 120, style="still", config=wide)
    assert hashlib.sha256(m.tobytes() + b.tobytes() + f.tobytes()).hexdigest()[:16] == "1be499e0865bba72"
    still, sweep, roam = (turn_wall_statistics(style, levels=2, frames=256, corridor=2)
                          for style in ("still", "sweep", "roam"))
    assert still["turning_open_share"] < 0.01
    assert sweep["turning_open_share"] > 0.05 and roam["turning_open_share"] > 0.05
    assert roam["steady_near_share"] < 0.05 < still["steady_near_share"]
    assert roam["steady_median_wall"] > still["steady_median_wall"] + 0.5
    assert sweep["at_rest_share"] > 0.02  # 11.4% over 16 levels
    policy, sim, held = ExplorerPolicy(2, "sweep"), MazeSim(2, wide), []
    for _ in range(256):
        mouse, buttons = policy.act(sim)
        held.append(policy.sweep)
        sim.step(mouse, buttons)
    held = np.array(held)
    assert (np.abs(held[held != 0]) >= 3).all() and (np.abs(held) <= 9).all()
    changes = np.flatnonzero(np.diff(held) != 0)
    assert len(changes) >= 2 and (held != 0).sum() / max(1, (np.diff((held != 0).astype(int)) == 1).sum()) > 5


def test_turn_wall_statistics_see_explores_turns_at_walls(capsys):
    """The exploring policy turns hard when a wall is close ahead: its hard-turn frames face a
    near wall far more often than its steady ones (the statistic a world model picks up)."""
    from owl_wms.maze.data import turn_wall_statistics
    from scripts import policy_stats

    st = turn_wall_statistics("explore", levels=4, frames=128)
    assert 0 < st["turning_share"] < 1
    assert st["turning_near_share"] > st["steady_near_share"] + 0.25
    assert st["turning_median_wall"] < 0.6 * st["steady_median_wall"]
    assert st["at_rest_share"] == 0.0  # explore never leaves the mouse at rest (the "still" style does)
    policy_stats.main(["--policy", "explore", "--levels", "1", "--frames", "32"])
    assert '"style": "explore"' in capsys.readouterr().out


def reachable(grid, start) -> np.ndarray:
    """Floor cells a walker reaches from ``start`` (4-neighbours, doors open)."""
    free, seen, todo = (grid == EMPTY) | (grid == DOOR), np.zeros(grid.shape, dtype=bool), [tuple(start)]
    while todo:
        i, j = todo.pop()
        if free[i, j] and not seen[i, j]:
            seen[i, j] = True
            todo += [(i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)]
    return seen


def test_one_unit_corridors_are_the_maze_the_shipped_world_learned():
    """corridor=1 draws the same levels as before the option existed (sha256 of the grids then)."""
    import hashlib

    from owl_wms.maze.simulator import generate_maze

    pinned = {0: "cbf9d4b48df07ba0", 1: "ca9f44978dab4c5d", 7: "9129d3061b5ee7bf", 123: "44d4749d78fde0e7"}
    for seed, digest in pinned.items():
        grid, _ = generate_maze(seed, 7, SimConfig.door_prob, SimConfig.switch_prob)
        assert hashlib.sha256(np.ascontiguousarray(grid, dtype=np.int64).tobytes()).hexdigest()[:16] == digest


@pytest.mark.parametrize("corridor", [2, 3])
def test_wide_corridors_are_a_connected_maze_of_wide_passages(corridor):
    from owl_wms.maze.simulator import generate_maze

    for seed in range(4):
        grid, _ = generate_maze(seed, 5, 0.12, 0.08, corridor=corridor)
        assert grid.shape == ((corridor + 1) * 5 + 1,) * 2
        open_ = (grid == EMPTY) | (grid == DOOR)
        assert (reachable(grid, np.argwhere(open_)[0]) == open_).all()  # every floor cell and door can be walked to
        # every floor cell lies in a corridor x corridor block of floor: no passage narrower than a cell
        n = grid.shape[0] - corridor + 1
        blocks = np.array([[open_[i:i + corridor, j:j + corridor].all() for j in range(n)] for i in range(n)])
        covered = np.zeros_like(open_)
        for i, j in np.argwhere(blocks):
            covered[i:i + corridor, j:j + corridor] = True
        assert (covered == open_).all()
    with pytest.raises(ValueError, match="SimConfig.corridor must be a whole number >= 1, got 0"):
        SimConfig(corridor=0)


def test_e_opens_a_wide_door_whole():
    cfg = SimConfig(corridor=2)
    sim = next(s for s in (MazeSim(seed, cfg) for seed in range(50)) if (s.grid == DOOR).any())
    door = face(sim, DOOR)
    doors = (sim.grid == DOOR).sum()
    sim.step([0, 0], press(E))
    assert sim.grid[door] == EMPTY and (sim.grid == DOOR).sum() == doors - 2  # both cells of the passage


def test_wide_corridors_show_walls_further_away():
    """What wider corridors change for a world model: more of the view is deep, at every turn."""
    from owl_wms.maze.data import turn_wall_statistics

    narrow, wide = (turn_wall_statistics("explore", levels=2, frames=96, corridor=c) for c in (1, 2))
    assert wide["corridor"] == 2
    assert wide["steady_median_wall"] > 1.15 * narrow["steady_median_wall"]
    assert wide["steady_near_share"] < narrow["steady_near_share"]


def test_the_flat_look_draws_the_same_levels_with_far_less_fine_texture():
    from owl_wms.maze.evaluation import sharpness

    ratios = []
    for seed in range(4):
        brick = MazeSim(seed, SimConfig(corridor=2))
        flat = MazeSim(seed, SimConfig(corridor=2, look="flat"))
        assert np.array_equal(brick.grid, flat.grid) and brick.state == flat.state  # the level and the start
        for mouse, buttons in [([0, 0], NONE)] + [([0, 0], press(W))] * 6 + [([4, 0], press(W))] * 6:
            a, b = brick.step(mouse, buttons), flat.step(mouse, buttons)
            assert brick.state == flat.state  # the same play: only the drawing differs
            ratios.append(sharpness(b) / sharpness(a))
    assert np.median(ratios) < 0.6  # the mortar and the half-unit checker were most of the fine detail
    # walking and turning visibly change the flat view too
    sim = MazeSim(2, SimConfig(look="flat"))
    before = sim.step([0, 0], NONE)
    assert column_shift(before, sim.step([3, 0], NONE)) < 0
    walked = [sim.step([0, 0], press(W)) for _ in range(5)][-1]
    assert np.abs(walked.astype(int) - before.astype(int)).mean() > 3
    with pytest.raises(ValueError, match="look must be one of brick, flat, got 'tiles'"):
        SimConfig(look="tiles")
