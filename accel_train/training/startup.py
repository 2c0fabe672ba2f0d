"""Start-up, in phases: every input is checked before anything is written, the ranks agree on one
resume decision, then the model, optimizer and loaders are built, prepared and resumed. `setup(cfg)`
returns the `Run` the loop (loop.py) trains.

Order matters for reproducibility: the seed is set before the data and the model are built (the
seedable sampler and the model's initialisation draw from it), and --compile happens in prepare(),
after the DDP wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object, set_seed
from timm.utils import ModelEmaV3

from .. import __version__
from ..checkpoint.changes import log_changes, schedule_changed, settings
from ..checkpoint.checkpointer import TrainState, load_checkpoint, load_ema, read_history
from ..checkpoint.output_dir import check_output_dir_free, hold_output_dir, start_branch
from ..checkpoint.resume import Decision, batches_done, check_data, decide, reconcile
from ..config.defaults import dropped_note
from ..config.recipes import RECIPE_FLAGS
from ..config.resolved import NOTHING_TAKEN, Resolved, Taken, with_values
from ..config.train_config import TrainConfig
from ..data import Data, build_data, device_budget, given_data
from ..data.info import listed
from ..errors import ConfigError
from ..exits import clear_notes
from ..files import CONFIG_FILE
from ..hang import PROGRESS
from ..lines import counted
from ..model import pretrained
from ..model.create import (
    bare_model,
    cifar_stem_fits,
    create_model,
    fixed_input_size,
    init_model_code,
    init_normalisation,
    init_stem,
    load_init_weights,
    wrappers,
)
from ..model.freeze import freeze
from ..model.own_model import Given, check_forward, rebuild_problem, unused_parameters
from ..platform.accelerator import make_accelerator, prepare_output_dir, tracker_config
from ..platform.hardware import channels_last_default
from ..platform.ranks import main_process_writes, on_every_rank, rank0s, said_once, same_everywhere
from ..precision.check import check_run_precision, first_batch
from ..resilience.preempt import checkpoint_interval_text, pending_stop
from .metrics import check_trackers, tracker_init_kwargs
from .optim import (
    build_optimizer,
    check_mixing,
    mixing,
    recipe_line,
    schedule,
)
from .optim import (
    criterion as loss_of,
)

logger = get_logger("accel_train")


@dataclass
class Run:
    """Everything the loop needs, built and prepared; `state` is where training resumes."""

    accelerator: Accelerator
    data: Data
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_loader: object
    test_loader: object
    criterion: torch.nn.Module
    ema: ModelEmaV3 | None
    state: TrainState
    steps_per_epoch: int
    total_steps: int
    decision: Decision  # who writes checkpoints, where training resumed from
    config: TrainConfig  # the run's settings: what was asked, with what start-up resolved
    resolved: Resolved  # what start-up decided (config.yaml records it beside what was asked)
    # what the run computes, recorded in every checkpoint (a resume checks it)
    run_math: dict
    history: dict | None  # metrics rows of the checkpoint resumed from
    # what model_config.json records: None for a model no import path rebuilds
    architecture: str | None
    # timm's Mixup (--mixup/--cutmix): (x, labels) -> (mixed x, soft targets), or None
    mixup: object = None

    @property
    def precision(self) -> str:
        """The autocast precision the run trains in (no | fp16 | bf16), after the start-up check."""
        return self.accelerator.mixed_precision

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank and epoch: whole accumulation windows only (the rest is
        dropped)."""
        return self.steps_per_epoch * self.accelerator.gradient_accumulation_steps

    @property
    def whole_epochs(self) -> int:
        """Epochs whose every step is done (not one that a --max_steps stop cut short)."""
        return self.state.epoch + (self.state.batch_in_epoch >= self.batches_per_epoch)

    @property
    def done(self) -> bool:
        """Every epoch trained and evaluated, or --max_steps reached (an epoch whose steps are all
        done but whose evaluation was interrupted is not done: it is evaluated first)."""
        state = self.state
        return state.epoch >= self.run_math["epochs"] or (
            state.step >= self.total_steps and state.batch_in_epoch < self.batches_per_epoch
        )


def setup(asked: TrainConfig, given: Given | None = None, taken: Taken = NOTHING_TAKEN) -> Run:
    """`asked`: the run's TrainConfig, only read: each phase returns what it decides and the run's
    settings are a new config with it (Run.config; the record: Run.resolved). `given`: the model and
    Datasets a script passed to accel_train.train() (api.py), else None. `taken`: what the command
    line took from the record of the run a resume continues (cli.py)."""
    PROGRESS.mark("start-up: the Accelerator and its process group")
    accelerator = make_accelerator(asked)
    log = partial(logger.info, main_process_only=not asked.log_all_ranks)
    cfg, decision = agree_on_start(asked, accelerator, log, taken)
    PROGRESS.mark("start-up: the data")
    data, cfg, resolved = load_inputs(cfg, accelerator, decision, log, given or Given())
    PROGRESS.mark("start-up: the model")
    model, optimizer, loaded, architecture = build_model(
        cfg, accelerator, data, given or Given(), decision, log
    )
    # timm's Mixup (--mixup/--cutmix), or None
    mixup = mixing(cfg.mixup, cfg.cutmix, cfg.label_smoothing, data.info.num_classes)
    # the reduced precision computes right here (on hard labels, whatever the run's loss: the
    # kernels are what it checks)
    PROGRESS.mark("start-up: the precision check")
    check_run_precision(cfg, accelerator, data, model, loss_of(cfg.label_smoothing), log)
    cfg = with_values(cfg, {"mixed_precision": accelerator.mixed_precision})  # (the check's)
    PROGRESS.mark("start-up: accelerator.prepare")
    # (--compile happens here, last)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, data.train_loader, data.test_loader
    )
    # An epoch is a whole number of accumulation windows: a partial window at the end would take an
    # optimizer step on fewer micro-batches at the same 1/grad_accum scale, so its micro-batches are
    # dropped (as drop_last drops an incomplete batch).
    steps_per_epoch = len(train_loader) // cfg.grad_accum
    scheduler = schedule(cfg, optimizer, accelerator.num_processes, steps_per_epoch)
    PROGRESS.mark("start-up: the resume")
    state, history, ema = resume(cfg, accelerator, decision, model, scheduler, log)
    PROGRESS.mark("start-up: the outputs", state.step)
    total_steps = min(cfg.max_steps or steps_per_epoch * cfg.epochs, steps_per_epoch * cfg.epochs)
    criterion = loss_of(cfg.label_smoothing, soft=mixup is not None)
    run = Run(
        accelerator,
        data,
        model,
        optimizer,
        scheduler,
        train_loader,
        test_loader,
        criterion,
        ema,
        state,
        steps_per_epoch,
        total_steps,
        decision,
        cfg,
        Resolved.of(cfg, asked, [taken.said] if taken.said else []),
        run_math(cfg, accelerator, decision, data),
        history,
        architecture,
        mixup,
    )
    announce(run, cfg, resolved, loaded, log)
    if cfg.log_with:  # after every input check: a failed start leaves no new files behind
        # on the main process only
        accelerator.init_trackers(
            cfg.tracker_project,
            config=tracker_config(cfg),
            init_kwargs=tracker_init_kwargs(cfg.trackers(), state.step, cfg.run_name),
        )
        check_trackers(accelerator, cfg.trackers())  # checked there, the verdict sent to every rank
    # every input is checked by now
    on_every_rank(accelerator, start_branch, cfg.output_dir, decision, cfg.resume == "auto")
    # the run's flags as resolved, from its start (a run stopped by Ctrl-C has a config.yaml to
    # replay); the end writes it again, with the precision used: until then the precision as asked,
    # which a resume of a stopped run checks again
    main_process_writes(
        accelerator,
        partial(
            cfg.save_yaml,
            Path(cfg.output_dir) / CONFIG_FILE,
            run.resolved.asked,
            model=architecture,
            mixed_precision=asked.mixed_precision,
        ),
        cfg.output_dir,
    )
    return run


def agree_on_start(
    cfg: TrainConfig, accelerator, log, taken: Taken
) -> tuple[TrainConfig, Decision]:
    """The memory format, a writable --output_dir on every rank, and one resume decision (flags
    agree, who writes, which checkpoint, copied to machines that lack it; a resume that would change
    the run refused). Returns the run's settings with what it decided, and the decision."""
    if taken.said:  # what the command line took from the run (cli.py)
        log(taken.said)
    # the memory format where it is measured faster (hardware.channels_last_default)
    if cfg.channels_last is None:
        channels_last, why = channels_last_default(accelerator.device_facts.kind)
        cfg = with_values(cfg, {"channels_last": channels_last})
        log(f"memory format {why}")
    # weights of a model built by code
    if cfg.init_from:
        code, said = on_every_rank(accelerator, init_model_code, cfg)
        cfg = with_values(cfg, code)
        if said:
            log(said)
    out = on_every_rank(accelerator, prepare_output_dir, cfg.output_dir)
    # (rank 0 alone: the machines of one job may share the directory, and two looks at once would
    # see each other)
    on_every_rank(accelerator, lambda: accelerator.is_main_process and check_output_dir_free(out))
    with said_once(accelerator):
        decision = decide(accelerator, cfg, out, log, taken.settings)
        cfg = with_values(cfg, decision.adopted)  # (another machine's record of the run)
        # one job writes it at a time
        on_every_rank(accelerator, lambda: decision.writer and hold_output_dir(out))
        # (earlier runs' notes)
        on_every_rank(accelerator, lambda: decision.writer and clear_notes(out))
        if decision.meta:
            # the checkpoint's run math, and the per-process batch it derives
            cfg = with_values(cfg, reconcile(decision.meta, cfg, accelerator.num_processes, log))
    return cfg, decision


def load_inputs(
    cfg: TrainConfig, accelerator, decision: Decision, log, given: Given
) -> tuple[Data, TrainConfig, str]:
    """The data (the same on every machine, enough for one batch per rank) and the defaults it
    resolves: image size, stem, mean/std, pipeline. Returns the data, the run's settings with what
    was resolved, and the line saying it."""
    set_seed(cfg.seed)  # before prepare: the seedable sampler takes its seed from here
    batch_given = cfg.batch_size is not None  # (resolve() fills in an automatic one from the data)
    # rank 0's: one pipeline choice
    budget = rank0s(device_budget(cfg.device_data_mb, accelerator.device))
    timms_weights = pretrained.wanted(cfg.pretrained, cfg.pretrained_path)
    # timm's weights: on disk (or allowed to download), first
    if timms_weights and not decision.meta:
        log(
            on_every_rank(
                accelerator, pretrained.check_on_disk, cfg.model, cfg.pretrained_path, cfg.init_from
            )
        )
    # fine-tuning keeps the weights' normalisation: --init_from's record of it, or timm's
    # pretrained_cfg
    if (cfg.init_from or timms_weights) and (cfg.mean is None or cfg.std is None):
        mean, std, source = (
            on_every_rank(accelerator, init_normalisation, cfg.init_from, cfg.model)
            if cfg.init_from
            else (*pretrained.normalisation(cfg.model)[:2], f"timm's pretrained_cfg of {cfg.model}")
        )
        if mean is not None:
            cfg = with_values(
                cfg,
                {
                    "mean": cfg.mean or ",".join(map(str, mean)),
                    "std": cfg.std or ",".join(map(str, std)),
                },
            )
            log(
                f"{'--init_from' if cfg.init_from else '--pretrained'}: mean/std "
                f"{cfg.mean} / {cfg.std} from {source} (pass --mean/--std to override)"
            )
    if given.train_set is not None:  # a script's own Datasets (api.train)
        data = on_every_rank(
            accelerator, given_data, cfg, given, accelerator.device, accelerator.num_processes
        )
    else:
        data = on_every_rank(
            accelerator,
            build_data,
            cfg,
            accelerator.device,
            budget=budget,
            processes=accelerator.num_processes,
            should_stop=pending_stop,
        )
        if (stats := rank0s((data.info.mean, data.info.std))) != (data.info.mean, data.info.std):
            # (a rank whose machine was writing the decoded cache took a sample's)
            data.set_normalisation(*stats)
    # fine-tuning keeps the weights' stem
    if cfg.stem == "auto" and (
        stem := (
            init_stem(cfg.init_from) if cfg.init_from else "imagenet" if timms_weights else None
        )
    ):
        cfg = with_values(cfg, {"stem": stem})
        log(
            f"{'--init_from' if cfg.init_from else '--pretrained'}: stem {cfg.stem}, "
            "as the weights were trained (pass --stem to override)"
        )
    # image size, stem, mean/std, pipeline, batch
    values, resolved = cfg.resolve(
        data.info,
        data.pipeline,
        cifar_stem_fits(cfg.model),
        data.train_size,
        accelerator.num_processes,
    )
    cfg = with_values(cfg, values)
    same_everywhere(
        accelerator,
        "the data (training / test samples, classes)",
        (data.train_size, data.test_size, data.info.classes),
    )
    with said_once(accelerator):
        check_mixing(cfg.mixup, cfg.cutmix, cfg.batch_size)
        if decision.meta:
            check_data(decision.meta, data.train_size, data.info.classes, decision.resume_from)
        if data.train_size < cfg.batch_size * accelerator.num_processes:
            raise ConfigError(
                f"{data.train_size} training samples cannot fill one batch of "
                f"{cfg.batch_size} on each of {accelerator.num_processes} processes; "
                "lower --batch_size or add data"
            )
        # per process and epoch
        batches = data.train_size // (cfg.batch_size * accelerator.num_processes)
        if batches < cfg.grad_accum:
            raise ConfigError(
                f"--grad_accum {cfg.grad_accum} needs {cfg.grad_accum} batches per "
                f"process and epoch, but there are {batches}; lower --grad_accum or "
                "--batch_size, or add data"
            )
    if (
        not decision.meta
        and batch_given
        and (
            note := dropped_note(
                cfg.batch_size, cfg.grad_accum, data.train_size, accelerator.num_processes
            )
        )
    ):
        logger.warning(note)  # a given --batch_size that leaves much of the data out of every epoch
    return data, cfg, resolved


def build_model(cfg: TrainConfig, accelerator, data: Data, given: Given, decision: Decision, log):
    """The model (timm's, or yours: --model module.path:callable or given to train(); --pretrained's
    or --init_from's weights loaded (not on resume: the checkpoint's win), --freeze applied, in the
    run's memory format), checked on one batch on every rank, and its optimizer (--opt) over the
    parameters that train."""
    model = on_every_rank(
        accelerator,
        create_model,
        cfg.model,
        cfg.stem,
        data.info.num_classes,
        cfg.image_size,
        factory=given.model,
        **model_extras(cfg, decision),
    )
    if (
        fixed_input_size(cfg.model) not in (None, cfg.image_size)
        and "img_size" not in cfg.model_kwargs_dict()
    ):
        logger.info(
            f"{cfg.model} is built for {fixed_input_size(cfg.model)} px: "
            f"img_size={cfg.image_size} passed to timm.create_model"
        )
    loaded = (
        on_every_rank(accelerator, load_init_weights, model, cfg.init_from)
        if cfg.init_from
        else None
    )
    if cfg.freeze:
        log(on_every_rank(accelerator, freeze, model, cfg.freeze))
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # logits (N, classes) before the first step
    x, _ = first_batch(data, min(2, cfg.batch_size), accelerator.device)
    on_every_rank(accelerator, check_forward, model, x, data.info.num_classes, cfg.model)
    # DDP reduces every trained parameter's gradient: one that gets none stalls it
    if accelerator.num_processes > 1:
        unused = sorted(
            {n for names in gather_object([unused_parameters(model, x)]) for n in names}
        )
        if unused:
            # (read by prepare(): Accelerate's DDP kwargs)
            accelerator.ddp_handler.find_unused_parameters = True
            names = ", ".join(unused[:4]) + (", ..." if len(unused) > 4 else "")
            verb = "gets" if len(unused) == 1 else "get"
            logger.info(
                f"{counted(len(unused), 'trained parameter')} ({names}) {verb} no gradient "
                "on a batch: DDP looks for unused parameters every step "
                "(find_unused_parameters, a little slower; freeze or remove them to train "
                "without it)"
            )
    optimizer = on_every_rank(accelerator, build_optimizer, cfg, model, accelerator.num_processes)
    return model, optimizer, loaded, recorded_architecture(cfg, accelerator, data, given, model, x)


def model_extras(cfg: TrainConfig, decision: Decision) -> dict:
    """timm.create_model's arguments beyond the name: --model_kwargs, --drop_path / --drop_rate
    (where given: a model that takes none still builds without them), --pretrained's (a fresh start
    only)."""
    kwargs = cfg.model_kwargs_dict()
    for flag, key in (("drop_path", "drop_path_rate"), ("drop_rate", "drop_rate")):
        if getattr(cfg, flag) and key in kwargs:
            raise ConfigError(f"--{flag} and --model_kwargs' {key} both set it: pass one")
        kwargs.update({key: getattr(cfg, flag)} if getattr(cfg, flag) else {})
    return {
        **kwargs,
        **(
            pretrained.create_kwargs(cfg.pretrained, cfg.pretrained_path)
            if not decision.meta
            else {}
        ),
    }


def recorded_architecture(
    cfg: TrainConfig, accelerator, data: Data, given: Given, model, x
) -> str | None:
    """The import path model_config.json records: --model's; for a module or factory given to
    train() its own (user.name_of) only if that rebuilds it (user.rebuild_problem, checked by the
    main process), else None and one line saying so (evaluate and predict then need the model
    named)."""
    if given.model is None:
        return cfg.model
    rebuild = partial(
        create_model,
        cfg.model,
        cfg.stem,
        data.info.num_classes,
        cfg.image_size,
        **cfg.model_kwargs_dict(),
    )
    problem = rank0s(rebuild_problem(model, rebuild, x) if accelerator.is_main_process else None)
    if problem:
        logger.warning(
            "model_config.json records no architecture: the model given to train() is "
            f"not rebuilt by its import path {cfg.model} with model_kwargs "
            f"{cfg.model_kwargs_dict()} ({problem}); "
            "evaluate and predict need --model naming code that builds it"
        )
    return None if problem else cfg.model


def resume(cfg: TrainConfig, accelerator, decision: Decision, model, scheduler, log):
    """Where training starts (a checkpoint's step and batches into its epoch, or step 0), the
    metrics rows the checkpoint carries, and the EMA: from the weights training continues from, then
    the checkpoint's if it has one."""
    state, history = TrainState(run_id=decision.run_id), None
    if decision.resume_from:
        state = load_checkpoint(accelerator, decision.resume_from)
        state.batch_in_epoch = batches_done(
            decision.meta, cfg.batch_size, accelerator.num_processes
        )
        history = read_history(decision.resume_from)
        # momentum, weight decay, ...: the flags'
        log_changes(decision.meta, cfg, accelerator.mixed_precision, log)
        # (the curves draw the lr before it from steps.jsonl)
        if schedule_changed(decision.meta, cfg):
            state.schedule_since = state.step
    scheduler.step_update(state.step)
    ema = (
        ModelEmaV3(bare_model(accelerator, model), decay=cfg.ema_decay, use_warmup=True)
        if cfg.ema
        else None
    )
    if ema is not None and decision.resume_from and not load_ema(ema, decision.resume_from):
        log(f"{decision.resume_from} has no EMA weights: the EMA starts from the resumed weights")
    return state, history, ema


def run_math(cfg: TrainConfig, accelerator, decision: Decision, data: Data) -> dict:
    """What the run computes (recorded in every checkpoint as "run"): a resume that would change it
    is refused, except the per-process batch and the process count, which elastic resume derives
    (resume.reconcile)."""
    return dict(
        global_batch=cfg.batch_size * accelerator.num_processes * cfg.grad_accum,
        batch_size=cfg.batch_size,
        num_processes=accelerator.num_processes,
        num_machines=decision.num_machines,
        grad_accum=cfg.grad_accum,
        epochs=cfg.epochs,
        seed=cfg.seed,
        model=cfg.model,
        stem=cfg.stem,
        model_kwargs=cfg.model_kwargs_dict(),
        data=cfg.data,
        train_size=data.train_size,
        image_size=cfg.image_size,
        mean=listed(data.info.mean),
        std=listed(data.info.std),
        augment=cfg.augment,
        hflip=cfg.hflip,
        freeze=cfg.freeze,
        val_split=cfg.val_split,
        settings=settings(cfg, accelerator.mixed_precision),
        **{key: getattr(cfg, key) for key in RECIPE_FLAGS},
    )


def announce(run: Run, cfg: TrainConfig, resolved: str, loaded: str | None, log) -> None:
    accelerator, decision, state = run.accelerator, run.decision, run.state
    if decision.resume_from:
        log(
            f"resumed from {decision.resume_from}: epoch {state.epoch + 1}, step {state.step}, "
            f"{state.batch_in_epoch} batches into the epoch"
        )
    log(
        f"accel_train {__version__}: {cfg.model} ({cfg.stem} stem) on {run.data.info.name}, "
        f"{run.data.train_size} train / {run.data.test_size} test samples, "
        f"{accelerator.num_processes} process(es) [{accelerator.distributed_type}, "
        f"{accelerator.mixed_precision}] on {decision.num_machines} machine(s), "
        f"global batch {run.run_math['global_batch']}, "
        f"peak lr {cfg.peak_lr(accelerator.num_processes):.4g}, "
        f"{counted(run.steps_per_epoch, 'step')}/epoch, model {wrappers(run.model)}; checkpoints: "
        + (
            "one copy in the shared output dir"
            if decision.shared
            else "a whole copy on each machine's disk"
        )
        + f", {checkpoint_interval_text(cfg.checkpoint_minutes)}"
    )
    log(recipe_line(cfg, accelerator.num_processes, run.mixup is not None))
    log(run.data.describe())
    log(resolved)
    if loaded:
        log(loaded)
