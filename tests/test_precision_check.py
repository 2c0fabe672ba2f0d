"""The start-up check of the reduced precision (accel_train/precision/check.py): its
verdict on an injected wrong gradient, on the real bad shape as this machine's kernel computes it,
the fall-back to fp32 and the refusal, the cache, and 2 ranks agreeing."""

import json
import os
import re

import pytest
import timm
import torch
import torch.nn as nn
from conftest import ROOT, clean_env, run, run_cli
from wrong_gradients import FORWARDS, Corrupt, Net, wrong_under_autocast

from accel_train.precision import check as gradcheck

BF16_CPU = json.dumps(
    {"kind": "cpu", "name": "mocked", "cpu_flags": ["avx512f", "avx512_bf16"], "arch": "x86_64"}
)


def batch(n=8, size=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_the_bound_is_derived_from_the_unit_roundoff_and_the_depth():
    resnet18 = timm.create_model("resnet18")
    assert gradcheck.depth(resnet18) == 21  # 20 convolutions and the classifier
    assert gradcheck.bound("fp16", 21) == pytest.approx(8 * 2 * 22 * 2.0**-11)  # 0.17
    assert gradcheck.bound("bf16", 2) == pytest.approx(8 * 2 * 3 * 2.0**-8)  # 0.19
    # capped: an error as large as the gradient is never rounding
    assert gradcheck.bound("bf16", 21) == 1.0


def test_an_injected_wrong_gradient_fails_and_the_model_and_rng_are_untouched():
    x, y = batch()
    model = Net(bad=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    v = gradcheck.check(model, x, y, nn.CrossEntropyLoss(), "bf16")
    assert set(v.bad) == {"conv.weight"} and v.bad["conv.weight"] > 1e12, v
    assert v.worst[0] == "conv.weight" and not v.ok
    # weights and BN statistics
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and torch.equal(
        torch.get_rng_state(), rng
    )
    right = gradcheck.check(Net(bad=False), x, y, nn.CrossEntropyLoss(), "bf16")
    # bf16's own rounding is seen, and is under the bound
    assert right.ok and 0 < right.worst[1] < right.limit, right


def test_a_non_finite_gradient_fails_with_an_infinite_error():
    ref = {"a": torch.ones(4), "b": torch.zeros(3), "c": torch.ones(2)}
    low = {
        "a": torch.tensor([1.0, float("nan"), 1.0, 1.0]),
        "b": torch.zeros(3),
        "c": torch.ones(2) * 1.001,
    }
    errs = gradcheck.errors(ref, low)
    assert (
        errs["a"] == float("inf")
        and errs["b"] == 0.0
        and errs["c"] == pytest.approx(1e-3, rel=1e-3)
    )


def test_the_fp32_reference_runs_without_tf32_or_hf32(monkeypatch):
    """cuDNN's fp32 convolutions run in TF32 by default from sm80 (torch.backends.cudnn.allow_tf32),
    torch_npu's in HF32 (torch.npu.conv.allow_hf32): 10 mantissa bits, a reference as coarse as the
    fp16 it checks. Both the forward and the
    backward of each fp32 pass see every such switch off; the reduced precision passes see them as
    the run has them, and they are as they were after the check."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = (
        True  # as a user's torch.set_float32_matmul_precision("high")
    )
    torch.backends.cudnn.allow_tf32 = True
    try:
        fp32_reference_flags(monkeypatch)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def fp32_reference_flags(monkeypatch):
    import types

    npu = types.SimpleNamespace(
        conv=types.SimpleNamespace(allow_hf32=True), matmul=types.SimpleNamespace(allow_hf32=True)
    )
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    seen = []

    def switches(stage, reduced):
        seen.append(
            (
                stage,
                reduced,
                torch.backends.cudnn.allow_tf32,
                torch.backends.cuda.matmul.allow_tf32,
                npu.conv.allow_hf32,
                npu.matmul.allow_hf32,
            )
        )

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * 8 * 8, 10)

        def forward(self, x):
            reduced = torch.is_autocast_enabled("cpu")
            switches("forward", reduced)
            out = self.fc(x.flatten(1))
            out.register_hook(lambda grad: switches("backward", reduced))
            return out

    x, y = batch()
    assert gradcheck.check(Probe(), x, y, nn.CrossEntropyLoss(), "fp16").ok
    reference = [s for s in seen if not s[1]]
    assert {s[0] for s in reference} == {"forward", "backward"}
    assert all(s[2:] == (False, False, False, False) for s in reference), reference
    # the run's own precision: as it is
    assert all(s[2:] == (True, True, True, True) for s in seen if s[1])
    assert (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        npu.conv.allow_hf32,
        npu.matmul.allow_hf32,
    ) == (True, True, True, True)


# a gradient all zero under autocast (what the README says a wrong kernel often leaves inside the
# model's backward)
Zeroed = wrong_under_autocast(torch.zeros_like)


class DeepNet(nn.Module):
    """16 linear layers (bf16's bound capped at 1.0), then a BatchNorm whose weight's gradient is
    zeroed under autocast."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(15)))
        with torch.no_grad():
            # near the identity: well conditioned, bf16's own errors far under 1.0
            for layer in self.layers:
                layer.weight.mul_(0.1).add_(torch.eye(8))
        self.bn = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        h = self.layers(x.flatten(1)[:, :8])
        h = nn.functional.batch_norm(
            h, None, None, Zeroed.apply(self.bn.weight), self.bn.bias, training=True
        )
        return self.fc(h)


def test_a_gradient_that_is_all_zero_where_fp32_s_is_not_fails_whatever_the_bound():
    # an all-zero gradient has relative error exactly 1.0, and a deep model's bound is capped at
    # 1.0, so `not e <= limit` would let it pass (worst ('bn.weight', 1.0)). Zero where fp32 is not
    # (above the floor) is no rounding
    errs = gradcheck.errors(
        {"w": torch.ones(4), "b": torch.zeros(2), "t": torch.ones(2) * 1e-9},
        {"w": torch.zeros(4), "b": torch.zeros(2), "t": torch.zeros(2)},
    )
    # (under the floor: judged against it)
    assert errs["w"] == float("inf") and errs["b"] == 0.0 and errs["t"] < 1e-6
    # no gradient at all under autocast
    assert gradcheck.errors({"w": torch.ones(4)}, {})["w"] == float("inf")
    model = DeepNet()
    assert gradcheck.bound("bf16", gradcheck.depth(model)) == 1.0
    x, y = batch()
    v = gradcheck.check(model, x, y, nn.CrossEntropyLoss(), "bf16")
    assert set(v.bad) == {"bn.weight"} and v.bad["bn.weight"] == float("inf"), v


def test_frozen_layers_are_not_checked_and_a_layer_called_by_keyword_is(monkeypatch):
    # a linear probe (every layer frozen but the classifier) must not make the layer-alone pass
    # raise "element 0 of tensors does not require grad" (exit 2, even under auto); a layer called
    # as self.fc(input=x) must not make its input hook raise IndexError (args is empty)
    import tests_pkg.mod

    x, y = batch()
    seen = []
    real = gradcheck.layer_errors
    monkeypatch.setattr(
        gradcheck,
        "layer_errors",
        lambda layers, *a: seen.append(sorted(layers)) or real(layers, *a),
    )
    for keyword, head in ((False, "head"), (True, "head.layer")):
        v = gradcheck.check(
            tests_pkg.mod.probe(10, keyword=keyword), x, y, nn.CrossEntropyLoss(), "bf16"
        )
        assert v.ok and v.worst[0].startswith(f"{head}."), v
        # the classifier alone is checked too; the frozen convolution is not
        assert seen.pop() == [head]


def test_a_failure_that_comes_from_the_batch_says_so_not_the_device():
    # resnet18 at 32 px, batch 2: layer4 normalises 2 values per channel (1x1 feature maps), bf16's
    # rounding is amplified past the bound (errors ~1.2; fp32 8e-5 off fp64), which is no reason to
    # say "bf16 autocast computes wrong gradients on this device". Every layer alone computes right
    # there: the cause is the batch. (timm's test_resnet does the same, in a
    # second)
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    v = gradcheck.check(model, x, y, nn.CrossEntropyLoss(), "bf16")
    assert not v.ok and v.cause == "batch" and max(v.bad.values()) < gradcheck.AMPLIFIED, v
    text = gradcheck.wrong_text(v, "bf16", "2x3x32x32", 2)
    assert (
        "on this 2x3x32x32 batch differ from fp32's beyond rounding" in text
        and "the cause is the batch" in text
        and "on this device for" not in text
    ), text
    # garbage x1e15: the device
    kernel = gradcheck.check(Net(bad=True), *batch(), nn.CrossEntropyLoss(), "bf16")
    assert kernel.cause == "" and "computes wrong gradients on this device" in gradcheck.wrong_text(
        kernel, "bf16", "8x3x8x8", 8
    )
    assert gradcheck.combine([v, kernel]).cause == "" and gradcheck.combine([v, v]).cause == "batch"
    # (remembered with the verdict)
    assert gradcheck.Verdict.from_json(v.to_json()).cause == "batch"


def test_the_ranks_verdicts_combine_into_one():
    ok = gradcheck.Verdict("bf16", 1.0, ("fc.weight", 0.01))
    bad = gradcheck.Verdict(
        "bf16", 1.0, ("layer4.0.conv1.weight", 3e37), {"layer4.0.conv1.weight": 3e37}, 2.0
    )
    for order in ([ok, bad], [bad, ok]):
        v = gradcheck.combine(order)
        assert (
            not v.ok
            and v.bad == {"layer4.0.conv1.weight": 3e37}
            and v.worst[1] == 3e37
            and v.seconds == 2.0
        )
    assert gradcheck.combine([ok, ok]).ok


def wrong_here(trials: int = 6) -> bool:
    """The bad kernel's reproduction, alone: a 3x3/stride-2/padding-1 convolution of a 1x1 input.
    Every weight tap but the centre sees only padding, so its gradient is exactly 0 (fp32 says so);
    a kernel that leaves garbage there (over the one-layer bound) in any of `trials` bf16 passes is
    wrong on this machine (this Xeon's: in most passes).
    """
    padding_only = torch.ones(3, 3, dtype=torch.bool)
    padding_only[1, 1] = False
    sum_all = lambda out, _: out.float().sum()  # noqa: E731 (the reproduction's loss)
    wrong = False
    for trial in range(trials):
        torch.manual_seed(trial)
        conv = nn.Conv2d(256, 512, 3, stride=2, padding=1, bias=False).to(
            memory_format=torch.channels_last
        )
        x = torch.randn(16, 256, 1, 1).contiguous(memory_format=torch.channels_last)
        ref = gradcheck.gradients(conv, x, None, sum_all, None)["weight"]
        low = gradcheck.gradients(conv, x, None, sum_all, torch.bfloat16)["weight"]
        assert ref[:, :, padding_only].abs().max() == 0
        taps = low[:, :, padding_only]
        wrong |= (
            not torch.isfinite(taps).all() or taps.norm() > gradcheck.bound("bf16", 1) * ref.norm()
        )
    return bool(wrong)


def test_on_issue_27s_model_the_check_says_what_this_machines_kernel_does():
    """resnet18 with the imagenet stem at 16 px (layer4.0.conv1 sees a 1x1 input), checked as a run
    checks it: the verdict names layer4.0.conv1.weight where the kernel alone is wrong here, and
    passes where it is right.
    """
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(16, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    v = gradcheck.check(model, x, torch.randint(0, 10, (16,)), nn.CrossEntropyLoss(), "bf16")
    if wrong_here():
        assert "layer4.0.conv1.weight" in v.bad, v
    else:
        assert v.ok, v


class CorruptConv(nn.Conv2d):
    def forward(self, x):
        return self._conv_forward(x, Corrupt.apply(self.weight), self.bias)


def test_each_layer_is_also_checked_alone_on_its_own_input_shape():
    layers = {
        "a": (CorruptConv(3, 4, 3), torch.randn(5, 3, 6, 6)),
        "b": (nn.Linear(4, 2), torch.randn(5, 4)),
        "c": (
            nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last),
            torch.randn(5, 3, 6, 6).contiguous(memory_format=torch.channels_last),
        ),
    }
    errs = gradcheck.layer_errors(layers, "bf16", 2)
    assert set(errs) == {"a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"}
    assert errs["a.weight"] > 1e12 and max(
        e for n, e in errs.items() if n != "a.weight"
    ) < gradcheck.bound("bf16", 1)


def fit_args(model, out, *more):
    return [
        "--model",
        model,
        "--stem",
        "imagenet",
        "--data",
        "random",
        "--train_samples",
        "32",
        "--test_samples",
        "8",
        "--batch_size",
        "8",
        "--image_size",
        "8",
        "--epochs",
        "1",
        "--output_dir",
        out,
        *more,
    ]


def env_for(tmp_path, **extra):
    return clean_env(
        ACCEL_TRAIN_DEVICE_FACTS=BF16_CPU, XDG_CACHE_HOME=str(tmp_path / "cache"), **extra
    )


def training_forwards(proc):
    """Autocast on/off of the forwards after the check's two (fp32, then the reduced precision)."""
    return FORWARDS[2:]


def test_nothing_asked_a_failed_check_trains_in_fp32_with_one_line_then_the_verdict_is_cached(
    tmp_path, monkeypatch
):
    FORWARDS.clear()
    proc = run_cli(fit_args("gradcheck_wrong_in_bf16", tmp_path / "a"), env=env_for(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "precision fp32, not bf16" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.search(
        r"bf16 autocast computes wrong gradients on this device for conv\.weight \(error 1e\+15\) "
        r"\(a 8x3x8x8 batch; fp32 as the reference, bound 0\.\d+\); \d+\.\d s, peak memory \+\d+"
        r" MiB, "
        r"remembered",
        lines[0],
    ), lines
    assert (
        FORWARDS[:2] == [False, True]
        and training_forwards(proc)
        and not any(training_forwards(proc))
    ), FORWARDS
    assert "DistributedType.NO, no]" in proc.stderr
    # a second start: the verdict is read, not measured again
    monkeypatch.setattr(
        gradcheck, "check", lambda *a: pytest.fail("checked again despite the cache")
    )
    FORWARDS.clear()
    again = run_cli(fit_args("gradcheck_wrong_in_bf16", tmp_path / "b"), env=env_for(tmp_path))
    assert again.returncode == 0 and "checked on an earlier start (cached)" in again.stderr, (
        again.stderr[-3000:]
    )
    assert FORWARDS and not any(FORWARDS)  # trained, and in fp32
    # launch.sh's own pick is not an ask: the same fall-back
    FORWARDS.clear()
    picked = run_cli(
        fit_args("gradcheck_wrong_in_bf16", tmp_path / "c"),
        env=env_for(tmp_path, ACCELERATE_MIXED_PRECISION="bf16", ACCEL_TRAIN_AUTO_PRECISION="bf16"),
    )
    assert (
        picked.returncode == 0
        and "precision fp32, not bf16" in picked.stderr
        and FORWARDS
        and not any(FORWARDS)
    )


@pytest.mark.parametrize("ask", [["--mixed_precision", "bf16"], "config"])
def test_an_asked_precision_that_fails_the_check_is_refused_in_one_line(tmp_path, ask):
    extra = {"ACCELERATE_MIXED_PRECISION": "bf16"} if ask == "config" else {}
    proc = run_cli(
        fit_args("gradcheck_wrong_in_bf16", tmp_path / "out", *([] if ask == "config" else ask)),
        env=env_for(tmp_path, **extra),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "accel-train: error" in ln]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    source = (
        "--mixed_precision bf16"
        if ask != "config"
        else "the accelerate config's mixed_precision: 'bf16'"
    )
    assert errors[0].startswith(
        f"accel-train: error: {source} asks for bf16, but bf16 autocast computes wrong "
        "gradients on this device for conv.weight (error 1e+15)"
    ), errors
    assert (
        "--force_precision" in errors[0] and not (tmp_path / "out" / "model.safetensors").exists()
    )


@pytest.mark.parametrize("clip", [[], ["--clip_grad", "1"]])
def test_forced_the_run_trains_in_bf16_and_the_divergence_watch_names_what_is_absurd(
    tmp_path, clip
):
    """--force_precision trains on the wrong gradients (finite: x1e15). The weights jump by orders
    of magnitude at step 1 and the divergence watch stops the run there (exit 5), naming the
    parameter; with --clip_grad the weights stay sane, and the gradient's own norm (over 1e6 x the
    weights') is what it names."""
    FORWARDS.clear()
    forced = run_cli(
        fit_args(
            "gradcheck_wrong_in_bf16",
            tmp_path / "a",
            "--mixed_precision",
            "bf16",
            "--force_precision",
            "--log_every",
            "50",
            *clip,
        ),
        env=env_for(tmp_path),
    )
    assert "training in bf16 anyway, as --force_precision asks" in forced.stderr, forced.stderr[
        -3000:
    ]
    assert FORWARDS[2:] and all(FORWARDS[2:])
    assert forced.returncode == 5, forced.stderr[-3000:]
    errors = [ln for ln in forced.stderr.splitlines() if "accel-train: error" in ln]
    what = r"the gradient \(before --clip_grad\)" if clip else r"the weights of conv\.weight"
    assert len(errors) == 1 and re.match(
        rf"accel-train: error: {what} jumped from norm \S+ to \S+ at step 1 \(lr "
        r"[\d.e+-]+\); a wrong bf16 kernel does this too \(--mixed_precision "
        r"no rules it out\): every rank stopped, nothing exported",
        errors[0],
    ), errors
    assert (
        not (tmp_path / "a" / "model.safetensors").exists()
        and not (tmp_path / "a" / "steps.jsonl").read_text()
    )


def test_a_model_whose_gradients_are_right_trains_in_bf16_after_the_check(tmp_path):
    FORWARDS.clear()
    fine = run_cli(fit_args("gradcheck_right_in_bf16", tmp_path / "b"), env=env_for(tmp_path))
    assert fine.returncode == 0, fine.stderr[-3000:]
    assert re.search(
        r"precision check: bf16 gradients match fp32 on a 8x3x8x8 batch: worst relative error \S+ "
        r"\(\S+\), bound 0\.\d+; \d+\.\d s",
        fine.stderr,
    ), fine.stderr[-3000:]
    trained = FORWARDS[1 + gradcheck.REPEATS :]  # after the fp32 pass and the bf16 ones
    assert trained and all(trained) and "DistributedType.NO, bf16]" in fine.stderr


RANK_HOOK = """
import os
import sys
if os.environ.get("RANK") is not None:  # the ranks (torchrun sets RANK), not the launcher
    sys.path.insert(0, {tests!r})
    import wrong_gradients  # noqa: F401 (registers gradcheck_wrong_on_rank_1)
"""


@pytest.mark.launches
def test_two_ranks_agree_when_only_one_sees_wrong_gradients_and_launch_sh_s_pick_falls_back(
    tmp_path,
):
    """launch.sh on a CPU with native bf16 picks bf16 (accelerate launch --mixed_precision bf16,
    marked as its own pick); rank 1's kernel is wrong (a hook registers a model whose gradient is
    garbage there only), rank 0's right: the gathered verdict fails on both, and both train in fp32,
    said once by the main process."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(RANK_HOOK.format(tests=str(ROOT / "tests")))
    env = env_for(
        tmp_path,
        NPROC_PER_NODE="2",
        PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    proc = run(
        [
            "bash",
            ROOT / "launch.sh",
            "--model",
            "gradcheck_wrong_on_rank_1",
            "--stem",
            "imagenet",
            "--data",
            "random",
            "--train_samples",
            "64",
            "--test_samples",
            "8",
            "--batch_size",
            "8",
            "--image_size",
            "8",
            "--epochs",
            "1",
            "--timeout_s",
            "60",
            "--output_dir",
            tmp_path / "out",
        ],
        240,
        env,
        ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launch.sh: precision bf16" in proc.stderr, proc.stderr[-4000:]
    fallback = [ln for ln in proc.stderr.splitlines() if "precision fp32, not bf16" in ln]
    assert len(fallback) == 1 and "conv.weight (error 1e+15)" in fallback[0], proc.stderr[-4000:]
    assert "2 process(es) [DistributedType.MULTI_CPU, no]" in proc.stderr, proc.stderr[-4000:]
    # the gathered verdict is what the machine remembers, not whichever rank wrote last (rank 0's
    # own pass)
    verdicts = [
        json.loads(f.read_text()) for f in (tmp_path / "cache" / "accel_train").rglob("*.json")
    ]
    assert len(verdicts) == 1 and verdicts[0]["bad"], verdicts


class _Scaled(torch.autograd.Function):
    """Identity whose gradient is `factor` x the true one under autocast only: a kernel wrong by a
    modest factor."""

    @staticmethod
    def forward(ctx, w, factor):
        ctx.factor = factor if torch.is_autocast_enabled(w.device.type) else 1.0
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class _ScaledNet(Net):
    def __init__(self, factor):
        super().__init__(bad=False)
        self.factor = factor

    def forward(self, x):
        w = _Scaled.apply(self.conv.weight, self.factor)
        x = torch.relu(self.bn(nn.functional.conv2d(x, w, self.conv.bias, padding=1)))
        return self.fc(self.drop(x.mean((2, 3))))


@pytest.mark.parametrize("factor", [1.5, 10.0])
def test_a_gradient_wrong_by_a_modest_factor_fails_the_check(factor):
    """The check's promise is its bound (0.19 for this 2-layer model in bf16), not only non-finite
    or 1e15 errors (a bound made 1000x looser must fail a test): a gradient 1.5x (error
    0.5) or 10x (error 9) of the fp32 one fails, and the right one passes under the same bound."""
    x, y = batch()
    v = gradcheck.check(_ScaledNet(factor), x, y, nn.CrossEntropyLoss(), "bf16")
    assert v.limit == pytest.approx(gradcheck.bound("bf16", 2)) and v.limit < 0.2
    assert not v.ok and set(v.bad) == {"conv.weight"}, v
    assert v.bad["conv.weight"] == pytest.approx(factor - 1, rel=0.05), v
    assert gradcheck.check(_ScaledNet(1.0), x, y, nn.CrossEntropyLoss(), "bf16").ok


def test_the_check_runs_on_a_slice_of_a_large_batch_and_on_a_smaller_one_when_out_of_memory(
    tmp_path, monkeypatch
):
    # the check on the whole batch (resnet50, 224 px, batch 64, bf16) peaks 2.1-2.5 GiB over a
    # training step's peak, so a batch sized to fill the device would fail in the check (exit 2
    # under auto). It runs on a slice (a quarter of a batch over 32, at least 32
    # samples), halves it when out of memory (down to 8), and its line says its time and peak memory
    sizes, real = [], gradcheck.check

    def short_of_memory(model, x, *args):
        sizes.append(len(x))
        if len(x) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, x, *args)

    args = fit_args("gradcheck_right_in_bf16", tmp_path / "a")
    args[args.index("--batch_size") + 1], args[args.index("--train_samples") + 1] = "256", "256"
    fine = run_cli(args, env=env_for(tmp_path))
    assert fine.returncode == 0 and re.search(
        r"bf16 gradients match fp32 on a 64x3x8x8 slice of the 256-sample "
        r"batch: .*; \d+\.\d s, peak memory \+\d+ MiB",
        fine.stderr,
    ), fine.stderr[-3000:]
    monkeypatch.setattr(gradcheck, "check", short_of_memory)
    args[args.index("--output_dir") + 1] = str(tmp_path / "b")
    tight = run_cli(args, env=env_for(tmp_path / "other"))  # (another cache: checked again)
    assert tight.returncode == 0 and sizes == [64, 32, 16, 8], (sizes, tight.stderr[-3000:])
    assert "bf16 gradients match fp32 on a 8x3x8x8 slice of the 256-sample batch" in tight.stderr
    assert "DistributedType.NO, bf16]" in tight.stderr
