"""A stand-in accelerator for CPU-only test machines: tensors that compute on the CPU but say they
live on ``cuda:0``, and raise where CUDA would.

The engine's device policy (docs/design.md §2b, "Device policy") cannot be checked by CI without a
GPU: a CPU tensor and a CUDA tensor mixed in one operation crash only on the GPU. Under
:func:`stand_in_device` the following holds, as on CUDA:

- a :class:`StandInTensor` reports ``device == STAND_IN`` (``cuda:0``), ``is_cuda`` True;
- ``.to(STAND_IN)`` / ``.cuda()`` and factory functions with ``device=STAND_IN`` give stand-in
  tensors; results of operations on stand-in tensors are stand-in tensors;
  ``Module.to(STAND_IN)`` turns a model's parameters and buffers into stand-in tensors;
- ``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.item()``, ``int()`` / ``float()`` / ``bool()``
  give plain values (counted in :attr:`StandInMode.host_reads`: each is a device-to-host copy
  that waits for the device; their elements in :attr:`StandInMode.host_elements`, the largest
  in :attr:`StandInMode.largest_read`); ``.numpy()`` raises, as for a CUDA tensor;
- an operation that takes a stand-in tensor and a plain CPU tensor of dimension > 0 raises
  ``RuntimeError: Expected all tensors to be on the same device`` (CPU scalars, 0-dim, are allowed,
  as on CUDA), with CUDA's exceptions: ``copy_`` and slice assignment. CPU index tensors in
  ``x[...]`` / ``x[...] = v`` of a stand-in ``x`` raise too by default (``strict_getitem``): CUDA
  takes them, copying them over behind the caller's back, which the device policy does not allow;
  ``strict_getitem=False`` lets them pass as CUDA does;
- a CPU ``torch.Generator`` used with a stand-in tensor (``multinomial``, ``rand(...,
  device=STAND_IN)``, ``exponential_``, ...) raises, as a CPU generator does with CUDA tensors;
- ``torch.cuda.synchronize`` returns at once (nothing is queued), counted in :attr:`StandInMode.syncs`.

What it does not model: streams, asynchronous execution, memory limits, and CUDA's numerics (it is
the CPU's arithmetic, bit for bit, so outputs can be compared with a plain CPU run exactly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

STAND_IN = torch.device("cuda", 0)
"""The device stand-in tensors report."""

_HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
_NUMPY = {torch.Tensor.numpy, torch.Tensor.__array__}
_CROSS_DEVICE = {torch.Tensor.copy_, torch._has_compatible_shallow_copy_type}  # fine across devices on CUDA
_GETITEM = torch.Tensor.__getitem__
_SETITEM = torch.Tensor.__setitem__


class StandInTensor(torch.Tensor):
    """A CPU tensor that says it is on :data:`STAND_IN`. Its operations are checked by
    :class:`StandInMode` (the subclass itself adds no torch-function handling)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return STAND_IN

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def _is_stand_in_device(device: Any) -> bool:
    if device is None or isinstance(device, int):
        return isinstance(device, int)  # a bare ordinal means a CUDA device in torch's API
    try:
        return torch.device(device).type == STAND_IN.type
    except (RuntimeError, TypeError):
        return False


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, StandInTensor) else t


def _wrap(out: Any) -> Any:
    return tree_map(lambda x: x.as_subclass(StandInTensor) if type(x) is torch.Tensor else x, out)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _mix_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {STAND_IN} and cpu! "
        f"(stand-in device, in {name})"
    )


class StandInMode(TorchFunctionMode):
    """The torch-function mode that gives :class:`StandInTensor` its CUDA-like rules (see the module
    docstring). Use it through :func:`stand_in_device`.

    Attributes:
        host_reads: device-to-host copies so far (``.cpu()``, ``.tolist()``, ``.item()``, ...).
        syncs: ``torch.cuda.synchronize`` calls so far (a no-op here: nothing is queued).
        host_elements: the elements those copies moved.
        largest_read: the most elements one copy moved.
        strict_getitem: refuse CPU index tensors into stand-in tensors (stricter than CUDA,
            which copies them to the device silently; the default of :func:`stand_in_device`).
    """

    def __init__(self, strict_getitem: bool = True) -> None:
        super().__init__()
        self.host_reads = 0
        self.syncs = 0
        self.host_elements = 0
        self.largest_read = 0
        self.strict_getitem = strict_getitem

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._to(func, args, kwargs)
        self_arg = args[0] if args else None
        if func in _HOST_READS and isinstance(self_arg, StandInTensor):
            self._read(self_arg)
            return func(_plain(self_arg), *args[1:], **kwargs)
        if func in _NUMPY and isinstance(self_arg, StandInTensor):
            raise TypeError(
                f"can't convert {STAND_IN} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                "to host memory first. (stand-in device)"
            )
        if func is torch._C._nn._parse_to:  # Module.to's argument parser: the device is only read
            return func(*args, **kwargs)
        factory = _is_stand_in_device(kwargs.get("device"))
        if factory:
            kwargs["device"] = "cpu"
        stand_ins = [t for t in _tensors((args, kwargs)) if isinstance(t, StandInTensor)]
        if not stand_ins and not factory:
            return func(*args, **kwargs)
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type == "cpu":
            raise RuntimeError(f"Expected a '{STAND_IN.type}' device type for generator but found 'cpu' (in {name})")
        self._check_mix(func, name, args, kwargs)
        if func is torch.Tensor.copy_ and not isinstance(self_arg, StandInTensor):
            self._read(args[1])
        return _wrap(func(*args, **kwargs))

    def _read(self, tensor: torch.Tensor) -> None:
        self.host_reads += 1
        self.host_elements += tensor.numel()
        self.largest_read = max(self.largest_read, tensor.numel())

    def _check_mix(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        """Raise where CUDA raises: a plain CPU tensor of dim > 0 next to a stand-in tensor."""
        if func in _CROSS_DEVICE:
            return
        checked: Any = (args, kwargs)
        if func in (_GETITEM, _SETITEM):
            target, index = args[0], args[1]
            value = args[2] if func is _SETITEM else None
            index_tensors = _tensors(index)
            if not isinstance(target, StandInTensor):
                if any(isinstance(t, StandInTensor) for t in index_tensors):
                    raise _mix_error(f"{name}: stand-in indices into a CPU tensor")
                if func is _SETITEM and index_tensors and isinstance(value, StandInTensor):
                    raise _mix_error(f"{name}: a stand-in value put into a CPU tensor at tensor indices")
                if func is _SETITEM and isinstance(value, StandInTensor):
                    self._read(value)  # cpu[slice] = stand-in: a copy to the host
                return
            if self.strict_getitem and any(not isinstance(t, StandInTensor) and t.dim() > 0 for t in index_tensors):
                raise _mix_error(f"{name}: CPU indices into a stand-in tensor (strict)")
            # CUDA takes CPU index tensors (it copies them over); a CPU value at tensor indices it does not
            checked = value if (func is _SETITEM and index_tensors) else None
        for t in _tensors(checked):
            if not isinstance(t, StandInTensor) and t.dim() > 0:
                raise _mix_error(name)

    def _to(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``Tensor.to`` / ``.cuda()`` / ``.cpu()``: stand-in <-> plain, dtype changes kept."""
        tensor, rest = args[0], list(args[1:])
        source_stand_in = isinstance(tensor, StandInTensor)
        if func is torch.Tensor.cpu:
            target: Any = "cpu"
            dtype = None
        elif func is torch.Tensor.cuda:
            target, dtype = STAND_IN, None
        else:
            target = kwargs.pop("device", None)
            dtype = kwargs.pop("dtype", None)
            if rest and isinstance(rest[0], torch.Tensor):  # .to(other): its device and dtype
                other = rest.pop(0)
                target, dtype = other.device, other.dtype
            elif rest and (isinstance(rest[0], (str, torch.device, int))):
                target = rest.pop(0)
            if rest and isinstance(rest[0], torch.dtype):
                dtype = rest.pop(0)
        copy = bool(kwargs.get("copy", False))
        plain = _plain(tensor)
        if dtype is not None:
            plain = plain.to(dtype=dtype, copy=copy)
        elif copy:
            plain = plain.clone()
        if target is None:
            to_stand_in = source_stand_in
        elif _is_stand_in_device(target):
            to_stand_in = True
        elif torch.device(target).type == "cpu":
            to_stand_in = False
        else:
            return func(*args, **kwargs)  # another device (meta): torch's own business
        if source_stand_in and not to_stand_in:
            self._read(tensor)
        return plain.as_subclass(StandInTensor) if to_stand_in else plain


@contextlib.contextmanager
def stand_in_device(strict_getitem: bool = True) -> Iterator[StandInMode]:
    """Run the block with the stand-in device (see the module docstring); yields the mode (its
    ``host_reads`` counter). ``Module.to(STAND_IN)`` inside it replaces the module's parameters by
    stand-in ones (torch's ``overwrite_module_params_on_conversion`` is on for the block)."""
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    synchronize = torch.cuda.synchronize
    try:
        with StandInMode(strict_getitem) as mode:
            torch.cuda.synchronize = lambda device=None: setattr(mode, "syncs", mode.syncs + 1)  # counted, no CUDA
            yield mode
    finally:
        torch.cuda.synchronize = synchronize
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def to_stand_in(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its parameters and buffers on the stand-in device (call inside
    :func:`stand_in_device`); returns the same module."""
    return model.to(STAND_IN)


def is_stand_in(t: Any) -> bool:
    """Whether ``t`` is a stand-in tensor."""
    return isinstance(t, StandInTensor)
