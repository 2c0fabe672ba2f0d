"""The survivor save's copy of the training state into host memory, without a collective and without
waiting on the training stream (docs/failures.md: why, and the PyTorch and torch_npu sources it
rests on).

On CUDA and NPU the host runs ahead of the device: DDP's gradient all-reduce never blocks the host
(its future is marked complete when the collective is queued: ProcessGroupNCCL WorkNCCL::getFuture,
nccl2 and stock alike), so when a collective hangs, the host has already queued the step's optimizer
update, and often more, behind it on the training stream. While the collective is stuck, device
memory holds the state of the last step whose kernels ran before it, and a copy on another stream
reads exactly that. Once the communicator is aborted (the NCCL watchdog at the collective timeout
under TORCH_NCCL_ASYNC_ERROR_HANDLING=2), the stuck kernel ends early and everything queued behind
it runs on a partly reduced gradient: the device state then belongs to no step. On CPU (gloo) the
collective runs in the calling thread and nothing is queued behind it.
"""

from __future__ import annotations

import threading

import torch

# a copy of a few GB at PCIe speed takes seconds; past this the device itself is not answering
COPY_TIMEOUT_S = 60.0


class DeviceCopyTimeout(RuntimeError):
    """The device did not finish the copy within the timeout: it is hung or faulted (an Xid, an ECC
    error, a kernel that never ends); nothing can be read from it."""


def state_to_host(state, timeout_s: float = COPY_TIMEOUT_S):
    """`state` (nested dicts, lists and tuples of tensors and plain values: a model's or an
    optimizer's state_dict, an EMA's, a GradScaler's) with every tensor copied into host memory; the
    structure and every other value as they are. The survivor save writes what this returns.

    Contract:
    - No collective call, and no wait on any stream the training thread used: each device's tensors
      are copied by `tensor.to("cpu")` with a fresh stream of that device as the current one
      (torch.Stream: a pool stream, created non-blocking, so it does not wait for the default
      stream), which waits for that stream alone. Into pageable memory: a page-locked allocation may
      wait for all work in flight on the device (CUDA C Programming Guide, "Implicit
      Synchronization"). The copies run in a helper thread, awaited for at most `timeout_s`, then
      DeviceCopyTimeout (the thread is left behind: a daemon). So it returns while the training
      stream still holds a stuck collective.
    - It copies what device memory holds at that moment. The caller must know which step that is: on
      CUDA/NPU it is the last step whose kernels all ran before the first failed collective (when
      the communicator has not been aborted yet), which can be earlier than the host's last
      completed step; after the abort it is no step at all (see the module's docstring). A value
      that the training stream itself updates once per step (a step counter tensor in the state)
      copied along says which step it is; the host's own count does not.
    - Host tensors are cloned (detached), so the result does not change when training code later
      mutates them. Every copy is contiguous (safetensors writes no other layout; channels_last
      weights are not).
    """
    done: dict = {}

    def copy():
        try:
            done["state"] = _copy(state, {})
        except BaseException as e:  # raised in the caller's thread below
            done["error"] = e

    worker = threading.Thread(target=copy, name="accel_train-state-to-host", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DeviceCopyTimeout(
            "copying the training state off the device did not finish within "
            f"{timeout_s:g} s: the device is not answering"
        )
    if "error" in done:
        raise done["error"]
    return done["state"]


def to_host(tensor: torch.Tensor, timeout_s: float = COPY_TIMEOUT_S) -> torch.Tensor:
    """One tensor, as state_to_host copies it."""
    return state_to_host(tensor, timeout_s)


def _copy(value, streams: dict):
    if isinstance(value, torch.Tensor):
        if _on_host(value):
            return value.detach().clone(memory_format=torch.contiguous_format)
        device = value.device
        stream = streams.get(device) or streams.setdefault(device, torch.Stream(device=device))
        # this thread's current stream of `device` while the copy is queued and awaited
        with stream:
            return _device_to_host(value)
    if isinstance(value, dict):
        return type(value)((k, _copy(v, streams)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_copy(v, streams) for v in value]
        # (a namedtuple: by field)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _device_to_host(tensor: torch.Tensor) -> torch.Tensor:
    # on the current stream, then a wait for that stream; contiguous (safetensors' need:
    # channels_last weights are not)
    return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
