"""The tensor dtypes the store holds, their catalog names and their zarr v3 data types."""

from __future__ import annotations

import torch

from tierstore.errors import CodecError

# catalog name -> (torch dtype, zarr v3 data_type). zarr has no bfloat16: its bits go to disk
# as uint16 and the logical dtype lives in the catalog and in the array's attributes.
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "float32"),
    "float64": (torch.float64, "float64"),
    "bfloat16": (torch.bfloat16, "uint16"),
    "float16": (torch.float16, "float16"),
    "int8": (torch.int8, "int8"),
    "uint8": (torch.uint8, "uint8"),
    "int16": (torch.int16, "int16"),
    "int32": (torch.int32, "int32"),
    "int64": (torch.int64, "int64"),
    "bool": (torch.bool, "bool"),
}
_BY_TORCH = {dt: name for name, (dt, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The catalog name of a torch dtype; CodecError if the store cannot hold it."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise CodecError(
            f"dtype {dtype} is not supported; supported: {', '.join(_DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a catalog name."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise CodecError(f"unknown dtype name {name!r} in stored metadata") from None


def zarr_data_type(dtype: torch.dtype) -> str:
    """The zarr v3 ``data_type`` that holds the bits of ``dtype``."""
    return _DTYPES[dtype_name(dtype)][1]


def zarr_fill_value(dtype: torch.dtype) -> bool | int | float:
    """The zarr fill value used for padding: zero of the stored type."""
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point and dtype != torch.bfloat16 else 0


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's memory (no copy, any dtype, 0-d too)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)
