"""The array library a GPU worker computes with, and the device it copies weights to.

Two devices:

* ``cuda``: torch; the host stage is pinned memory, a restore is one
  asynchronous host-to-device copy per GPU of the chunk (one contiguous
  buffer each, so the copy runs at the link's bandwidth).
* ``cpu``: the same worker without a GPU (CI, laptops). A "GPU" is a slice of
  the worker's own memory: a restore copies the staged weights into a fresh
  buffer, requests run the same forward computation on the CPU. It exists to
  test the evict-on-execution path, not to serve models. torch is used when it
  is importable (its CPU build), numpy otherwise, so CI never downloads a CUDA wheel.

Only what the worker needs is wrapped here; the forward pass in ``model.py``
is written once against this interface.

A service's weights are staged as **bytes** (one ``uint8`` buffer) and each tensor
is a typed view of its range (:meth:`NumpyOps.typed`): tensors keep the dtype their
loader gave them (a Hugging Face model loaded in bfloat16 keeps its rotary
frequencies in float32, as transformers does), and a restore is still one contiguous
copy per GPU. The dtype a model computes in is its own (the YAML's ``dtype``, else
the device's default): :meth:`NumpyOps.for_dtype`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

DEVICES = ("cuda", "cpu")
#: bytes per element of the dtypes a service may be given (``model.dtype`` in the YAML)
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


def default_dtype(device: str) -> str:
    """bfloat16 on GPUs (what serving frameworks load); float32 on the cpu device."""
    return "bfloat16" if device == "cuda" else "float32"


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


class NumpyOps:
    """Arrays on the CPU with numpy (float32: numpy has no bfloat16)."""

    name = "numpy"
    device = "cpu"

    def __init__(self, dtype: str | None = None) -> None:
        dtype = dtype or "float32"
        if dtype not in ("float32", "float16"):
            raise ValueError(f"model.dtype {dtype!r}: the cpu device computes with numpy here, "
                             "which has no bfloat16 (pip install torch, or give float32)")
        self.dtype_name = dtype
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize

    def for_dtype(self, dtype: str | None) -> NumpyOps:
        """The same device, computing in ``dtype`` (None: this one's)."""
        return self if dtype in (None, self.dtype_name) else NumpyOps(dtype)

    def stage(self, nbytes: int) -> np.ndarray:
        """A host buffer of ``nbytes`` bytes (tensors are typed views of it)."""
        return np.empty(nbytes, dtype=np.uint8)

    def typed(self, flat: np.ndarray, offset: int, shape: tuple[int, ...], dtype: str
              ) -> np.ndarray:
        """The tensor of ``shape`` and ``dtype`` at byte ``offset`` of a byte buffer."""
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        return flat[offset:offset + n].view(dt).reshape(shape)

    def fill_random(self, buf: np.ndarray, seed: int, std: float) -> None:
        rng = np.random.default_rng(seed)
        step = 1 << 24  # fill in slices: no second full-size temporary
        for lo in range(0, buf.size, step):
            part = buf[lo:lo + step]
            if part.dtype == np.float32:
                rng.standard_normal(part.size, dtype=np.float32, out=part)
            else:
                part[:] = rng.standard_normal(part.size, dtype=np.float32)
            part *= std

    def to_device(self, host: np.ndarray, index: int) -> np.ndarray:
        return host.copy()  # a real copy into the worker's memory: the "device" copy

    def sync(self, index: int) -> None:
        return None

    def same(self, device: Any, host: Any) -> bool:
        return bool(np.array_equal(device, host))

    def shares(self, a: Any, b: Any) -> bool:
        return bool(np.shares_memory(a, b))

    def nbytes(self, buf: Any) -> int:
        return int(buf.nbytes)

    # -- the forward computation's primitives ---------------------------------------------
    def ids(self, rows: list[list[int]], index: int) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64)

    def move(self, x: np.ndarray, index: int) -> np.ndarray:
        return x

    def compute(self, x: Any) -> np.ndarray:
        return x.astype(self.dtype, copy=False)

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        f = x.astype(np.float32)
        return (f / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + 1e-6)).astype(self.dtype) * w

    def take(self, x: Any, rows: list[int]) -> Any:
        """Rows ``rows`` of ``x`` (the batch dimension): a batch drops a cancelled member."""
        return x[rows]

    def silu(self, x: np.ndarray) -> np.ndarray:
        return x / (1.0 + np.exp(-x))

    def softmax(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(self.dtype)

    def log_softmax(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        m = x.max(axis=-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))

    def causal_mask(self, t: int, index: int) -> np.ndarray:
        return np.triu(np.full((t, t), -np.inf if self.itemsize < 4 else -1e30,
                               dtype=self.dtype), k=1)

    def transpose(self, x: np.ndarray, a: int, b: int) -> np.ndarray:
        return np.swapaxes(x, a, b)

    def repeat_heads(self, x: np.ndarray, n: int) -> np.ndarray:
        return np.repeat(x, n, axis=1) if n > 1 else x

    def gather_last(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]

    def tolist(self, x: Any) -> list:
        return np.asarray(x, dtype=np.float64).tolist()


class TorchOps(NumpyOps):
    """torch on ``cuda`` (pinned host stage, per-GPU device copies) or on the CPU."""

    name = "torch"

    def __init__(self, device: str, dtype: str | None = None) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.dtype_name = dtype or default_dtype(device)
        if self.dtype_name not in DTYPE_SIZES:
            raise ValueError(f"model.dtype: expected one of {sorted(DTYPE_SIZES)}, "
                             f"got {self.dtype_name!r}")
        self.dtype = getattr(torch, self.dtype_name)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def for_dtype(self, dtype: str | None) -> TorchOps:
        return self if dtype in (None, self.dtype_name) else TorchOps(self.device, dtype)

    def _dev(self, index: int) -> Any:
        return self.torch.device("cuda", index) if self.device == "cuda" else self.torch.device("cpu")

    def stage(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.device == "cuda")

    def typed(self, flat: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        dt = getattr(self.torch, dtype) if isinstance(dtype, str) else dtype
        n = math.prod(shape) * self.torch.empty((), dtype=dt).element_size()
        return flat[offset:offset + n].view(dt).view(shape)

    def fill_random(self, buf: Any, seed: int, std: float) -> None:
        torch = self.torch
        step = 1 << 26
        if self.device == "cuda":  # generate on the GPU, copy into the pinned stage: fast
            gen = torch.Generator(device="cuda").manual_seed(seed)
            for lo in range(0, buf.numel(), step):
                part = buf[lo:lo + step]
                chunk = torch.empty(part.numel(), dtype=self.dtype, device="cuda")
                chunk.normal_(0.0, std, generator=gen)
                part.copy_(chunk)
            torch.cuda.synchronize()
            return
        gen = torch.Generator().manual_seed(seed)
        for lo in range(0, buf.numel(), step):
            buf[lo:lo + step].normal_(0.0, std, generator=gen)

    def to_device(self, host: Any, index: int) -> Any:
        if self.device != "cuda":
            return host.clone()
        out = self.torch.empty(host.numel(), dtype=host.dtype, device=self._dev(index))
        out.copy_(host, non_blocking=True)  # pinned source: an asynchronous DMA
        return out

    def sync(self, index: int) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize(self._dev(index))

    def same(self, device: Any, host: Any) -> bool:
        return bool(self.torch.equal(device.cpu(), host))

    def shares(self, a: Any, b: Any) -> bool:
        return a.device == b.device and a.untyped_storage().data_ptr() == \
            b.untyped_storage().data_ptr()

    def nbytes(self, buf: Any) -> int:
        return int(buf.numel() * buf.element_size())

    def ids(self, rows: list[list[int]], index: int) -> Any:
        return self.torch.tensor(rows, dtype=self.torch.long, device=self._dev(index))

    def move(self, x: Any, index: int) -> Any:
        return x.to(self._dev(index), non_blocking=True)

    def compute(self, x: Any) -> Any:
        # matmuls in the weights' dtype (bfloat16 on cuda: no float32 copy of each weight);
        # normalisation and softmax in float32, cast back
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def rms(self, x: Any, w: Any) -> Any:
        f = x.float()
        return (f * self.torch.rsqrt((f * f).mean(-1, keepdim=True) + 1e-6)).to(self.dtype) * w

    def take(self, x: Any, rows: list[int]) -> Any:
        return x[self.torch.tensor(rows, dtype=self.torch.long, device=x.device)]

    def silu(self, x: Any) -> Any:
        return self.torch.nn.functional.silu(x)

    def softmax(self, x: Any) -> Any:
        return self.torch.softmax(x.float(), dim=-1).to(self.dtype)

    def log_softmax(self, x: Any) -> Any:
        return self.torch.log_softmax(x.float(), dim=-1)

    def causal_mask(self, t: int, index: int) -> Any:
        return self.torch.full((t, t), float("-inf"), dtype=self.dtype,
                               device=self._dev(index)).triu(1)

    def transpose(self, x: Any, a: int, b: int) -> Any:
        return x.transpose(a, b)

    def repeat_heads(self, x: Any, n: int) -> Any:
        return x.repeat_interleave(n, dim=1) if n > 1 else x

    def gather_last(self, x: Any, idx: Any) -> Any:
        return x.gather(-1, idx[..., None])[..., 0]

    def tolist(self, x: Any) -> list:
        return x.double().cpu().tolist()


def make_ops(device: str, dtype: str | None = None) -> NumpyOps:
    """The ops for ``device``: torch on cuda (required), torch-cpu or numpy on cpu; they
    compute in ``dtype`` (None: the device's default, :func:`default_dtype`)."""
    if device not in DEVICES:
        raise ValueError(f"gpu device: unknown device {device!r} (expected one of {DEVICES})")
    if device == "cuda":
        if not torch_available():
            raise RuntimeError("gpu device 'cuda' needs torch (pip install torch); "
                               "use --gpu-device cpu to test the EOE path without a GPU")
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("gpu device 'cuda': torch sees no CUDA device "
                               "(use --gpu-device cpu to test the EOE path without a GPU)")
        return TorchOps("cuda", dtype)
    if torch_available():
        return TorchOps("cpu", dtype)
    return NumpyOps(dtype)


def check_device(device: str) -> None:
    """A --gpu-device value: ``cpu``, or ``cuda`` where torch sees a GPU (ValueError, in
    the option's words, otherwise)."""
    if device not in DEVICES:
        raise ValueError(f"--gpu-device: unknown device {device!r} (cuda or cpu)")
    if device == "cuda":
        try:
            make_ops("cuda")
        except RuntimeError as e:
            raise ValueError(f"--gpu-device cuda: {e}") from None
