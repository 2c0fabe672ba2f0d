"""The README and docs/ stay true: the README's commands are the ones CI and users run, the flags
the pages name exist, every relative link resolves, and every docs page and module is reachable from
the README."""

import re
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT, check_best, clean_env

from accel_train.cli import train_parser

README = (ROOT / "README.md").read_text()
DOCS = {path: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
PAGES = {ROOT / "README.md": README, **DOCS}  # the README and the reference it points to


def quick_start() -> list[str]:
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_quick_start_is_exactly_two_commands_and_ci_runs_the_test_one():
    commands = quick_start()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines(), "the README's test command must be what .ci/run runs"
    # (one process: the trainer's status)
    assert commands[0].startswith("pip install -e . && python -m accel_train ")
    # a machine without a GPU reads the CPU-only torch install before the command that would fetch
    # the CUDA build
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cpu = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in block and block.index(cpu) < block.index(commands[0]), block


def test_every_trainer_flag_the_readme_and_docs_name_exists():
    known = set()
    for action in train_parser()._actions:
        known.update(action.option_strings)
    flags_table = DOCS[ROOT / "docs" / "training.md"].split("## Flags", 1)[1].split("\n## ", 1)[0]
    # the main flags' table is where it says
    assert len(set(re.findall(r"\| `(--[a-z_]+)", flags_table))) >= 20
    table_flags = set(re.findall(r"\| `(--[a-z_]+)", "".join(PAGES.values())))
    assert table_flags and table_flags <= known, table_flags - known


def test_quick_start_training_command_says_bad_input_in_one_line_with_status_2(tmp_path):
    """Where users start, bad input is one line and exit status 2 (accelerate
    launch's simple launcher turns any failure into its own CalledProcessError traceback and status
    1)."""
    install, train = quick_start()[0].split(" && ", 1)
    cmd = shlex.split(train)
    cmd = [
        sys.executable if cmd[0] == "python" else cmd[0],
        *cmd[1:],
        "--epoch",
        "2",
        "--output_dir",
        tmp_path / "o",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env()
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "accel-train: error: unknown argument --epoch (did you mean --epochs?); see accel-train"
        " --help"
    ]
    # the other one-process commands of the README and docs/ are started the same way
    blocks = re.findall(r"```bash\n(.*?)```", "".join(PAGES.values()), re.S)
    assert not [
        line
        for block in blocks
        for line in block.splitlines()
        if "accelerate_configs/cpu.yaml -m" in line
    ]


@pytest.mark.launches
def test_quick_start_training_command_runs(tmp_path):
    install, train = quick_start()[0].split(" && ", 1)
    cmd = shlex.split(train) + ["--output_dir", str(tmp_path / "out")]
    assert cmd[:3] == ["python", "-m", "accel_train"]
    cmd[0] = sys.executable
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # every output the README lists after the quick start (matplotlib comes with the test extra: the
    # curves too)
    listed = quick_start_outputs()
    assert {
        "model.safetensors",
        "model_best.safetensors",
        "checkpoints/",
        "training_curves.png",
    } <= set(listed)
    for name in listed:
        path = tmp_path / "out" / name
        assert (path.is_dir() and any(path.iterdir())) if name.endswith("/") else path.is_file(), (
            name
        )
    check_best(tmp_path / "out")  # the one epoch's finite weights, its checkpoint's


def quick_start_outputs() -> list[str]:
    """The files the README says the quick start's first command writes (the paragraph after the
    commands)."""
    text = README.split("## Quick start", 1)[1].split("```", 2)[2].split("The test suite", 1)[0]
    assert "The first command writes" in text, text
    return [
        name.removeprefix("output_dir/")
        for name in re.findall(r"`([\w./]+)`", text)
        if re.search(r"\.(safetensors|json|jsonl|yaml|png)$|/$", name)
    ]


def test_ci_tests_the_lower_bounds_of_pyproject():
    bounds = {}
    requirements = (
        (ROOT / "pyproject.toml")
        .read_text()
        .split("[project]", 1)[1]
        .split("[project.scripts]", 1)[0]
    )
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:,<[0-9.]+)?"', requirements):
        bounds.setdefault(name.lower(), set()).add(version)
    pins = {}
    for line in (ROOT / ".ci" / "constraints-min.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    # one bound per package, extras included
    assert all(len(v) == 1 for v in bounds.values()), bounds
    untested = {name for name in bounds if name not in pins}
    # the two the min-version venv reuses, not reinstalls
    assert untested == {
        "torch",
        "torchvision",
    }, untested
    assert {name: bounds[name].pop() for name in pins} == pins
    ci = (ROOT / ".ci" / "run").read_text()
    # (as the CPU with native bf16: the README's command runs as the one without, tests/conftest.py)
    assert "ACCEL_TRAIN_TEST_CPU=bf16 bash .ci/min_versions.sh" in ci.splitlines()


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_' dropped,
    spaces -> '-'."""
    heads = re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", head.strip().lower()).replace(" ", "-") for head in heads}


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """The README and the docs/ pages: a moved section leaves no link behind."""
    broken, checked = [], 0
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 50 and not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    linked = {
        (ROOT / target.split("#")[0]).resolve()
        for target in re.findall(r"\]\((docs/[^)\s]+)\)", README)
    }
    assert DOCS and set(DOCS) <= linked, sorted(p.name for p in set(DOCS) - linked)


def test_the_readme_stays_what_a_newcomer_reads_first():
    """The reference lives in docs/; the README keeps the quick start, the main commands, the code
    map and where to read more."""
    assert len(README.encode()) < 20_000
    heads = re.findall(r"^## (.+)$", README, re.M)
    assert heads[:2] == ["Quick start", "Main commands"] and {"Code map", "Read more"} <= set(
        heads
    ), heads


def test_the_code_map_names_every_module():
    code_map = README.split("## Code map", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "accel_train"
    missing = [
        f"accel_train/{p.name}"
        for p in package.glob("*.py")
        if p.name != "__init__.py" and f"(accel_train/{p.name})" not in code_map
    ]
    for sub in (p for p in package.iterdir() if (p / "__init__.py").is_file()):
        row = next(
            (
                line
                for line in code_map.splitlines()
                if f"(accel_train/{sub.name}/__init__.py)" in line
            ),
            "",
        )
        missing += [
            f"accel_train/{sub.name}/{p.name}"
            for p in sub.glob("*.py")
            if p.name != "__init__.py" and f"`{p.stem}`" not in row
        ]
    assert not missing, missing
