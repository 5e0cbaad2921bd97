"""The layering rules of docs/architecture.md, checked on the source."""
import ast
import re

from .conftest import REPO


def imports(path):
    """Absolute module names a file imports (relative imports resolved against its package)."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out |= {module} | {f"{module}.{a.name}" for a in node.names}
    return out


def files(folder):
    return sorted((REPO / folder).rglob("*.py"))


def test_the_library_reads_no_environment_and_imports_no_app():
    for path in files("owl_wms"):
        text = path.read_text()
        assert not re.search(r"os\.environ|getenv", text), f"{path} reads the environment"
        bad = {m for m in imports(path) if m.split(".")[0] in ("inference", "scripts", "pygame")}
        assert not bad, f"{path} imports {bad}"


def test_only_the_maze_and_the_apps_use_the_simulator_and_only_the_window_uses_pygame():
    for path in files("owl_wms") + files("inference"):
        mods = imports(path)
        if "maze" not in path.parts and "inference" not in path.parts:
            assert not {m for m in mods if m.startswith("owl_wms.maze")}, f"{path} imports the maze world"
        if path.name != "play.py":
            assert "pygame" not in mods, f"{path} imports pygame"


def test_the_engine_and_the_maze_stay_below_the_apps_and_scripts_share_one_helper():
    for path in files("owl_wms/engine"):
        assert not {m for m in imports(path) if m.startswith("owl_wms.maze")}, f"{path} imports the maze world"
    for path in files("scripts"):
        others = {m for m in imports(path) if m.startswith("scripts.") and not m.startswith("scripts.common")}
        assert not others, f"{path} imports other scripts: {others}"
