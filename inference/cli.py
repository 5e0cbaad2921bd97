"""The apps' command-line parser: a refused option is one line (the flag, the value and the fix),
not argparse's usage block above it (``--help`` shows that)."""
from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")
