"""The apps' command-line parser: a refused option is one line (the flag, the value and the fix),
not argparse's usage block above it (``--help`` shows that)."""
from __future__ import annotations

import argparse
import re

# argparse's words for a value of the wrong type, and what to give instead
_WANTED = {"int": "a whole number", "float": "a number"}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        wrong_type = re.fullmatch(r"argument (\S+): invalid (int|float) value: (.*)", message)
        if wrong_type:
            flag, kind, value = wrong_type.groups()
            message = f"{flag} {value}: must be {_WANTED[kind]}"
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")
