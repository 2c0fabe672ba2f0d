"""torch.compile compiles a bounded, known set of graphs: one for training and one for evaluation, whatever
the data size (issue 14 item 4). Training drops incomplete batches; evaluation pads its last batch (11 test
samples at batch 4: the last batch has 3 on one process) and the padding is removed before the metrics.
Each trainer logs dynamo's counters at the end; any recompile (a new shape, a new mode) shows there.

Compiling on 2 shared CPU cores takes minutes: the smallest timm model, few samples."""

import json
import re

import pytest

from conftest import launch, run_cli

pytestmark = pytest.mark.slow
RUN = ["--model", "test_resnet", "--stem", "imagenet", "--compile", "--train_samples", "32", "--test_samples", "11",
       "--batch_size", "4", "--log_all_ranks"]
COMPILED = re.compile(r"rank (\d+): torch.compile compiled (\d+) graph\(s\) \(train, eval\)")


def compiles(text, ranks):
    found = {int(r): int(g) for r, g in COMPILED.findall(text)}
    assert sorted(found) == list(range(ranks)), text[-3000:]
    return found


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("ranks", [1, 2])
def test_compile_two_epochs_and_a_resume_compile_one_train_and_one_eval_graph(tmp_path, ranks):
    out = tmp_path / "out"
    args = RUN + ["--epochs", "2", "--output_dir", out]
    stop_at = ["--max_steps", str(32 // (4 * ranks) + 1)]  # one step into epoch 2, after epoch 1's evaluation
    if ranks == 1:  # one process: no sharding pads the last evaluation batch (today's code compiles it again)
        first = run_cli(args + stop_at, timeout=1500)  # (--compile: a new process, see conftest.launch)
        assert first.returncode == 0, first.stderr[-3000:]
        resumed = run_cli(args + ["--resume", "auto"], timeout=1500)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    else:
        first = launch("2proc_cpu.yaml", args + stop_at, timeout=1500)
        resumed = launch("2proc_cpu.yaml", args + ["--resume", "auto"], timeout=1500)
    for proc in (first, resumed):
        text = proc.stdout + proc.stderr
        assert set(compiles(text, ranks).values()) == {2}, text[-3000:]  # train + eval, no recompile
    assert "resumed from" in resumed.stderr + resumed.stdout
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["test_samples"]) for r in rows] == [(1, 11), (2, 11)]  # the padding is not counted
