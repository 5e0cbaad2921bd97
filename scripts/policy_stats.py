"""How a data policy's turns go with walls (owl_wms.maze.data.turn_wall_statistics).

    python -m scripts.policy_stats [--policy explore lively] [--corridor 1] [--levels 16] [--frames 256]

For each policy: the share of frames with a hard turn (|mouse x| > 5), and for those and for
steady frames (|mouse x| < 2) the median distance to the nearest wall in the middle third of
the view and the share with a wall nearer than 1.6; the share of all frames that turn hard with
no wall that near; and the share of frames with the mouse exactly at rest, (0, 0). Levels are
the training seeds 0, 1, ...
"""
from __future__ import annotations

import argparse
import json

from owl_wms.maze.data import POLICY_STYLES, turn_wall_statistics


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", nargs="+", default=sorted(POLICY_STYLES), choices=sorted(POLICY_STYLES))
    p.add_argument("--corridor", type=int, nargs="+", default=[1],
                   help="corridor widths of the maze (owl_wms.maze.simulator.SimConfig.corridor), one line each")
    p.add_argument("--levels", type=int, default=16)
    p.add_argument("--frames", type=int, default=256)
    args = p.parse_args(argv)
    for corridor in args.corridor:
        for style in args.policy:
            print(json.dumps(turn_wall_statistics(style, args.levels, args.frames, corridor=corridor)))


if __name__ == "__main__":
    main()
