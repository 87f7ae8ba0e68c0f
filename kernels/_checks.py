"""Argument checks shared by the kernel wrappers: each raises ValueError naming the argument."""

from __future__ import annotations

import torch


def check_tensor(name: str, t, dims: int | None = None, dtypes=None, device=None,
                 contiguous: bool = True, last_contiguous: bool = False) -> None:
    """Raise ValueError unless `t` is a tensor of `dims` dims, one of `dtypes`, on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {t.dtype} not allowed (allowed: {allowed})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous())")
    if last_contiguous and t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, got stride {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape) -> None:
    """`shape` entries of None match any size."""
    ok = t.dim() == len(shape) and all(s is None or s == a for s, a in zip(shape, t.shape))
    if not ok:
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def check_rows(tensors, shape, dtype: torch.dtype, device) -> None:
    """Each `(name, tensor)` of `tensors` is contiguous, of `dtype`, on `device`, of `shape`."""
    for name, t in tensors:
        check_tensor(name, t, dims=len(shape), dtypes=(dtype,), device=device)
        check_shape(name, t, shape)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
