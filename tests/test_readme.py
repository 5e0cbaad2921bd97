"""The README's commands are the ones CI runs, its chain is the reproduce script's, its links
resolve, and its Python example runs."""
import os
import re

from .conftest import REPO

README_MAX_LINES = 250


def fenced_blocks():
    """The README's fenced code blocks, each opening fence paired with its own closing one."""
    return re.findall(r"^```\w*\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)


def fenced_commands(blocks=None):
    """The lines of ``blocks`` (default: every fenced block), blank and comment lines dropped."""
    return [ln.strip() for block in (fenced_blocks() if blocks is None else blocks)
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
    return [re.split(r"\s+#", ln)[0].strip() for ln in block.splitlines()
            if re.match(r"(OWL_\w+=\S+ )*python -m scripts\.", ln)]


def script_stage_commands():
    """scripts/reproduce_world.sh's stages as plain commands: its variables filled in, no --device."""
    script = (REPO / "scripts" / "reproduce_world.sh").read_text().replace("\\\n", " ")
    values = dict(re.findall(r"^([A-Z]+)=(\S+)$", script, re.M))
    values["PY"] = "python"
    out = []
    for ln in re.findall(r"^stage \w+ +(.*)$", script, re.M):
        ln = ln.replace('"${DEV[@]}"', "")
        ln = re.sub(r"\$([A-Z]+)", lambda m: values[m.group(1)], ln).removeprefix("env ")
        out.append(" ".join(ln.split()))
    return out


def test_reproduce_script_runs_the_readme_chain():
    """bash scripts/reproduce_world.sh is the README's chain, stage for stage, so its measured times are
    those of the commands the README lists."""
    readme, script = chain_block_commands(), script_stage_commands()
    assert len(readme) == 13 and readme[0] == "python -m scripts.generate_data"
    assert script == [" ".join(c.split()) for c in readme]


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES} (details go to docs/)"


def relative_links(path):
    """(target, line number) of every Markdown link in ``path`` that is not a URL or an anchor."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z][a-z0-9+.-]*:|#", target):
                out.append((target.split("#")[0], n))
    return out


def test_readme_and_docs_links_point_to_files():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [f"{page.relative_to(REPO)}:{n}: {target}" for page in pages
               for target, n in relative_links(page) if not (page.parent / target).exists()]
    assert relative_links(REPO / "README.md"), "the README links to docs/"
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def python_example():
    """The README's one ```python block: the "Use from Python" example."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)
    assert len(blocks) == 1, f"expected one python block in the README, found {len(blocks)}"
    return blocks[0]


def test_readme_python_example_runs(monkeypatch, capsys):
    """The example runs as written, from the repo root, on the CPU (fp32 only to keep it quick)."""
    code = python_example()
    assert "from inference.causvid_pipeline import CausvidPipeline" in code
    assert "CausvidPipeline.from_checkpoint()" in code
    for name in [k for k in os.environ if k.startswith("OWL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OWL_DEVICE", "cpu")
    monkeypatch.setenv("OWL_DTYPE", "fp32")
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))
    scope = {"__name__": "__readme__"}
    exec(compile(code, "README.md (Use from Python)", "exec"), scope)
    pipe = scope["pipe"]
    shape = tuple(scope["frame"].shape)
    assert len(shape) == 3 and shape[2] == 3 and str(scope["frame"].dtype) == "torch.uint8"
    assert pipe.cache_epoch == 2 and pipe.frame_index == 1  # the load at start-up, then the example's hard cut
    assert "epoch 2 frame 1" in capsys.readouterr().out


def test_every_measured_figure_in_the_readme_is_on_the_results_page():
    """A figure the README states (dB, ratios, frame rates, milliseconds; outside commands) is one
    the results page lists with its machine, command and commit, and the README links there."""
    import re

    readme = (REPO / "README.md").read_text()
    results = (REPO / "docs" / "results.md").read_text()
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)
    figures = re.findall(r"(\d+\.\d+)\s?(?:dB|x\b|FPS|ms\b)", prose)
    assert figures, "the README states measured figures"
    assert not [f for f in figures if f not in results], "README figures missing from docs/results.md"
    assert "docs/results.md" in readme
