"""The start-up check of a reduced precision: before the first step, on one real batch (or a slice
of it: CHECK_BATCH) and on each layer alone, every parameter's gradient under the run's autocast
precision is compared with the fp32 one. A kernel that computes wrong gradients for the run's shapes
(bf16 autocast on some x86 CPUs: a 3x3/stride-2 convolution whose input is 1x1 leaves its
padding-only weight taps holding whatever was in memory, up to 6e32 or inf) fails it. docs/speed.md:
Precision.

The bound. A layer that rounds its inputs to a precision with unit roundoff u (bf16: 8 significant
bits, u = 2^-8; fp16: 11 bits, u = 2^-11) and accumulates in fp32 computes a dot product with a
relative error of at most 2u, to first order (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1, both factors rounded once; fp32's own error is ~1e-7 and left out). The gradient of
a parameter passes back through at most L such layers (L: the model's convolutions and linear
layers), so its relative error is at most 2(L + 1)u to first order when nothing cancels. Sums that
cancel (a BatchNorm bias's gradient) were measured up to 2.2x that (timm test_resnet, bf16; resnet18
0.16 against 0.17, resnet50 0.26 against 0.43): a parameter fails where its error is over MARGIN x
the first-order bound, and in any case over 1.0 (an error as large as the gradient itself is never
rounding), or not finite. A wrong kernel's error was 1e37.

"""

from __future__ import annotations

import contextlib
import copy
import resource
import time
from functools import partial

import torch
from accelerate.utils import gather_object, send_to_device

from ..errors import ConfigError
from ..platform.accelerator import fall_back_to_fp32
from ..platform.hardware import NAMES
from ..platform.ranks import said_once
from .cache import cache_key, cached, remember
from .verdict import Verdict, combine, wrong_text

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LAYERS = (torch.nn.modules.conv._ConvNd, torch.nn.Linear)  # the layers that round their inputs
MARGIN = 8  # x the first-order bound: cancellation measured up to 2.2x
# fp16 gradients are taken on a scaled loss (as the run's GradScaler does), then unscaled
FP16_LOSS_SCALE = 2.0**10
# reduced-precision passes of the model per check; of each layer alone, LAYER_REPEATS, on at most
# LAYER_BATCH samples (a wrong kernel's garbage showed in all 3 of 3 passes of the layer alone, 12
# of 12 checks on a Xeon; on an AMD EPYC in 8 of 12 passes, so 3 miss it about 1 check in 30 and 6
# miss ~1 in 700)
REPEATS = 1
LAYER_REPEATS = 6
LAYER_BATCH = 32
# the model is checked on a slice of the run's batch: all of it up to CHECK_BATCH, else a quarter
# (at least CHECK_BATCH): the fp32 pass's activations then weigh about what the step's bf16 ones do
CHECK_BATCH = 32
MIN_CHECK_BATCH = 8  # out of memory, the check is retried on half its slice, down to this
# a failure whose errors are all under this (x the gradient), with every layer alone right, is the
# batch's conditioning amplifying rounding (resnet18, 32 px, batch 2: 1.2); a wrong kernel's: 1e15+,
# inf or all zero
AMPLIFIED = 10.0
# a gradient under FLOOR x the largest one is judged against that floor: a sum that cancels to near
# 0 (a convolution's bias before BatchNorm: exactly 0) keeps the absolute error of its terms
FLOOR = 1e-2


def depth(model: torch.nn.Module) -> int:
    """The layers that round their inputs on the way back: convolutions and linear layers."""
    return sum(isinstance(m, LAYERS) for m in model.modules())


def bound(precision: str, layers: int) -> float:
    return min(MARGIN * 2 * (layers + 1) * UNIT_ROUNDOFF[precision], 1.0)


def reduced_fp32_flags() -> list[tuple[object, str]]:
    """The switches that let fp32 convolutions and matmuls round their inputs to 10 mantissa bits
    (fp16's): TF32 on NVIDIA from compute capability 8.0 (cuDNN's convolutions by default:
    torch.backends.cudnn.allow_tf32; matmuls: torch.backends.cuda.matmul.allow_tf32, off by default)
    and torch_npu's HF32 (torch.npu.conv.allow_hf32, on by default; torch.npu.matmul.allow_hf32)."""
    npu = getattr(torch, "npu", None)
    return [(torch.backends.cudnn, "allow_tf32"), (torch.backends.cuda.matmul, "allow_tf32")] + [
        (getattr(npu, k), "allow_hf32")
        for k in ("conv", "matmul")
        if hasattr(getattr(npu, k, None), "allow_hf32")
    ]


@contextlib.contextmanager
def exact_fp32():
    """IEEE fp32 inside (every reduced_fp32_flags switch off), the switches restored after: the
    reference of a check of fp16 (11 bits) must not round to 11 bits itself, as TF32 convolutions on
    an A100/H100 do."""
    flags = [(owner, name, getattr(owner, name)) for owner, name in reduced_fp32_flags()]
    try:
        for owner, name, _ in flags:
            setattr(owner, name, False)
        yield
    finally:
        for owner, name, value in flags:
            setattr(owner, name, value)


def gradients(
    model, x, y, criterion, dtype: torch.dtype | None, loss_scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of criterion(model(x), y), under autocast to `dtype` (None: fp32,
    in IEEE fp32 forward and backward: exact_fp32), in fp32."""
    model.zero_grad(set_to_none=True)
    with exact_fp32() if dtype is None else contextlib.nullcontext():
        with (
            torch.random.fork_rng(devices=[]),
            torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None),
        ):
            torch.manual_seed(0)  # the same dropout draws in every pass
            loss = criterion(model(x), y)
        (loss.float() * loss_scale).backward()
    grads = {
        n: p.grad.detach().float() / loss_scale
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return grads


def errors(ref: dict[str, torch.Tensor], low: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: ||low - ref|| / max(||ref||, FLOOR x the largest ||ref||); inf where low is
    not finite, and where low is all zero (or missing) but ref is not under the floor: a kernel that
    writes nothing, never rounding, whatever the bound (its relative error is exactly 1.0, which a
    deep model's capped bound let pass). 0 where both are exactly zero. One host read for all of
    them."""
    names = list(ref)
    low = {n: low.get(n, torch.zeros_like(ref[n])) for n in names}
    ref_norms = torch.stack([ref[n].norm() for n in names])
    diff = torch.stack([(low[n] - ref[n]).norm() for n in names])
    finite = torch.stack([torch.isfinite(low[n]).all() for n in names])
    zero = torch.stack([(low[n] == 0).all() for n in names])
    floor = torch.clamp(ref_norms.max() * FLOOR, min=torch.finfo(torch.float32).tiny)
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / torch.maximum(ref_norms, floor))
    rel = torch.where(
        finite & torch.isfinite(rel) & ~(zero & (ref_norms >= floor)),
        rel,
        torch.full_like(rel, float("inf")),
    )
    return dict(zip(names, rel.tolist()))


def check(model, x, y, criterion, precision: str, repeats: int = REPEATS) -> Verdict:
    """Compare `precision`'s gradients with fp32's on a copy of `model` (its weights, buffers and
    the RNG untouched): the model as the run has it (`repeats` passes), then each layer alone
    (LAYER_REPEATS passes), each parameter keeping its largest error. A kernel that leaves memory
    unwritten returns whatever was there, zero in some passes. (The model is checked with its own
    weights: a zero-initialised BatchNorm weight stops the gradients behind it, but the layers
    behind it are checked alone; a probe with those weights set to 1 was a badly conditioned network
    whose correct bf16 and fp16 gradients erred by over 1.0 on resnet50.)"""
    # (an accelerator's generator is reseeded by every step: loop.reseed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _check(model, x, y, criterion, precision, repeats)


def _check(model, x, y, criterion, precision: str, repeats: int) -> Verdict:
    start = time.perf_counter()
    probe = copy.deepcopy(model).to(x.device).train()
    # each convolution and linear layer that trains, with the shape and memory format of its input
    layers = {}
    hooks = [
        m.register_forward_hook(partial(note_input, layers, name), with_kwargs=True)
        for name, m in probe.named_modules()
        # (frozen: nothing to check)
        if isinstance(m, LAYERS) and any(p.requires_grad for p in m.parameters())
    ]
    ref = gradients(probe, x, y, criterion, None)
    for h in hooks:
        h.remove()
    scale = FP16_LOSS_SCALE if precision == "fp16" else 1.0
    limit = bound(precision, depth(model))
    errs: dict[str, float] = {}
    for _ in range(repeats):
        for n, e in errors(
            ref, gradients(probe, x, y, criterion, DTYPES[precision], scale)
        ).items():
            errs[n] = max(errs.get(n, 0.0), e)
        if any(not e <= limit for e in errs.values()):
            break  # a failure needs no more passes
    alone_right = True
    # each layer alone, judged by one layer's bound
    for n, e in layer_errors(layers, precision, LAYER_REPEATS).items():
        errs[n] = max(errs.get(n, 0.0), e * limit / bound(precision, 1))
        alone_right &= e <= bound(precision, 1)
    del probe
    worst = max(errs.items(), key=lambda kv: kv[1], default=("", 0.0))
    bad = {n: e for n, e in errs.items() if not e <= limit}
    batch = bool(bad) and alone_right and all(e <= AMPLIFIED for e in bad.values())
    return Verdict(
        precision, limit, worst, bad, time.perf_counter() - start, cause="batch" if batch else ""
    )


def note_input(layers: dict, name: str, module, args, kwargs, out) -> None:
    """A forward hook: the shape and strides of a layer's input, its first call's (no activation
    kept), whether it was passed by position or by keyword (`self.fc(input=x)`)."""
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    if x is not None:
        layers.setdefault(name, (module, torch.empty_like(x, device="meta")))


def layer_errors(layers: dict, precision: str, repeats: int) -> dict[str, float]:
    """Each layer alone on a random input of the shape (and memory format) it had in the model, at
    most LAYER_BATCH samples (the kernels' choice depends on the shape; the cost on the batch): a
    wrong kernel's unwritten memory holds garbage far more often there than inside the model's
    backward (measured: 3 of 3 passes against 0 of 5 for some weights, on a wrong kernel's shape),
    since what ran just before differs."""
    errs: dict[str, float] = {}
    seen: dict[tuple, dict[str, float]] = {}
    sum_all = lambda out, _: out.float().sum()  # noqa: E731 (every output's gradient 1)
    for name, (module, inp) in layers.items():
        fmt = (
            torch.channels_last
            if inp.dim() == 4
            and inp.is_contiguous(memory_format=torch.channels_last)
            and not inp.is_contiguous()
            else torch.contiguous_format
        )
        shape = (min(inp.shape[0], LAYER_BATCH), *inp.shape[1:])
        key = (repr(module), shape, fmt, str(module.weight.dtype))
        if key not in seen:
            layer = copy.deepcopy(module)
            xi = torch.randn(shape, device=module.weight.device).contiguous(memory_format=fmt)
            ref, found = gradients(layer, xi, None, sum_all, None), {}
            for _ in range(repeats):
                for n, e in errors(
                    ref, gradients(layer, xi, None, sum_all, DTYPES[precision])
                ).items():
                    found[n] = max(found.get(n, 0.0), e)
            seen[key] = found
        errs.update({f"{name}.{n}": e for n, e in seen[key].items()})
    return errs


def measured(check_once) -> Verdict:
    """check_once()'s verdict with its peak memory over what was in use before: the accelerator's
    allocator's (where torch.accelerator has its counters), else the process's peak resident
    memory's growth."""
    acc = torch.accelerator
    device = hasattr(acc, "max_memory_allocated") and acc.is_available()
    if device:
        acc.reset_peak_memory_stats()
    before = acc.memory_allocated() if device else resident_peak()
    verdict = check_once()
    verdict.memory = float((acc.max_memory_allocated() if device else resident_peak()) - before)
    return verdict


def size_text(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def resident_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)


def out_of_memory(e: Exception) -> bool:
    """The check ran out of memory (torch's OutOfMemoryError; an NPU's RuntimeError says so)."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def first_batch(data, n: int, device):
    """The first n training samples, as the run's pipeline gives them to the model (epoch 0's
    augmentation): one real batch, read by index, so that no sampler or random generator of the run
    moves."""
    loader = data.train_loader
    ds = loader.dataset
    items = (
        ds.__getitems__(list(range(n)))
        if getattr(ds, "__getitems__", None)
        else [ds[i] for i in range(n)]
    )
    return data.inputs(send_to_device(loader.collate_fn(items), device), train=True, epoch=0)


def check_run_precision(cfg, accelerator, data, model, criterion, log) -> None:
    """Before prepare(): check the run's reduced precision on its own model and batch (cached), the
    ranks agreeing. Nothing asked (--mixed_precision auto, or launch.sh's own pick): a failed check
    trains in fp32, said in one line; asked (flag or launcher config): one line, exit 2, unless
    --force_precision."""
    precision = accelerator.mixed_precision
    if precision not in UNIT_ROUNDOFF:
        return
    x, y = first_batch(
        data, min(cfg.batch_size, max(CHECK_BATCH, cfg.batch_size // 4)), accelerator.device
    )
    key = cache_key(cfg, data.info.num_classes, x.shape, precision, accelerator.device_facts, model)
    mine = Verdict.from_json(cached(key))
    while mine is None:
        try:
            mine = measured(partial(check, model, x, y, criterion, precision))
        # (a kernel that raises; out of memory on the smallest slice): every rank stops with this
        # rank's line
        except Exception as e:
            if out_of_memory(e) and len(x) > MIN_CHECK_BATCH:
                # (the verdict stays under the first slice's key)
                x, y = x[: len(x) // 2], y[: len(y) // 2]
                continue
            mine = Verdict(
                precision,
                0.0,
                error=f"rank {accelerator.process_index}: {type(e).__name__}: "
                + " ".join(str(e).split())[:200],
            )
    v = combine(gather_object([mine]))
    with said_once(accelerator):
        if v.error:
            raise ConfigError(
                f"the start-up check of {precision} failed ({v.error}); --mixed_precision no trains"
                " without it"
            )
    if not v.cached:
        # the ranks' verdict, not this rank's: ranks of one machine share the file
        remember(key, v.to_json())
    name, shape = (
        NAMES[precision],
        "x".join(map(str, x.shape))
        + ("" if len(x) == cfg.batch_size else f" slice of the {cfg.batch_size}-sample"),
    )
    cost = (
        "checked on an earlier start (cached)"
        if v.cached
        else f"{v.seconds:.1f} s, peak memory +{size_text(v.memory)}, remembered for later starts"
    )
    if v.ok:
        log(
            f"precision check: {name} gradients match fp32 on a {shape} batch: worst relative error"
            f" {v.worst[1]:.2g} ({v.worst[0]}), bound {v.limit:.2g}; {cost}"
        )
        return
    wrong = wrong_text(v, name, shape, len(x))
    source = accelerator.precision_source
    with said_once(accelerator):
        if cfg.force_precision:
            log(
                f"precision check: warning: {wrong}; training in {name} anyway, as"
                " --force_precision asks"
            )
        elif source:
            raise ConfigError(
                f"{source} asks for {precision}, but {wrong}; use --mixed_precision no, or add "
                f"--force_precision to train in {precision} anyway"
            )
        else:
            fall_back_to_fp32(accelerator)
            log(f"precision fp32, not {name}: {wrong}; {cost}")
