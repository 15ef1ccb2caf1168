"""Sampling from the target as serving engines do: temperature, then top-k, then top-p.

Two ways to draw a token, for two needs:
- `sample_rows` draws from a torch.Generator: the evaluation's seeded streams (one per prompt,
  method and seed), as an engine draws its uniforms.
- `keyed_sample` draws with a uniform that is a hash of (row key, position): no generator
  state at all, so a row's tokens depend only on its own logits and key, whatever batch it sits
  in, where the batch is refilled, or whether a run was resumed. Regeneration uses it (a rerun on
  the same machine writes the same bytes), and it runs inside a CUDA graph.

Temperature 0 is greedy everywhere: the argmax, no randomness drawn, the same tokens as before
sampling existed.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling parameters {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def label(self) -> str:
        """A short name: `greedy`, or `T=0.7` with `,top_p=0.95` / `,top_k=20` where set."""
        if self.greedy:
            return "greedy"
        out = f"T={self.temperature:g}"
        if self.top_p < 1:
            out += f",top_p={self.top_p:g}"
        if self.top_k:
            out += f",top_k={self.top_k}"
        return out

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, config: dict) -> Sampling:
        """From a config mapping with `temperature`, `top_p`, `top_k` (missing ones default)."""
        return cls(
            float(config.get("temperature", 0.0)),
            float(config.get("top_p", 1.0)),
            int(config.get("top_k", 0)),
        )


def cap_range(max_new_tokens: int, min_cap: int | None) -> tuple[int, int] | None:
    """The range answers' caps are drawn from with `data.regenerate.min_cap`
    (`dflash.data.generation.answer_cap`); None without it (every cap is max_new_tokens)."""
    return None if min_cap is None else (min(min_cap, max_new_tokens), max_new_tokens)


def serving_mode(config: dict) -> dict:
    """How the target answered the training data (`data.regenerate`'s sampling, the seed its
    streams came from when sampled, the range its answers' caps were drawn from where
    `min_cap` is set, `data.chat_template_kwargs`): recorded in the regeneration manifest,
    summary.md and the drafter's config.json."""
    regenerate = config["data"]["regenerate"]
    sampling = Sampling.of(regenerate)
    mode = {"sampling": sampling.as_dict(), "label": sampling.label}
    if not sampling.greedy:
        mode["seed"] = config["seed"]
    caps = cap_range(regenerate["max_new_tokens"], regenerate.get("min_cap"))
    if caps is not None:  # answers cut short on purpose
        mode["answer_caps"] = list(caps)
    return mode | {"chat_template_kwargs": config["data"].get("chat_template_kwargs") or {}}


def warped_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """float32 logits / T with the tokens outside top-k and top-p set to -inf (vLLM's order:
    temperature, top-k, then top-p over what top-k kept; at least one token always stays)."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1:
        ordered, order = torch.sort(x, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p
        drop = (probs.cumsum(-1) - probs) > s.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return x


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution a token is drawn from (float32; one-hot at the argmax when greedy)."""
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return warped_logits(logits, s).softmax(-1)


def sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` (rows need not be normalised; a row of zeros gives 0):
    argmax of p / E with E ~ Exp(1), the exponential race, one draw per entry."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race.clamp_(min=torch.finfo(race.dtype).tiny)).argmax(-1)


def row_key(seed: int, *identity) -> int:
    """A 62-bit key for one row's stream, from the run's seed and the row's identity."""
    text = ":".join(map(str, (seed, *identity)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's constants, as int64 (the products wrap in two's complement on CPU and CUDA)
_GOLDEN, _M1, _M2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def keyed_uniform(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, a pure function of (key, position): float32 of 24 bits."""
    bits = _shr(_mix(_mix(keys.long() * _GOLDEN + positions.long())), 40)
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def keyed_sample(
    logits: torch.Tensor, s: Sampling, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One token per row of `logits` (rows, V): argmax at T = 0, else the inverse of the
    distribution's cumulative sum at row i's `keyed_uniform` (its key and the position its token
    will take). One uniform a row: far cheaper than noise per token, and on the CPU it matters
    (a hash per token cost 0.1 s a step at 16 rows of SmolLM2's 49,152)."""
    if s.greedy:
        return logits.argmax(-1)
    cdf = probabilities(logits, s).cumsum(-1)
    u = keyed_uniform(keys, positions)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_(max=logits.shape[-1] - 1)[:, 0]
