"""The frozen target: context features from a few of its layers, plus its embedding and LM head.

Only layers up to the deepest one the drafter reads are kept: the forward stops there (no later
layers, no LM head). Decoders of a standard layout run written out layer by layer
(`dflash.model.decoder`: no host sync, one compiled graph for every layer); others run
transformers' forward, with forward hooks keeping just the selected layers' outputs alive.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dflash.model.decoder import head_dim, layer_output, supports_static
from dflash.model.layer_ids import default_layer_ids  # noqa: F401 (re-exported)
from dflash.model.mask_token import check_mask_token, resolve_mask_token  # noqa: F401 (re-exported)
from dflash.model.memory import require_target_fits


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (the module holding `.layers`) of a causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers"):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers")
    return base


def right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones, then zeros."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


class TargetFeatures(nn.Module):
    """Concatenated hidden states of `layer_ids` for a batch, from a truncated frozen target.

    With `with_output`, the whole decoder runs and its normed output (what the LM head reads)
    is appended after them: the target's own next-token distribution, for distillation
    (`train.distill`).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], with_output: bool = False):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.with_output = with_output
        self.written_out = supports_static(model)
        self.head_dim = head_dim(model.config)
        self.layer_fn = layer_output  # `compile_layers` swaps in the compiled one
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        decoder = _decoder(model)
        n_layers = len(decoder.layers)
        if not all(0 <= i < n_layers for i in self.layer_ids):
            raise ValueError(f"target_layer_ids {self.layer_ids} outside 0..{n_layers - 1}")
        if not with_output:
            # The model is consumed: its decoder keeps only the layers up to the deepest one
            # read. Its config is left alone (it still describes the full target), and the
            # decoder's forward simply runs out of layers there (its final norm is unused).
            decoder.layers = nn.ModuleList(list(decoder.layers)[: max(self.layer_ids) + 1])
        self.decoder = decoder
        self.requires_grad_(False)
        self.eval()
        self._captured: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:  # transformers' forward (a padding mask, or another layout)
            decoder.layers[i].register_forward_hook(self._hook(i))

    def compile_layers(self) -> bool:
        """Compile the written-out layer (one graph per batch shape, shared by every layer:
        `torch.compile` treats the weights as inputs). Only for inputs of a few fixed shapes
        (compiled training pads batches to their bucket's); False where there is nothing to
        compile (transformers' own forward)."""
        if self.written_out:
            self.layer_fn = torch.compile(layer_output, dynamic=False)
        return self.written_out

    def _hook(self, i: int):
        def capture(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return capture

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        compiled: bool = True,
    ):
        """Features of every position; those of padding positions are unspecified.

        A right-padded mask is dropped: under causal attention a real token never sees a later
        (padding) position, so its features are the same, and without a mask the attention can
        use the fused causal kernel instead of a materialised 4-D mask (bench/gpu.py measures
        both). `compiled=False` runs the layers eagerly even after `compile_layers` (inputs of
        one-off shapes, which would each compile anew).
        """
        if attention_mask is not None and right_padded(attention_mask):
            attention_mask = None
        if self.written_out and attention_mask is None:
            return self._written_out(input_ids, self.layer_fn if compiled else layer_output)
        self._captured.clear()
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        parts = [self._captured[i] for i in self.layer_ids]
        if self.with_output:
            parts.append(out.last_hidden_state)
        self._captured.clear()
        return torch.cat(parts, dim=-1)

    def _written_out(self, input_ids: torch.Tensor, layer_fn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.decoder.rotary_emb(x, positions)
        wanted, parts = set(self.layer_ids), {}
        for i, layer in enumerate(self.decoder.layers):
            x = layer_fn(layer, x, cos, sin, self.head_dim)
            if i in wanted:
                parts[i] = x
        out = [parts[i] for i in self.layer_ids]
        if self.with_output:
            out.append(self.decoder.norm(x))
        return torch.cat(out, dim=-1)


def load_target(path: str | Path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    require_target_fits(path, dtype, device, "loading the target")
    # transformers' own architectures only: no model code from the target's folder is run
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def load_embeddings(path: str | Path, dtype=torch.float32, device="cpu"):
    """The target's (frozen input embedding, LM head weight), read alone from its safetensors.

    A drafter rank fed by a separate target rank needs only these two tensors, not the model.
    """
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        with safe_open(path / "model.safetensors", "pt") as f:
            files = dict.fromkeys(f.keys(), path / "model.safetensors")

    def tensor(name):
        with safe_open(files[name], "pt", device=str(device)) as f:
            return f.get_tensor(name).to(dtype)

    embed_name = next((k for k in files if k.endswith("embed_tokens.weight")), None)
    if embed_name is None:
        raise ValueError(f"{path}: no '*embed_tokens.weight' tensor in the safetensors files")
    embed = tensor(embed_name)
    head = tensor("lm_head.weight") if "lm_head.weight" in files else embed  # tied embeddings
    embedding = nn.Embedding.from_pretrained(embed, freeze=True)
    return embedding, head


def eos_ids(target_dir: Path, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(target_dir).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos])
    except OSError:
        pass
    return {i for i in ids if i is not None}
