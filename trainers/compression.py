"""Gradient compression under DDP: each `--grad-compression` mode's communication hook, the
bytes it hands to the collective, and its state in checkpoints.

Modes: "none" (DDP's fp32 all-reduce), "fp16" and "bf16" (torch's hooks), "int8" (below) and
"powersgd[:RANK]" (torch's PowerSGD hook, rank 1 by default). Every hook counts its payload,
the bytes of the tensors this rank hands to the collective; `bytes_per_step()` goes in the
run's summary beside what fp32 would have sent.

int8: a bucket's gradient, plus the residual this rank kept from the last step, is cut into
chunks of up to CHUNK values of one parameter, each scaled by its largest magnitude onto
[-127, 127] and rounded.
What the rounding lost is the new residual (error feedback: it is sent later, not lost). The
ranks all-gather their int8 values and fp32 scales (one byte tensor) and each sums them in
fp32, so no sum of int8 values can overflow. The payload is n + 4n/CHUNK bytes against
fp32's 4n, about a quarter. All-gather makes each rank receive (W-1) payloads where a ring
all-reduce moves 2(W-1)/W of its tensor: the traffic is a quarter of fp32's at 2 ranks, half
at 4 and the same at 8, so beyond a few ranks, use powersgd.

State: the residuals (int8) and PowerSGD's error feedback are per rank and belong to the
checkpoint, or a resume sends different gradients than the run would have. They are kept by
parameter name, not by DDP's bucket: DDP rebuilds its buckets after a process's first step,
so bucket numbers of one process are not another's. PowerSGD's low-rank memories (its warm
start) are kept by the names of the bucket's parameters, and a resumed process all-reduces
its first two steps uncompressed (torch's own rule at a run's start: the buckets are not
settled before), then goes on with the saved error feedback and memories.
"""

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)
MODES = ("none", "fp16", "bf16", "int8", "powersgd")
CHUNK = 1024  # values per int8 scale: 4 bytes of scale per 1024 of data
SETTLE_STEPS = 2  # steps a process all-reduces before PowerSGD: DDP settles its buckets


def parse(spec: str) -> tuple[str, int]:
    """("powersgd", rank) from "powersgd:RANK", (mode, 0) for the others; ValueError names
    the modes."""
    mode, _, rank = spec.partition(":")
    if mode not in MODES or (rank and mode != "powersgd"):
        raise ValueError(f"--grad-compression {spec!r}: one of none, fp16, bf16, int8, "
                         "powersgd or powersgd:RANK")
    if mode == "powersgd":
        if rank and (not rank.isdigit() or int(rank) < 1):
            raise ValueError(f"--grad-compression {spec!r}: the rank is a whole number >= 1")
        return mode, int(rank or 1)
    return mode, 0


class Compression:
    """One DDP model's gradient hook, its traffic and its state (module docstring)."""

    def __init__(self, spec: str, model: nn.Module) -> None:
        self.spec = spec
        self.mode, self.rank = parse(spec)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self.bytes_sent = 0  # payload handed to the collectives by this rank
        self.steps = 0  # optimizer steps whose gradients went through (last bucket seen)
        # What one step's plain fp32 all-reduce hands over: DDP's buckets hold every
        # gradient of a parameter that trains.
        self.fp32_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        self._residual: dict[str, torch.Tensor] = {}  # int8's and PowerSGD's error feedback
        self._memories: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # PowerSGD P, Q
        self._powersgd: Any = None
        self._chunks: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}  # by bucket
        self._process_steps = 0
        self._first = True

    def register(self, ddp: nn.Module) -> None:
        """Put the mode's hook on `ddp` (DistributedDataParallel); "none" keeps DDP's own
        all-reduce, whose payload is the fp32 gradients."""
        if self.mode == "none":
            return
        hook: Any
        if self.mode in ("fp16", "bf16"):
            hook = functools.partial(_half, self.mode)
        elif self.mode == "int8":
            hook = _int8
        else:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            self._powersgd = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=self.rank, start_powerSGD_iter=SETTLE_STEPS,
                min_compression_rate=2, use_error_feedback=True, warm_start=True,
                random_seed=0)
            hook = _powersgd
        ddp.register_comm_hook(self, _counted(hook, self.mode))  # type: ignore[operator]

    # -- traffic ---------------------------------------------------------------------------

    def bytes_per_step(self) -> dict[str, Any]:
        """The payload this rank handed to the collectives per step, on average, beside
        fp32's (the mode "none")."""
        sent = self.bytes_sent // self.steps if self.steps else self.fp32_bytes
        if self.mode == "none":
            sent = self.fp32_bytes
        return {"mode": self.spec, "bytes_per_step": sent,
                "fp32_bytes_per_step": self.fp32_bytes,
                "ratio_to_fp32": round(sent / max(self.fp32_bytes, 1), 4)}

    def _account(self, bucket: dist.GradBucket, payload: int) -> None:
        self.bytes_sent += payload
        if bucket.is_last():
            self.steps += 1
            self._process_steps += 1

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, CPU tensors only (the checkpoint gathers every rank's)."""
        if self._powersgd is not None:
            self._collect_powersgd()  # its error feedback, kept by bucket, into _residual
        state: dict[str, Any] = {"mode": self.spec, "bytes_sent": self.bytes_sent,
                                 "steps": self.steps,
                                 "residual": {k: v.cpu() for k, v in self._residual.items()}}
        if self._powersgd is not None:
            rng = self._powersgd.rng.get_state()
            state["powersgd"] = {
                "iter": int(self._powersgd.iter),
                "rng": [rng[0], torch.from_numpy(rng[1].astype("int64")), int(rng[2]),
                        int(rng[3]), float(rng[4])],
                "memories": {k: [p.cpu(), q.cpu()] for k, (p, q) in self._memories.items()}}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.spec:
            raise ValueError(f"the checkpoint's gradient compression is "
                             f"{state.get('mode')!r}, this run's {self.spec!r}")
        self.bytes_sent, self.steps = int(state["bytes_sent"]), int(state["steps"])
        self._residual = dict(state["residual"])
        if self._powersgd is not None and "powersgd" in state:
            saved = state["powersgd"]
            self._powersgd.iter = int(saved["iter"])
            name, keys, pos, has_gauss, cached = saved["rng"]
            self._powersgd.rng.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss,
                                          cached))
            self._memories = {k: (p, q) for k, (p, q) in saved["memories"].items()}

    # -- error feedback by parameter --------------------------------------------------------

    def _names_of(self, bucket: dist.GradBucket) -> list[str]:
        return [self._names[id(p)] for p in bucket.parameters()]

    def residual_of(self, bucket: dist.GradBucket) -> torch.Tensor | None:
        """The bucket's residual as one flat tensor, None when no parameter of it has one."""
        names = self._names_of(bucket)
        if not any(n in self._residual for n in names):
            return None
        buffer = bucket.buffer()
        parts = [self._residual[n].to(buffer.device) if n in self._residual else
                 torch.zeros(p.numel(), device=buffer.device, dtype=torch.float32)
                 for n, p in zip(names, bucket.parameters(), strict=True)]
        return torch.cat(parts)

    def chunks_of(self, bucket: dist.GradBucket) -> torch.Tensor:
        """int8's chunk lengths for the bucket (chunk_lengths), kept for its current layout
        only: DDP's rebuilt buckets replace the first step's."""
        names = tuple(self._names_of(bucket))
        kept = self._chunks.get(bucket.index())
        if kept is None or kept[0] != names:
            sizes = [p.numel() for p in bucket.parameters()]
            kept = self._chunks[bucket.index()] = (names, chunk_lengths(
                sizes, bucket.buffer().device))
        return kept[1]

    def keep_residual(self, bucket: dist.GradBucket, flat: torch.Tensor) -> None:
        at = 0
        for name, p in zip(self._names_of(bucket), bucket.parameters(), strict=True):
            self._residual[name] = flat[at: at + p.numel()].clone()
            at += p.numel()

    def _collect_powersgd(self) -> None:
        """PowerSGD's bucket-numbered state into this object's by-name state."""
        state = self._powersgd
        for index, names in getattr(self, "_bucket_names", {}).items():
            if index in state.error_dict:
                self._split_into_residual(names, state.error_dict[index])
            if index in state.p_memory_dict:
                key = "|".join(names)
                self._memories[key] = (state.p_memory_dict[index], state.q_memory_dict[index])

    def _split_into_residual(self, names: list[str], flat: torch.Tensor) -> None:
        at = 0
        for name in names:
            size = self._sizes[name]
            self._residual[name] = flat[at: at + size].detach().cpu().clone()
            at += size

    def prepare_powersgd(self, bucket: dist.GradBucket) -> bool:
        """Before torch's hook: whether to all-reduce this step uncompressed (a process's
        first steps), and the bucket's saved state put where torch's hook finds it."""
        state, index = self._powersgd, bucket.index()
        names = self._names_of(bucket)
        if not hasattr(self, "_bucket_names"):
            self._bucket_names: dict[int, list[str]] = {}
            self._sizes = {self._names[id(p)]: p.numel() for p in bucket.parameters()}
        self._sizes.update({self._names[id(p)]: p.numel() for p in bucket.parameters()})
        if self._process_steps < SETTLE_STEPS:
            return True
        if self._bucket_names.get(index) != names:  # first compressed call of this bucket
            self._bucket_names[index] = names
            residual = self.residual_of(bucket)
            if residual is not None:
                state.error_dict[index] = residual
            memory = self._memories.get("|".join(names))
            if memory is not None:
                device = bucket.buffer().device
                state.p_memory_dict[index] = memory[0].to(device)
                state.q_memory_dict[index] = memory[1].to(device)
        return False


def _counted(hook: Any, mode: str) -> Any:
    """`hook` with its first call logged (a run's proof that the hook runs: one never called
    changes nothing, silently)."""

    @functools.wraps(hook)  # DDP reads the hook's name and signature
    def counted(state: Compression, bucket: dist.GradBucket
                ) -> torch.futures.Future[torch.Tensor]:
        if state._first:
            state._first = False
            log.info("DDP gradients all-reduced in %s (compression hook running; first "
                     "bucket: %d values)", mode, bucket.buffer().numel())
        return hook(state, bucket)

    return counted


def _half(kind: str, state: Compression, bucket: dist.GradBucket
          ) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16 or bf16 hook, counted: two bytes a value."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state._account(bucket, bucket.buffer().numel() * 2)
    return getattr(default_hooks, f"{kind}_compress_hook")(None, bucket)  # type: ignore[no-any-return]


def _allreduce(state: Compression, bucket: dist.GradBucket
               ) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffer = bucket.buffer()
    state._account(bucket, buffer.numel() * buffer.element_size())
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def _int8(state: Compression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    grad = buffer.float()
    residual = state.residual_of(bucket)
    if residual is not None:
        grad = grad + residual
    lengths = state.chunks_of(bucket)
    packed, quantized = quantize(grad, lengths)
    # What rounding lost, sent later; nothing of a chunk that was not finite (its step is
    # skipped, and a NaN kept would poison every step after).
    lost = grad - quantized
    state.keep_residual(bucket, torch.where(torch.isfinite(lost), lost, torch.zeros_like(lost)))
    state._account(bucket, packed.numel())
    world = dist.get_world_size()
    gathered = [torch.empty_like(packed) for _ in range(world)]
    fut = dist.all_gather(gathered, packed, async_op=True).get_future()  # type: ignore[union-attr]

    def summed(_: Any) -> torch.Tensor:
        total = torch.zeros_like(grad)
        for part in gathered:  # in rank order on every rank: the same sums everywhere
            total += dequantize(part, lengths)
        buffer.copy_(total / world)
        return buffer

    return fut.then(summed)


def chunk_lengths(sizes: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The lengths of the chunks of a flat tensor of parameters of `sizes`: a parameter's
    values in runs of CHUNK, its last run shorter. Chunks never straddle two parameters, so
    a value's rounding does not depend on how DDP bucketed it (a resumed process buckets its
    first step otherwise). One length a chunk: 1/1024 of a value a parameter to keep."""
    lengths = []
    for size in sizes:
        lengths += [CHUNK] * (size // CHUNK) + ([size % CHUNK] if size % CHUNK else [])
    return torch.tensor(lengths, dtype=torch.int64, device=device)


def quantize(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(one uint8 tensor: the chunks' fp32 scales, then the int8 values; the values as the
    receivers will read them). A chunk holding an inf or a NaN is sent with a NaN scale:
    every rank's sum of it is NaN, so the step is skipped as any non-finite step is (not
    sent as zeros, which would hide it); no host sync is needed to find it."""
    finite = torch.isfinite(values)
    safe = torch.where(finite, values, torch.zeros_like(values))
    peak = torch.segment_reduce(safe.abs(), "max", lengths=lengths)
    bad = torch.segment_reduce((~finite).float(), "max", lengths=lengths) > 0
    scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))  # all-zero chunk: 1
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    each = torch.repeat_interleave(scale, lengths)
    q = torch.round(safe / torch.where(finite, each, torch.ones_like(each)))
    q = q.clamp_(-127, 127).to(torch.int8)
    packed = torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])
    return packed, q.float() * each


def dequantize(packed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    chunks = lengths.numel()
    scale = packed[: 4 * chunks].view(torch.float32)
    return packed[4 * chunks:].view(torch.int8).float() * torch.repeat_interleave(scale, lengths)


def _powersgd(state: Compression, bucket: dist.GradBucket
              ) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    psgd = state._powersgd
    if state.prepare_powersgd(bucket):
        if psgd.iter < psgd.start_powerSGD_iter:
            psgd.maybe_increase_iter(bucket)  # as torch's hook counts its first steps
        return _allreduce(state, bucket)
    before = psgd.total_numel_after_compression
    fut = powerSGD_hook.powerSGD_hook(psgd, bucket)
    after = psgd.total_numel_after_compression
    state._account(bucket, (after - before) * bucket.buffer().element_size())
    if not bucket.buffer().is_cuda:
        # torch's hook starts its second and third collectives from callbacks. Gloo pairs
        # collectives by order, and callbacks of two buckets race, so ranks would pair
        # one bucket's with another's and hang: on the CPU, a bucket finishes before the
        # next one starts.
        fut.wait()
    return fut
