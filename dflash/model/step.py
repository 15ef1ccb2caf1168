"""The drafter training step as training runs it, so the warmup compiles exactly that code."""

from __future__ import annotations

import contextlib
import copyreg
import time

import torch

from dflash.model.drafter import LayerCompiled
from dflash.model.objective import dflash_loss


def memory_format(name: str) -> torch.memory_format:
    return getattr(torch, name)


def _reduce_memory_format(fmt: torch.memory_format):
    # by this function's name and the format's: the same bytes in every process (a reducer
    # naming the torch module itself cannot be pickled, and the cache key is then skipped)
    return memory_format, (str(fmt).removeprefix("torch."),)


# torch's compile cache keys pickle `torch.memory_format` objects by the first module in
# sys.modules that holds them: a training process, which imports polars before torch, named them
# `polars._dependencies.torch.*`, the warmup `torch._utils.*`, so the same graphs got other keys
# and training recompiled every shape (274 s on an H200). One reducer for every process.
copyreg.pickle(torch.memory_format, _reduce_memory_format)

# Every bucket shape adds an entry to each compiled function's cache, two to the layers' (the
# first layer and the rest). Past torch's default of 8 entries, dynamo silently runs a function
# eagerly: a fifth bucket shape would have trained with its layers uncompiled.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_attention(name: str, device: torch.device) -> str:
    """flex_attention on GPU; on CPU torch's flex_attention has no backward, so SDPA."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ValueError("compile.attention=flex needs a GPU: flex_attention has no CPU backward")
    return name


class TrainStep:
    """Forward + backward of the DFlash loss for one batch; optionally compiled."""

    def __init__(
        self,
        drafter,
        embed_tokens,
        head_weight,
        *,
        max_anchors: int,
        gamma,
        attention,
        compile: bool,
        compile_scope: str = "layers",
        compile_mode: str = "default",
        wrap=None,
        distill: float = 0.0,
        ce_chunk: int = 1024,
        copy_weight: float = 1.0,
        dpace: dict | None = None,
    ):
        self.drafter = drafter
        self.model = drafter
        if compile:  # `compile.scope`: one graph shared by the layers, or the whole drafter
            self.model = (
                LayerCompiled(drafter, compile_mode)
                if compile_scope == "layers"
                else torch.compile(drafter, dynamic=False, mode=compile_mode)
            )
        # CUDA graphs (`compile.mode: reduce-overhead`) are told where a step begins: a graph's
        # outputs of the last step may then be overwritten (training reads none of them later)
        self.graphs = compile and compile_mode == "reduce-overhead"
        if wrap is not None:  # e.g. DDP, around the compiled module the warmup prepared
            self.model = wrap(self.model)
            self.model.config = drafter.config
        self.embed_tokens, self.head_weight = embed_tokens, head_weight
        self.max_anchors, self.gamma, self.attention = max_anchors, gamma, attention
        self.compile, self.distill = compile, distill
        self.ce_chunk = ce_chunk  # tokens per chunk of LM-head logits
        self.copy_weight = copy_weight  # drafter.copy_anchor_weight
        self.dpace = dpace  # drafter.loss: dpace, with drafter.dpace's alpha and norm

    def __call__(self, features, input_ids, loss_mask, generator, loss_scale: float = 1.0):
        loss, metrics = self.loss(features, input_ids, loss_mask, generator)
        (loss * loss_scale).backward()
        return metrics

    def loss(self, features, input_ids, loss_mask, generator, host: bool = True):
        """(loss, metrics); metrics as device tensors unless `host` (see `dflash_loss`)."""
        # fp32 master weights; on GPU the step runs in bf16 autocast.
        device = input_ids.device.type
        if self.graphs:  # (a counter on a CPU, where nothing is captured)
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            return dflash_loss(
                self.model,
                self.embed_tokens,
                self.head_weight,
                features,
                input_ids,
                loss_mask,
                generator,
                self.max_anchors,
                self.gamma,
                backend=self.attention,
                chunk_tokens=self.ce_chunk,
                compiled_flex=self.compile and self.attention == "flex",
                compiled_ce=self.compile and device == "cuda",
                distill=self.distill,
                host=host,
                copy_weight=self.copy_weight,
                dpace=self.dpace,
            )


def dpace_settings(drafter: dict) -> dict | None:
    """TrainStep's `dpace` from the config's drafter section: None for the decayed loss."""
    return dict(drafter["dpace"]) if drafter["loss"] == "dpace" else None


def feature_width(config, distill: float = 0.0) -> int:
    """Width of the features a step is fed: the drafter's target layers, and the target's
    normed output after them when distilling."""
    return (len(config.target_layer_ids) + (1 if distill else 0)) * config.hidden_size


def run_shapes(step: TrainStep, shapes, width: int, vocab_size: int, dtype, steps=1, no_sync=None):
    """Run `step` `steps` times on each (batch, length) shape and discard the gradients: this
    compiles every graph batches of those shapes use, or loads them from the compile cache.
    The warmup rule and each training process call this one function, so both build the same
    graphs; the dummy data comes from a private generator, so the global RNG is untouched.
    Returns each shape's step times in seconds."""
    device = step.head_weight.device
    times = []
    for batch, length in shapes:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (batch, length), generator=g).to(device)
        loss_mask = torch.ones_like(ids)
        loss_mask[:, : length // 4] = 0
        feats = torch.randn(batch, length, width, generator=g).to(device, dtype)
        shape_times = []
        for i in range(steps):
            t0 = time.perf_counter()
            with no_sync() if no_sync else contextlib.nullcontext():
                step(feats, ids, loss_mask, torch.Generator().manual_seed(i))
            step.drafter.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            shape_times.append(time.perf_counter() - t0)
        times.append(shape_times)
    return times
