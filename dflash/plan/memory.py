"""`auto` batch sizes for training: `data.token_budget`, `drafter.max_anchors` and
`data.max_batch_size` from the memory a training rank has and the model's shapes. Imports no
torch: the workflow resolves them when Snakemake starts.

The memory of one colocated drafter rank (it runs its own target; `targets: 0`):

    fixed   target weights (bf16, 2 bytes a parameter; none on a rank fed by target ranks)
            + the drafter's trained parameters x 16 (fp32 weights, gradients, AdamW's moments)
            + the fused LM-head loss's chunk (1,024 block tokens of fp32 logits and gradient)
    + per context token   the target's features (bf16) read by `fc` and kept for backward,
                          the drafter's K/V over them, the target forward's one live layer
    + per block token     each drafter layer's saved activations (bf16)

A batch of a bucket holds `rows x upper` context tokens and `rows x min(anchors, upper) x B`
block tokens (padding blocks are computed too), with `rows = min(max_batch_size,
token_budget // upper)`; every bucket must fit. The per-token constants are calibrated on
measured peaks at Qwen3-8B shapes on one H200 (BENCHMARKS.md, 2026-12-02/03): the 8B rehearsal's
colocated training, batches of 4 x 2560 tokens with 256 anchors, peaked at 49.2 GB (this model:
49.0); the drafter step alone at 2 x 2560 with 512 anchors at 31.8 GB (this model, with the
bench's own copy of embedding and head: 33.4). `usable` leaves 10 % of the free memory to the
allocator's fragmentation and the tau_sim pass.

`auto` sizes, from what fits:
- anchors: the reference's 512 (never more than the longest bucket), halved while one row of the
  longest bucket does not fit;
- token budget: as many rows of the longest bucket as fit in every bucket, at most 16,384 tokens
  (the schema's former default: a larger batch means fewer optimizer steps, not a faster run);
- max batch size: the rows of the shortest bucket that fill that budget (no cap of its own).
On a CPU memory does not bind, time does: `auto` takes the sizes the CPU default was measured
with on 2 cores (4,096 tokens, 8 anchors, 16 rows), lowered only if host memory says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.errors import UserError
from dflash.plan.shapes import Shape

USE = 0.9  # the share of free memory a fit fills
GB = 1e9
REFERENCE_ANCHORS, MIN_ANCHORS = 512, 16
MAX_BUDGET = 16384
CPU_SIZES = {"token_budget": 4096, "max_anchors": 8, "max_batch_size": 16}
CE_CHUNK = 1024
KEYS = {
    "token_budget": "data.token_budget",
    "max_anchors": "drafter.max_anchors",
    "max_batch_size": "data.max_batch_size",
}


@dataclass(frozen=True)
class Model:
    """Bytes of one training rank: fixed, per context token, per block token."""

    fixed: int
    per_context: int
    per_block: int
    block_size: int

    @classmethod
    def of(
        cls, shape: Shape, layers: int, block_size: int, n_ids: int, colocated: bool = True
    ) -> Model:
        h, i = shape.hidden, shape.intermediate
        kv = shape.kv_heads * shape.head_dim
        q = shape.heads * shape.head_dim
        trained = layers * (2 * h * q + 2 * h * kv + 3 * h * i + 2 * h) + n_ids * h * h + h
        fixed = 16 * trained + 2 * CE_CHUNK * shape.vocab * 4
        per_context = 2 * h * (2 * n_ids + 4) + 4 * kv * layers
        if colocated:
            fixed += 2 * shape.params
            per_context += 2 * (4 * h + 3 * i)
        return cls(fixed, per_context, layers * 2 * (6 * h + 4 * i), block_size)

    def batch_bytes(self, uppers, token_budget: int, max_anchors: int, max_batch_size: int):
        """The most any bucket's batch needs (bytes, bucket)."""

        def need(upper):
            rows = max(1, min(max_batch_size, token_budget // upper))
            blocks = rows * min(max_anchors, upper) * self.block_size
            return self.fixed + rows * upper * self.per_context + blocks * self.per_block

        return max((need(u), u) for u in uppers)


def bucket_uppers(buckets: list[int], max_length: int) -> list[int]:
    """The buckets' upper bounds as batching makes them (`dflash.data.batching.bucket_bounds`)."""
    return sorted({b for b in buckets if b < max_length} | {max_length})


@dataclass
class Fit:
    values: dict  # key -> int, for every key that was auto
    note: str
    identity: str = ""  # what the choice was made for (dflash.auto_memory keeps it by this)


def need(model: Model, data: dict, max_anchors: int) -> tuple[int, int]:
    """(bytes, bucket) of the largest batch numeric sizes make."""
    uppers = bucket_uppers(data["buckets"], data["max_length"])
    return model.batch_bytes(uppers, data["token_budget"], max_anchors, data["max_batch_size"])


def fit(
    model: Model | None,
    data: dict,
    drafter: dict,
    memory: tuple[float, str] | None,
) -> Fit:
    """Resolve every `auto` among the three keys. `memory`: (bytes free, where) on a GPU; None
    on a CPU (the CPU sizes). `model` may be None on a CPU when the target's shapes are not
    known before it is built."""
    wanted = {
        "token_budget": data["token_budget"],
        "max_anchors": drafter["max_anchors"],
        "max_batch_size": data["max_batch_size"],
    }
    auto = [k for k, v in wanted.items() if v == "auto"]
    if not auto:
        return Fit({}, "")
    uppers = bucket_uppers(data["buckets"], data["max_length"])
    if memory is None:
        values = {k: CPU_SIZES[k] for k in auto}
        how = "on a CPU, the sizes the CPU default was measured with"
        return Fit(values, _note(values, how))
    free, where = memory
    if model is None:
        raise UserError(f"{', '.join(KEYS[k] for k in auto)}: auto needs the target's shapes")
    usable = int(free * USE)
    chosen = dict(wanted)
    longest, shortest = uppers[-1], uppers[0]
    if "max_anchors" in auto:
        chosen["max_anchors"] = min(REFERENCE_ANCHORS, longest)
    if "token_budget" in auto:
        chosen["token_budget"] = longest

    def fits(c) -> tuple[bool, int, int]:
        rows = c["max_batch_size"]
        if rows == "auto":
            rows = max(1, c["token_budget"] // shortest)
        need, upper = model.batch_bytes(uppers, c["token_budget"], c["max_anchors"], rows)
        return need <= usable, need, upper

    while not fits(chosen)[0] and "max_anchors" in auto and chosen["max_anchors"] > MIN_ANCHORS:
        chosen["max_anchors"] = max(MIN_ANCHORS, chosen["max_anchors"] // 2)
    ok, need, upper = fits(chosen)
    if not ok:
        raise UserError(
            f"{', '.join(KEYS[k] for k in auto)}: auto finds no batch that fits: one row of the"
            f" {upper}-token bucket with {chosen['max_anchors']} anchors needs {need / GB:.1f} GB"
            f" (of which {model.fixed / GB:.1f} GB weights, gradients and optimizer state), and"
            f" {where} has {free / GB:.1f} GB free ({USE:.0%} of it usable): lower"
            " data.max_length, use a GPU with more memory, or give the target ranks of its own"
            " (train.topology.targets)"
        )
    if "token_budget" in auto:
        # more than max_batch_size rows of the longest bucket would change no batch
        cap = max(MAX_BUDGET, longest)
        if chosen["max_batch_size"] != "auto":
            cap = min(cap, chosen["max_batch_size"] * longest)
        while True:
            more = dict(chosen, token_budget=chosen["token_budget"] + longest)
            if more["token_budget"] > cap or not fits(more)[0]:
                break
            chosen = more
    if "max_batch_size" in auto:
        chosen["max_batch_size"] = max(1, chosen["token_budget"] // shortest)
    ok, need, upper = fits(chosen)
    values = {k: chosen[k] for k in auto}
    how = (
        f"{need / GB:.1f} GB at the {upper}-token bucket, of {usable / GB:.1f} GB usable"
        f" ({USE:.0%} of {free / GB:.1f} GB free on {where})"
    )
    return Fit(values, _note(values, how))


def _note(values: dict, how: str) -> str:
    return ", ".join(f"{KEYS[k]}: auto -> {v}" for k, v in values.items()) + f" ({how})"
