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
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

DEVICES = ("cuda", "cpu")


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
    itemsize = 4

    def __init__(self, dtype: str | None = None) -> None:
        self.dtype = np.float32

    def stage(self, n: int) -> np.ndarray:
        return np.empty(n, dtype=self.dtype)

    def fill_random(self, buf: np.ndarray, seed: int, std: float) -> None:
        rng = np.random.default_rng(seed)
        step = 1 << 24  # fill in slices: no second full-size temporary
        for lo in range(0, buf.size, step):
            part = buf[lo:lo + step]
            rng.standard_normal(part.size, dtype=np.float32, out=part)
            part *= std

    def from_host(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=self.dtype).reshape(-1)

    def to_device(self, host: np.ndarray, index: int) -> np.ndarray:
        return host.copy()  # a real copy into the worker's memory: the "device" copy

    def sync(self, index: int) -> None:
        return None

    def view(self, flat: np.ndarray, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        return flat[offset:offset + n].reshape(shape)

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
        return x.astype(np.float32, copy=False)

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w

    def silu(self, x: np.ndarray) -> np.ndarray:
        return x / (1.0 + np.exp(-x))

    def softmax(self, x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def log_softmax(self, x: np.ndarray) -> np.ndarray:
        m = x.max(axis=-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))

    def causal_mask(self, t: int, index: int) -> np.ndarray:
        return np.triu(np.full((t, t), -1e30, dtype=np.float32), k=1)

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
        default = "bfloat16" if device == "cuda" else "float32"
        self.dtype = getattr(torch, dtype or default)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self._streams: dict[int, Any] = {}

    def _dev(self, index: int) -> Any:
        return self.torch.device("cuda", index) if self.device == "cuda" else self.torch.device("cpu")

    def stage(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.dtype, pin_memory=self.device == "cuda")

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

    def from_host(self, array: Any) -> Any:
        t = array if isinstance(array, self.torch.Tensor) else self.torch.as_tensor(array)
        return t.detach().to(self.dtype).reshape(-1).contiguous()

    def to_device(self, host: Any, index: int) -> Any:
        if self.device != "cuda":
            return host.clone()
        out = self.torch.empty(host.numel(), dtype=self.dtype, device=self._dev(index))
        out.copy_(host, non_blocking=True)  # pinned source: an asynchronous DMA
        return out

    def sync(self, index: int) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize(self._dev(index))

    def view(self, flat: Any, offset: int, shape: tuple[int, ...]) -> Any:
        return flat[offset:offset + math.prod(shape)].view(shape)

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

    def silu(self, x: Any) -> Any:
        return self.torch.nn.functional.silu(x)

    def softmax(self, x: Any) -> Any:
        return self.torch.softmax(x.float(), dim=-1).to(self.dtype)

    def log_softmax(self, x: Any) -> Any:
        return self.torch.log_softmax(x.float(), dim=-1)

    def causal_mask(self, t: int, index: int) -> Any:
        return self.torch.full((t, t), -1e30, device=self._dev(index)).triu(1)

    def transpose(self, x: Any, a: int, b: int) -> Any:
        return x.transpose(a, b)

    def repeat_heads(self, x: Any, n: int) -> Any:
        return x.repeat_interleave(n, dim=1) if n > 1 else x

    def gather_last(self, x: Any, idx: Any) -> Any:
        return x.gather(-1, idx[..., None])[..., 0]

    def tolist(self, x: Any) -> list:
        return x.double().cpu().tolist()


def make_ops(device: str, dtype: str | None = None) -> NumpyOps:
    """The ops for ``device``: torch on cuda (required), torch-cpu or numpy on cpu."""
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
        return TorchOps("cpu", "float32")
    return NumpyOps()


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
