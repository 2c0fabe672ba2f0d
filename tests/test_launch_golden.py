"""launch.sh --dry-run, golden: the command (or the one-line refusal) it prints for every platform
variable set and device mock the launcher's tests use (test_launch, test_hardware,
test_platform_faults, test_user_traps, test_device_copy), recorded from launch.sh as it is before
its supervisor moves to Python. The Python launcher prints the same; a documented improvement
updates its case here with the reason in the commit.

tests/launch_golden.json: one case per distinct dry run, named after the test that made it: the
variables and arguments given, the files and symbolic links that test had made (fake nvidia-smi /
npu-smi, configs, interpreters), the exit status and both outputs. Paths are placeholders: <repo>
(this checkout), <tmp> (the test's own folder), <tools> (test_launch.tool_dir: the PATH of exactly
the programs launch.sh runs), <python> (this interpreter).
"""

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_launch import dry_run, launcher_passes, tool_dir

CASES = json.loads((Path(__file__).with_name("launch_golden.json")).read_text())


def placeholders(tmp_path) -> list[tuple[str, str]]:
    return [
        ("<tmp>", str(tmp_path)),
        ("<tools>", tool_dir()),
        ("<repo>", str(ROOT)),
        ("<python>", sys.executable),
    ]


def test_the_golden_table_covers_every_platform_and_both_outcomes():
    given = {name for case in CASES for name in case["env"]}
    assert {
        "MA_NUM_HOSTS",
        "VC_TASK_INDEX",
        "PET_NNODES",
        "SLURM_NNODES",
        "NNODES",
        "MASTER_ADDR",
        "NPROC_PER_NODE",
        "CUDA_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
    } <= given, given
    # ModelArts boot args
    assert any(case["args"] and case["args"][0].startswith("--init_method") for case in CASES)
    assert {case["returncode"] for case in CASES} == {0, 2}  # commands and refusals
    assert any("npu-smi" in path for case in CASES for path in case["files"])
    assert any("nvidia-smi" in path for case in CASES for path in case["files"])
    assert len({case["name"] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_dry_run_prints_the_recorded_command(case, tmp_path, monkeypatch):
    subs = placeholders(tmp_path)

    def given(text: str) -> str:
        for mark, value in subs:
            text = text.replace(mark, value)
        return text

    def recorded(text: str) -> str:
        for mark, value in sorted(subs, key=lambda s: -len(s[1])):
            text = text.replace(value, mark)
        return text

    for path, (text, executable) in case["files"].items():
        path = Path(given(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        text = given(text)
        if path.name == "python3":
            # a fake interpreter answers the launcher's probes, not launch.sh's start of it
            shebang, _, rest = text.partition("\n")
            text = f"{shebang}\n{launcher_passes(sys.executable)}{rest}"
        path.write_text(text)
        path.chmod(0o755 if executable else 0o644)
    for path, target in case["links"].items():
        Path(given(path)).symlink_to(given(target))
    # (recorded without one; launch.sh sets its own)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    proc = dry_run(
        {k: given(v) for k, v in case["env"].items()},
        [given(a) for a in case["args"]],
        Path(given(case["bindir"])) if case["bindir"] else None,
    )
    assert proc.returncode == case["returncode"], proc.stderr
    assert recorded(proc.stdout) == case["stdout"]
    assert recorded(proc.stderr) == case["stderr"]
