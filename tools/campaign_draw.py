"""What the fault campaign draws (tools/campaign.py): one scenario from one seed. Every dimension
drawn is named here; a scenario's seed replays its draw (the timing of a fault on a loaded machine
is not replayed exactly).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field

LAYOUTS = {  # name: (processes per machine, machines, how it is started)
    "launch1": (1, 1, "launch.sh"),
    "launch2": (2, 1, "launch.sh"),
    "accelerate2": (2, 1, "accelerate"),
    "hosts2": (1, 2, "launch.sh"),
}
# BN timm, GN timm, --model module:fn, a train() script
MODELS = (
    "test_resnet",
    "test_resnet_gn",
    "own",
    "script",
)
NORM_FREE = ("test_resnet_gn", "own", "script")  # comparable across process counts (elastic resume)
STARTS = ("fresh", "fresh", "resume_auto", "resume_path", "overwrite", "elastic")
EVENTS = ("step", "step", "step", "checkpoint", "eval", "epoch_end", "startup")
# the recipe's flags, drawn after everything else (so that adding a recipe keeps every earlier
# seed's layout, flags and faults)
RECIPES = {
    "none": [],
    # per sample: workers only
    "photos": [
        "--aa",
        "rand-m9-mstd0.5",
        "--reprob",
        "0.25",
        "--color_jitter",
        "0.4",
    ],
    "mix": ["--mixup", "0.8", "--cutmix", "1.0"],
    "adamw": [
        "--opt",
        "adamw",
        "--sched",
        "step",
        "--sched_kwargs",
        '{"decay_epochs": 1}',
        "--drop_path",
        "0.1",
    ],
    "decay": ["--opt", "adamw", "--layer_decay", "0.75"],
    "probe": ["--freeze", "backbone"],
}
# drop_path, layer groups, a named classifier: timm's models
TIMM_ONLY = (
    "adamw",
    "decay",
    "probe",
)
GLOBAL_BATCH = 16


@dataclass
class Scenario:
    seed: int
    layout: str
    model: str
    data: str
    pipeline: str
    grad_accum: int
    ema: bool
    clip_grad: float | None
    channels_last: bool
    mixed_precision: str
    checkpoint_every: int
    start: str
    # [{"fault", "event", "at": fraction of the run, "rank", "node"}]
    faults: list = field(default_factory=list)
    recipe: str = "none"  # a key of RECIPES

    @property
    def ranks(self) -> int:
        per, machines, _ = LAYOUTS[self.layout]
        return per * machines

    def describe(self) -> str:
        f = " then ".join(f"{x['fault']}@{x['event']}" for x in self.faults)
        return (
            f"{self.layout} {self.model} {self.data}/{self.pipeline}"
            f" accum{self.grad_accum}{' ema' if self.ema else ''}"
            f"{' clip' if self.clip_grad else ''}{' cl' if self.channels_last else ''}"
            f" {self.mixed_precision} ckpt{self.checkpoint_every}"
            f" {self.start}{'' if self.recipe == 'none' else ' ' + self.recipe} | {f}"
        )

    def to_json(self) -> dict:
        return asdict(self)


def faults_for(layout: str) -> list[str]:
    per, machines, how = LAYOUTS[layout]
    found = ["kill_rank", "kill_rank", "kill_machine", "kill_launcher", "term", "usr1", "int"]
    if per * machines > 1:
        found += ["stop_rank"]
    if how == "launch.sh":
        found += ["kill_launch_sh"]
    return found


def draw(seed: int, two_hosts: bool = True) -> Scenario:
    r = random.Random(seed)
    layouts = (
        ["launch2"] * 4 + ["launch1"] * 2 + ["accelerate2"] * 2 + (["hosts2"] if two_hosts else [])
    )
    layout = r.choice(layouts)
    model = r.choice(MODELS)
    data = "imagefolder" if model.startswith("test_resnet") and r.random() < 0.3 else "random"
    pipeline = r.choice(["device", "cpu"] + (["cache"] if data == "imagefolder" else []))
    start = r.choice(
        [s for s in STARTS if s != "elastic" or (model in NORM_FREE and layout != "hosts2")]
    )
    scn = Scenario(
        seed,
        layout,
        model,
        data,
        pipeline,
        r.choice([1, 2]),
        r.random() < 0.4,
        r.choice([None, None, 1.0]),
        r.random() < 0.3,
        r.choice(["no", "no", "bf16"]),
        r.choice([2, 3, 5]),
        start,
    )
    n = 2 if r.random() < 0.2 else 1
    for i in range(n):
        fault = r.choice(faults_for(layout))
        event = (
            r.choice(EVENTS)
            if i == 0
            else (
                "survivor" if scn.faults[0]["fault"] == "kill_rank" and r.random() < 0.5 else "step"
            )
        )
        scn.faults.append(
            {
                "fault": fault,
                "event": event,
                "at": round(r.uniform(0.1, 0.9), 3),
                "rank": r.randrange(2),
                "node": r.randrange(LAYOUTS[layout][1]),
            }
        )
    scn.recipe = r.choice(recipes_for(scn))
    return scn


def recipes_for(scn: Scenario) -> list[str]:
    """The recipes the scenario's model, data and pipeline can run ('none' twice: most scenarios
    stay plain)."""
    # (an elastic resume is exact only where no draw depends on the process count: mixup pairs
    # samples within a process's batch, drop path draws per rank)
    elastic = scn.start == "elastic"
    found = ["none", "none"] + ([] if elastic else ["mix"])
    if scn.model.startswith("test_resnet"):
        found += [r for r in TIMM_ONLY if not (elastic and r == "adamw")]
        if scn.data == "imagefolder" and scn.pipeline != "device":
            found += ["photos", "photos"]
    return found


def trainer_flags(scn: Scenario, ranks: int | None = None) -> list[str]:
    """The trainer's flags of the scenario's run (the reference run's too), for `ranks`
    processes."""
    ranks = ranks or scn.ranks
    args = [
        "--epochs",
        "2",
        "--batch_size",
        str(GLOBAL_BATCH // ranks),
        "--log_every",
        "1",
        "--checkpoint_every",
        str(scn.checkpoint_every),
        "--keep_checkpoints",
        "3",
        "--test_samples",
        "16",
        "--grad_accum",
        str(scn.grad_accum),
        "--mixed_precision",
        scn.mixed_precision,
        "--channels_last",
        "true" if scn.channels_last else "false",
    ]
    if scn.model == "test_resnet":
        args += ["--model", "test_resnet"]
    elif scn.model == "test_resnet_gn":
        args += ["--model", "test_resnet", "--model_kwargs", '{"norm_layer": "groupnorm1"}']
    elif scn.model == "own":
        args += ["--model", "tests_pkg.mod:build"]
    if scn.model != "script":
        args += ["--pipeline", scn.pipeline]
        args += (
            ["--data", "imagefolder"]
            if scn.data == "imagefolder"
            else ["--data", "random", "--train_samples", "256"]
        )
    if scn.mixed_precision == "bf16":  # (a CPU without native bf16 refuses it otherwise)
        args += ["--force_precision"]
    if scn.ema:
        args += ["--ema", "true"]
    if scn.clip_grad:
        args += ["--clip_grad", str(scn.clip_grad)]
    return args + RECIPES[scn.recipe]


def reference_key(scn: Scenario) -> str:
    """Scenarios with the same flags and the same machines share one uninterrupted run."""
    per, machines, _ = LAYOUTS[scn.layout]
    text = json.dumps([trainer_flags(scn), scn.model, per * machines, machines])
    return hashlib.sha1(text.encode()).hexdigest()[:12]
