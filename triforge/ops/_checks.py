"""Input validation shared by the public entry points. Every error names the argument."""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, min_ndim: int = 1, ndim=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else tuple(ndim)):
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    from triforge._runtime import INTERPRET

    if not INTERPRET and t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor (kernels are compiled for the GPU), got device {t.device}")
    if INTERPRET and t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a CPU tensor when kernels run through Triton's interpreter, got device {t.device}"
        )


def check_same_device(**tensors) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}; they must share a device")


def check_same_shape(**tensors) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{n} must have the same shape as {first_name} {tuple(first.shape)}, got {tuple(t.shape)}"
            )


def check_same_dtype(**tensors) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{n} must have the same dtype as {first_name} ({first.dtype}), got {t.dtype}")


MAX_ROW_WIDTH = 65536


def check_row_width(name: str, n: int, limit: int = MAX_ROW_WIDTH) -> None:
    if n > limit:
        raise ValueError(f"{name} has a last dimension of {n}; this kernel supports widths up to {limit}")
