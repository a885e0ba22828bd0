"""The model a GPU service serves: its weights as staged buffers, and its forward pass.

Weights of a service live in one flat host buffer, laid out block by block
(embedding, decoder layer 0 .. L-1, head). A DoP-k variant is a **layer split**
(pipeline placement, not tensor parallelism): the blocks are cut into k
contiguous groups of about equal bytes, GPU j of the chunk holds group j, and
the activations move from GPU j to j+1 at the cut. Because each group is one
contiguous range of the host buffer, restoring GPU j is a single host-to-device
copy of that range (what makes restore run at the link's bandwidth), and
evicting is dropping the device buffers (no write-back: weights never change).

Two loaders:

* ``init: random`` (:class:`TinyLM`): a Llama-shaped decoder (RMSNorm, grouped
  query attention, SwiGLU MLP, untied LM head; no rotary embedding) with the
  dimensions of a real config and random weights: real size, real compute, no
  checkpoint needed. Written once against ``arrays.Ops`` (numpy or torch).
* ``path: <local Hugging Face directory>`` (:class:`HFModel`): ``transformers``
  ``from_pretrained``; needs torch and transformers. Staged with the same block
  layout (parameters and buffers of layer ``i`` form block ``i + 1``), restored
  into a meta-device skeleton, and run with the model's own forward; forward
  pre-hooks move activations between the GPUs of a layer split.

Requests (the payload of a GPU action):

* ``{"op": "logprobs", "tokens": [[ids...], ...]}``: the teacher's log-prob of
  every token given its prefix (MOPD); one list of ``len - 1`` floats per sequence.
* ``{"op": "score", "tokens": [[ids...], ...], "yes_token": 1}``: a judge's reward,
  the log-prob that the judge's next token is ``yes_token``; one float per sequence.

A **batch** (the core's continuous batching: several actions of one service on
one lease) is served by :meth:`StagedModel.run_batch` as ONE forward pass over the
sequences of all its members (right-padded to the longest; attention is causal, so
padding never changes a real position's result; the Hugging Face path passes the
attention mask as an inference server does). Each member gets its own result: a
member whose request is bad fails alone (before the forward), a cancelled member is
dropped between two layers (its rows leave the batch) and reported at once, and the
others go on.

Weights are staged as bytes, each tensor in the dtype its loader gave it (see
``arrays.py``): a Hugging Face model loaded in bfloat16 keeps the buffers that
transformers keeps in float32 (rotary frequencies; ``_keep_in_fp32_modules``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor.backends.gpu.arrays import DTYPE_SIZES, NumpyOps

#: config keys of ``init: random`` (Hugging Face names) and their defaults
CONFIG_KEYS: dict[str, int | None] = {
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "intermediate_size": None, "num_attention_heads": 32, "num_key_value_heads": None,
}


class ModelError(ValueError):
    """A service's model cannot be built or a request cannot be served (says why)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """How a service's weights are obtained: ``random`` from a config, or ``hf`` from a path."""

    kind: str
    config: tuple[tuple[str, Any], ...] = ()
    path: str = ""
    seed: int = 0
    dtype: str | None = None

    @classmethod
    def random(cls, config: Mapping[str, Any], seed: int = 0, dtype: str | None = None
               ) -> ModelSource:
        return cls("random", tuple(sorted(config.items())), seed=seed, dtype=dtype)

    @classmethod
    def hf(cls, path: str, dtype: str | None = None) -> ModelSource:
        return cls("hf", path=path, dtype=dtype)


@dataclass(frozen=True, slots=True)
class TinyConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "model.config") -> TinyConfig:
        problems = [f"{where}.{k}: unknown key (expected {sorted(CONFIG_KEYS)})"
                    for k in raw if k not in CONFIG_KEYS and k not in IGNORED_KEYS]
        vals: dict[str, int] = {}
        for key, default in CONFIG_KEYS.items():
            v = raw.get(key, default)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{where}.{key}: expected an integer >= 1, got {v!r}")
                continue
            vals[key] = v
        if problems:
            raise ModelError("; ".join(problems))
        h = vals["hidden_size"]
        heads = vals["num_attention_heads"]
        kv = vals.get("num_key_value_heads", heads)
        if h % heads or heads % kv:
            raise ModelError(f"{where}: hidden_size {h} must divide by num_attention_heads "
                             f"{heads}, which must divide by num_key_value_heads {kv}")
        return cls(vals["vocab_size"], h, vals["num_hidden_layers"],
                   vals.get("intermediate_size", 4 * h), heads, kv)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


#: Hugging Face config keys accepted (so a real config.json can be pasted) but unused
IGNORED_KEYS = frozenset({"model_type", "architectures", "torch_dtype", "rms_norm_eps",
                          "max_position_embeddings", "rope_theta", "hidden_act",
                          "tie_word_embeddings", "bos_token_id", "eos_token_id"})


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    block: int
    offset: int  # in bytes, within the flat buffer
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ... (torch's name without "torch.")
    itemsize: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every tensor sits in the flat byte buffer, and the blocks a layer split cuts
    at (byte ranges)."""

    tensors: tuple[Tensor, ...]
    blocks: tuple[tuple[int, int], ...]  # byte range of each block

    @property
    def nbytes(self) -> int:
        return self.blocks[-1][1] if self.blocks else 0

    def shards(self, k: int) -> list[tuple[int, int]]:
        """Byte range held by each of ``k`` GPUs: contiguous groups of blocks of about
        equal bytes (a GPU may get an empty range when there are fewer blocks than GPUs)."""
        total = max(self.nbytes, 1)
        owner = [min(k - 1, int((lo + hi) / 2 / total * k)) for lo, hi in self.blocks]
        out = []
        for j in range(k):
            mine = [b for b, o in zip(self.blocks, owner, strict=True) if o == j]
            if mine:
                out.append((mine[0][0], mine[-1][1]))
            else:  # empty: sits at the end of the previous range
                at = out[-1][1] if out else 0
                out.append((at, at))
        return out

    def shard_of_block(self, k: int) -> list[int]:
        ranges = self.shards(k)
        return [next(j for j, (lo, hi) in enumerate(ranges) if lo <= b_lo and b_hi <= hi
                     and hi > lo) for b_lo, b_hi in self.blocks]


#: (name, block, shape, dtype name, bytes per element)
Spec = tuple[str, int, tuple[int, ...], str, int]


def build_layout(specs: Sequence[Spec]) -> Layout:
    """Tensors one after another, block by block; each starts at a multiple of its own
    element size (a typed view needs it; a uniform dtype needs no padding at all)."""
    tensors, blocks = [], []
    offset = 0
    current, start = None, 0
    for name, block, shape, dtype, itemsize in specs:
        if block != current:
            if current is not None:
                blocks.append((start, offset))
            if current is not None and block != current + 1:
                raise ModelError(f"layout: block {block} out of order after {current}")
            offset += -offset % itemsize
            current, start = block, offset
        offset += -offset % itemsize
        tensors.append(Tensor(name, block, offset, shape, dtype, itemsize))
        offset += math.prod(shape) * itemsize
    if current is not None:
        blocks.append((start, offset))
    return Layout(tuple(tensors), tuple(blocks))


def tiny_specs(c: TinyConfig, dtype: str = "float32") -> list[Spec]:
    h, d = c.hidden_size, c.head_dim
    shapes: list[tuple[str, int, tuple[int, ...]]] = [("embed", 0, (c.vocab_size, h))]
    for i in range(c.num_hidden_layers):
        b = i + 1
        shapes += [(f"{i}.attn_norm", b, (h,)), (f"{i}.wq", b, (h, c.num_attention_heads * d)),
                   (f"{i}.wk", b, (h, c.num_key_value_heads * d)),
                   (f"{i}.wv", b, (h, c.num_key_value_heads * d)),
                   (f"{i}.wo", b, (c.num_attention_heads * d, h)), (f"{i}.mlp_norm", b, (h,)),
                   (f"{i}.w_gate", b, (h, c.intermediate_size)),
                   (f"{i}.w_up", b, (h, c.intermediate_size)),
                   (f"{i}.w_down", b, (c.intermediate_size, h))]
    last = c.num_hidden_layers + 1
    shapes += [("final_norm", last, (h,)), ("lm_head", last, (h, c.vocab_size))]
    return [(n, b, shape, dtype, DTYPE_SIZES[dtype]) for n, b, shape in shapes]


def random_size_bytes(config: Mapping[str, Any], itemsize: int) -> int:
    """Bytes of an ``init: random`` model (what the core's ``size_gb`` must say)."""
    c = TinyConfig.from_mapping(config)
    return sum(math.prod(shape) for _, _, shape, _, _ in tiny_specs(c)) * itemsize


def config_for_bytes(target: int, itemsize: int = 4, layers: int = 4, vocab: int = 512,
                     heads: int = 4) -> dict[str, int]:
    """A small Llama-shaped config of about ``target`` bytes (for scaled-down services)."""
    # params ~ 2*V*h + L*(4h^2 + 3*h*4h) = 2Vh + 16Lh^2
    n = max(target / itemsize, 1.0)
    a, b = 16 * layers, 2 * vocab
    h = (-b + math.sqrt(b * b + 4 * a * n)) / (2 * a)
    h = max(heads * 2, int(round(h / (heads * 2))) * heads * 2)
    return {"vocab_size": vocab, "hidden_size": h, "num_hidden_layers": layers,
            "intermediate_size": 4 * h, "num_attention_heads": heads}


# -- staged models -------------------------------------------------------------------------
@dataclass(slots=True)
class Placed:
    """A variant's device copy: one buffer per GPU of its chunk."""

    buffers: list[Any]
    ranges: list[tuple[int, int]]
    runner: Any = None  # model-specific state built on the device copy (HF skeleton)
    nbytes: list[int] = field(default_factory=list)
    #: called between two layers of the forward pass running on this copy (HF hooks)
    between_layers: Callable[[], None] | None = None


class Cancelled(Exception):
    pass


@dataclass(slots=True)
class Request:
    """One member of a batch: its request, and what became of it."""

    id: str
    payload: Any
    op: str = ""
    rows: list[list[int]] = field(default_factory=list)
    #: "" while in the forward pass; then "ok", "failed" or "cancelled"
    status: str = ""
    output: dict[str, Any] | None = None
    error: str = ""


class Batch:
    """The members of one forward pass. ``cancelled(id)`` says whether a member was asked
    to stop; ``on_end(request)`` is called once per member, as soon as its fate is known
    (a bad request before the pass, a cancelled one between two layers, the rest after)."""

    def __init__(self, requests: Sequence[Request], cancelled: Callable[[str], bool],
                 on_end: Callable[[Request], None] = lambda r: None) -> None:
        self.requests = list(requests)
        self.cancelled = cancelled
        self.on_end = on_end

    @property
    def live(self) -> list[Request]:
        return [r for r in self.requests if not r.status]

    def end(self, r: Request, status: str, output: dict[str, Any] | None = None,
            error: str = "") -> None:
        if r.status:
            return
        r.status, r.output, r.error = status, output, error
        self.on_end(r)

    def rows(self) -> list[list[int]]:
        """Token rows of the live members, member after member."""
        return [row for r in self.live for row in r.rows]

    def check(self) -> list[int] | None:
        """Between two layers: end the members cancelled since the last check. Returns the
        indices (in :meth:`rows` as it was) of the rows still in the pass when some left,
        None when none did; raises Cancelled when no member is left."""
        keep, at, dropped = [], 0, False
        for r in self.live:
            n = len(r.rows)
            if self.cancelled(r.id):
                self.end(r, "cancelled", error="cancelled while computing")
                dropped = True
            else:
                keep.extend(range(at, at + n))
            at += n
        if not self.live:
            raise Cancelled
        return keep if dropped else None


class StagedModel:
    """A service staged in host memory; ``place`` makes a device copy of a DoP-k variant."""

    layout: Layout
    host: Any
    vocab: int

    def __init__(self, ops: NumpyOps) -> None:
        self.ops = ops
        #: forward passes run (a batch is one)
        self.forwards = 0

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def place(self, k: int, devices: list[int]) -> Placed:
        """Copy the k shards of the host stage onto ``devices`` (one contiguous copy each)."""
        ranges = self.layout.shards(k)
        bufs = [self.ops.to_device(self.host[lo:hi], dev)
                for (lo, hi), dev in zip(ranges, devices, strict=True)]
        for dev in devices:
            self.ops.sync(dev)
        return Placed(bufs, ranges, None, [self.ops.nbytes(b) for b in bufs])

    def run_batch(self, placed: Placed, devices: list[int], batch: Batch) -> None:
        """Serve every member of ``batch`` with one forward pass; each ends through
        ``batch.end`` (a bad request fails alone, before the pass)."""
        for r in batch.requests:
            try:
                r.op, r.rows = check_request(r.payload, self.vocab)
            except ModelError as e:
                batch.end(r, "failed", error=str(e))
        if not batch.live:
            return
        self.forwards += 1
        try:
            self._forward(placed, devices, batch)
        except Cancelled:
            pass  # every member was cancelled, and has been told so

    def run(self, placed: Placed, devices: list[int], payload: Mapping[str, Any],
            cancelled: Callable[[], bool]) -> dict[str, Any]:
        """One request alone (a batch of one); raises ModelError or Cancelled."""
        r = Request("", payload)
        self.run_batch(placed, devices, Batch([r], lambda _id: cancelled()))
        if r.status == "failed":
            raise ModelError(r.error)
        if r.status == "cancelled":
            raise Cancelled
        assert r.output is not None
        return r.output

    def _forward(self, placed: Placed, devices: list[int], batch: Batch) -> None:
        raise NotImplementedError


def check_request(payload: Mapping[str, Any] | None, vocab: int) -> tuple[str, list[list[int]]]:
    """The op and token rows of a request, or ModelError naming the bad field."""
    if not isinstance(payload, Mapping):
        raise ModelError("payload: expected {op, tokens}")
    op = payload.get("op", "logprobs")
    if op not in ("logprobs", "score"):
        raise ModelError(f"payload.op: expected 'logprobs' or 'score', got {op!r}")
    rows = payload.get("tokens")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        raise ModelError("payload.tokens: expected a non-empty list of non-empty token lists")
    for i, row in enumerate(rows):
        for t in row:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ModelError(f"payload.tokens[{i}]: token {t!r} is not an id in "
                                 f"[0, {vocab})")
    if op == "logprobs" and any(len(r) < 2 for r in rows):
        raise ModelError("payload.tokens: logprobs needs at least 2 tokens per sequence")
    yes = payload.get("yes_token", 1)
    if op == "score" and (not isinstance(yes, int) or isinstance(yes, bool)
                          or not 0 <= yes < vocab):
        raise ModelError(f"payload.yes_token: {yes!r} is not an id in [0, {vocab})")
    return op, rows


def _pad(rows: list[list[int]]) -> list[list[int]]:
    t = max(len(r) for r in rows)
    return [r + [0] * (t - len(r)) for r in rows]


def _split(batch: Batch, logprobs: list[list[float]] | None,
           scores: list[float] | None) -> None:
    """Hand each live member its rows' results (in the order of ``batch.rows()``)."""
    at = 0
    for r in batch.live:
        n = len(r.rows)
        if r.op == "score":
            assert scores is not None
            batch.end(r, "ok", {"scores": scores[at:at + n]})
        else:
            assert logprobs is not None
            batch.end(r, "ok", {"logprobs": [logprobs[at + i][: len(row) - 1]
                                             for i, row in enumerate(r.rows)]})
        at += n


class TinyLM(StagedModel):
    """``init: random``: a Llama-shaped decoder with random weights (see module doc)."""

    def __init__(self, ops: NumpyOps, config: Mapping[str, Any], seed: int = 0,
                 dtype: str | None = None) -> None:
        try:
            ops = ops.for_dtype(dtype)
        except ValueError as e:
            raise ModelError(str(e)) from None
        super().__init__(ops)
        self.config = TinyConfig.from_mapping(config)
        self.vocab = self.config.vocab_size
        self.layout = build_layout(tiny_specs(self.config, ops.dtype_name))
        self.host = ops.stage(self.layout.nbytes)
        every = ops.typed(self.host, 0, (self.layout.nbytes // ops.itemsize,), ops.dtype_name)
        ops.fill_random(every, seed, 0.02)
        for t in self.layout.tensors:  # norms start at one, as a trained model's roughly do
            if t.name.endswith("norm"):
                ops.typed(self.host, t.offset, t.shape, t.dtype)[:] = 1.0

    def _weights(self, placed: Placed, block: int, owner: list[int]) -> dict[str, Any]:
        j = owner[block]
        lo = placed.ranges[j][0]
        return {t.name: self.ops.compute(self.ops.typed(placed.buffers[j], t.offset - lo,
                                                        t.shape, t.dtype))
                for t in self.layout.tensors if t.block == block}

    def _forward(self, placed: Placed, devices: list[int], batch: Batch) -> None:
        c, ops, k = self.config, self.ops, len(devices)
        owner = self.layout.shard_of_block(k)
        rows = batch.rows()
        ids = ops.ids(_pad(rows), devices[owner[0]])
        x = self._weights(placed, 0, owner)["embed"][ids]
        t = ids.shape[1]
        heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        for i in range(c.num_hidden_layers):
            keep = batch.check()
            if keep is not None:  # cancelled members leave the pass: their rows go
                x = ops.take(x, keep)
            b = x.shape[0]
            dev = devices[owner[i + 1]]
            x = ops.move(x, dev)
            w = self._weights(placed, i + 1, owner)
            a = ops.rms(x, w[f"{i}.attn_norm"])
            q = ops.transpose((a @ w[f"{i}.wq"]).reshape(b, t, heads, d), 1, 2)
            kk = ops.transpose((a @ w[f"{i}.wk"]).reshape(b, t, kv, d), 1, 2)
            v = ops.transpose((a @ w[f"{i}.wv"]).reshape(b, t, kv, d), 1, 2)
            kk, v = ops.repeat_heads(kk, heads // kv), ops.repeat_heads(v, heads // kv)
            att = ops.softmax(q @ ops.transpose(kk, -1, -2) / math.sqrt(d)
                              + ops.causal_mask(t, dev))
            o = ops.transpose(att @ v, 1, 2).reshape(b, t, heads * d)
            x = x + o @ w[f"{i}.wo"]
            m = ops.rms(x, w[f"{i}.mlp_norm"])
            x = x + (ops.silu(m @ w[f"{i}.w_gate"]) * (m @ w[f"{i}.w_up"])) @ w[f"{i}.w_down"]
        keep = batch.check()
        if keep is not None:
            x = ops.take(x, keep)
        rows = batch.rows()
        head = self._weights(placed, c.num_hidden_layers + 1, owner)
        x = ops.move(x, devices[owner[-1]])
        x = ops.rms(x, head["final_norm"])
        member = [r for r in batch.live for _ in r.rows]  # whose each row is
        scores: list[float] | None = None
        logprobs: list[list[float]] | None = None
        if any(r.op == "score" for r in member):
            scores = [0.0] * len(rows)
            for j, r in enumerate(member):
                if r.op == "score":
                    lp = ops.log_softmax(x[j, len(rows[j]) - 1] @ head["lm_head"])
                    scores[j] = float(ops.tolist(lp[int(r.payload.get("yes_token", 1))]))
        if any(r.op == "logprobs" for r in batch.live):
            logp = ops.log_softmax(x @ head["lm_head"])
            nxt = ops.ids([r[1:] + [0] for r in _pad(rows)], devices[owner[-1]])
            logprobs = ops.tolist(ops.gather_last(logp, nxt))
        _split(batch, logprobs, scores)


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


class HFModel(StagedModel):
    """A local Hugging Face causal LM (``transformers`` + torch), staged with the block
    layout of the module doc and run with its own forward on the device copy.

    It is loaded with ``from_pretrained(dtype=...)`` (the service's ``dtype``, else the
    device's default) and every tensor is staged in the dtype transformers gave it: what
    transformers keeps in float32 in a bfloat16 model (the rotary ``inv_freq`` buffers,
    ``_keep_in_fp32_modules``) stays float32 on the GPU too."""

    def __init__(self, ops: NumpyOps, path: str, dtype: str | None = None) -> None:
        if ops.name != "torch":
            raise ModelError(f"model.path {path!r}: loading a Hugging Face directory needs "
                             "torch and transformers (pip install torch transformers)")
        try:
            ops = ops.for_dtype(dtype)
        except ValueError as e:
            raise ModelError(str(e)) from None
        super().__init__(ops)
        try:
            import transformers
        except ImportError:
            raise ModelError(f"model.path {path!r}: loading a Hugging Face directory needs "
                             "transformers (pip install transformers)") from None
        if not (Path(path) / "config.json").exists():
            raise ModelError(f"model.path {path!r}: not a Hugging Face model directory "
                             "(no config.json)")
        torch = ops.torch
        self._dtype_kw = _dtype_kw(transformers, ops.dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, **self._dtype_kw)
        self.hf_config = model.config
        self.vocab = int(model.config.vocab_size)
        named = list(model.state_dict(keep_vars=True).items())
        named += [(n, b) for n, b in model.named_buffers() if n not in dict(named)]
        seen_layer = False
        blocked = []
        for name, tensor in named:
            m = _LAYER.search(name)
            if m:
                seen_layer = True
                block = int(m.group(1)) + 1
            else:
                block = -1 if seen_layer else 0  # -1: the head, after every layer
            blocked.append((block, name, tensor))
        last = max((b for b, _, _ in blocked), default=0) + 1
        blocked = sorted(((last if b == -1 else b), n, t) for b, n, t in blocked)
        self.layout = build_layout([(n, b, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                     t.element_size()) for b, n, t in blocked])
        self.host = ops.stage(self.layout.nbytes)
        for (_b, _name, tensor), spec in zip(blocked, self.layout.tensors, strict=True):
            ops.typed(self.host, spec.offset, spec.shape, tensor.dtype).copy_(tensor.detach())
        self._torch = torch
        del model

    def place(self, k: int, devices: list[int]) -> Placed:
        placed = super().place(k, devices)
        import transformers

        torch = self._torch
        with torch.device("meta"):
            skel = transformers.AutoModelForCausalLM.from_config(self.hf_config,
                                                                 **self._dtype_kw)
        owner = self.layout.shard_of_block(k)
        for t in self.layout.tensors:
            j = owner[t.block]
            lo = placed.ranges[j][0]
            view = self.ops.typed(placed.buffers[j], t.offset - lo, t.shape, t.dtype)
            mod_name, _, leaf = t.name.rpartition(".")
            mod = skel.get_submodule(mod_name) if mod_name else skel
            if leaf in mod._parameters:
                mod._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)
            else:
                mod._buffers[leaf] = view
        _move_hooks(skel, torch)

        def between_layers(_m: Any, _args: Any) -> None:
            if placed.between_layers is not None:
                placed.between_layers()

        for name, mod in skel.named_modules():
            if re.search(r"(?:^|\.)(?:layers|h|blocks)\.\d+$", name):
                mod.register_forward_pre_hook(between_layers)
        placed.runner = skel.eval()
        return placed

    def _forward(self, placed: Placed, devices: list[int], batch: Batch) -> None:
        torch = self._torch
        rows = batch.rows()
        owners = [r for r in batch.live for _ in r.rows]  # whose each row is
        lengths = [len(r) for r in rows]
        owner = self.layout.shard_of_block(len(devices))
        first = torch.device("cuda", devices[owner[0]]) if self.ops.device == "cuda" else "cpu"
        ids = torch.tensor(_pad(rows), dtype=torch.long, device=first)
        mask = torch.tensor([[1] * n + [0] * (ids.shape[1] - n) for n in lengths], device=first)

        # transformers' forward cannot drop rows mid-pass: a cancelled member is reported
        # at the next layer and its rows computed to the end; all cancelled: stop there
        def check() -> None:
            batch.check()

        placed.between_layers = check
        try:
            with torch.inference_mode():
                logits = placed.runner(input_ids=ids, attention_mask=mask).logits.float()
        finally:
            placed.between_layers = None
        batch.check()  # members cancelled during the last layer
        keep = [i for i, r in enumerate(owners) if not r.status]  # rows of live members
        if len(keep) < len(owners):
            logits, ids = logits[keep], ids[keep]
            rows = [rows[i] for i in keep]
        logp = torch.log_softmax(logits, dim=-1)
        member = [r for r in batch.live for _ in r.rows]  # whose each row is
        scores = [float(logp[j, len(rows[j]) - 1, int(r.payload.get("yes_token", 1))])
                  if r.op == "score" else 0.0 for j, r in enumerate(member)]
        logprobs = None
        if any(r.op == "logprobs" for r in member):
            nxt = ids[:, 1:].to(logp.device)
            logprobs = logp[:, :-1].gather(-1, nxt[..., None])[..., 0].double().cpu().tolist()
        _split(batch, logprobs, scores)


def _dtype_kw(transformers: Any, dtype: Any) -> dict[str, Any]:
    """``dtype=`` since transformers 4.56 (``torch_dtype=`` is deprecated there), before it
    ``torch_dtype=``."""
    try:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        return {"dtype": dtype}
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _move_hooks(model: Any, torch: Any) -> None:
    """Layer split: before a module that owns weights runs, move its tensor inputs to the
    device of those weights (what accelerate's dispatch hooks do, without accelerate)."""

    def to(obj: Any, dev: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(dev, non_blocking=True)
        if isinstance(obj, tuple):
            return tuple(to(o, dev) for o in obj)
        if isinstance(obj, list):
            return [to(o, dev) for o in obj]
        if isinstance(obj, dict):
            return {k: to(v, dev) for k, v in obj.items()}
        return obj

    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if not own and not _LAYER.search(name + "."):
            continue
        ref = (own or list(mod.parameters()))
        if not ref:
            continue
        dev = ref[0].device
        mod.register_forward_pre_hook(
            lambda _m, args, kwargs, dev=dev: (to(args, dev), to(kwargs, dev)), with_kwargs=True)


def load_model(source: ModelSource, ops: NumpyOps) -> StagedModel:
    """Stage ``source`` in host memory (pinned on cuda)."""
    if source.kind == "random":
        return TinyLM(ops, dict(source.config), source.seed, source.dtype)
    if source.kind == "hf":
        return HFModel(ops, source.path, source.dtype)
    raise ModelError(f"model: unknown loader {source.kind!r}")
