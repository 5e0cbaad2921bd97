"""The README's commands are the ones CI runs."""
import re

from .conftest import REPO


def fenced_commands():
    text = (REPO / "README.md").read_text()
    return [ln.strip() for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
            for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_readme_opens_with_install_run_then_test_and_ci_uses_them():
    cmds = fenced_commands()
    install, run_main, test_cmd = cmds[:3]
    assert install.startswith("pip install") and run_main.startswith("python -m inference.game_cv")
    assert "pytest" in test_cmd
    ci = (REPO / ".ci" / "run").read_text()
    assert install in ci and test_cmd in ci
