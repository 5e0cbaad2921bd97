"""The README's commands are the ones CI runs."""
import re

from .conftest import REPO


def fenced_blocks():
    """The README's fenced code blocks, each opening fence paired with its own closing one."""
    return re.findall(r"^```\w*\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)


def fenced_commands():
    return [ln.strip() for block in fenced_blocks()
            for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_readme_opens_with_install_run_then_test_and_ci_uses_them():
    cmds = fenced_commands()
    install, run_main, test_cmd = cmds[:3]
    assert install.startswith("pip install") and run_main.startswith("python -m inference.game_cv")
    assert "pytest" in test_cmd
    ci = (REPO / ".ci" / "run").read_text()
    assert install in ci and test_cmd in ci


def chain_block_commands():
    """The commands of the README's fenced block that trains the shipped world, comments dropped."""
    block = next(b for b in fenced_blocks() if "scripts.train_world" in b)
    return [re.split(r"\s+#", ln)[0].strip() for ln in block.splitlines() if ln.startswith("python -m scripts.")]


def script_stage_commands():
    """scripts/reproduce_world.sh's stages as plain commands: its variables filled in, no --device."""
    script = (REPO / "scripts" / "reproduce_world.sh").read_text().replace("\\\n", " ")
    values = dict(re.findall(r"^([A-Z]+)=(\S+)$", script, re.M))
    values["PY"] = "python"
    out = []
    for ln in re.findall(r"^stage \w+ +(.*)$", script, re.M):
        ln = ln.replace('"${DEV[@]}"', "")
        ln = re.sub(r"\$([A-Z]+)", lambda m: values[m.group(1)], ln)
        out.append(" ".join(ln.split()))
    return out


def test_reproduce_script_runs_the_readme_chain():
    """bash scripts/reproduce_world.sh is the README's chain, stage for stage, so its measured times are
    those of the commands the README lists."""
    readme, script = chain_block_commands(), script_stage_commands()
    assert len(readme) == 11 and readme[0] == "python -m scripts.generate_data"
    assert script == [" ".join(c.split()) for c in readme]
