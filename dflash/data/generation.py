"""The target answering conversations turn by turn, greedily or sampled: a fixed-batch path
(transformers' `generate`) and a continuous one (`BatchedGreedy`: rows refilled as they finish,
prompts in a few length tiers so compiled graphs are reused). A turn is conditioned on the
target's own earlier answers, as the target would have held the conversation.

Sampled answers (`data.regenerate.temperature` > 0) draw each token with `keyed_sample`, from a
key of the run's seed, the row's id and the turn (`Conversation.key`) and the token's position:
in either engine a row's answers depend on its own prompt and key alone, not on its batch."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import torch

from dflash.data import tools
from dflash.data.bounded import encode_bounded
from dflash.errors import UserError
from dflash.gpus import claim_gpu
from dflash.model.memory import require_target_fits
from dflash.model.precision import resolve_dtype
from dflash.model.sampling import Sampling, cap_range, keyed_sample, row_key


def _prompt_ids(tokenizer, turns: list[dict], max_prompt: int, template=None) -> list[int]:
    """The prompt's ids; those of turns cut by characters when it is far longer than
    `max_prompt` tokens (dflash.data.bounded), which is all its callers need to know then.
    `template`: extra chat-template arguments (`data.chat_template_kwargs`)."""

    def ids(short):
        out = tools.render(
            tokenizer, short, generation_prompt=True, tokenize=True, **(template or {})
        )
        out = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return out, len(out)

    return encode_bounded(ids, turns, max_prompt)[0]


def plan_batches(
    rows: list[dict], tokenizer, batch_size: int, max_prompt: int, template=None
) -> list[list[str]]:
    """Row ids per batch: sorted by first-prompt length (then id), cut into fixed batches. A
    prompt longer than `max_prompt` is never answered; its length here may be that of its cut
    turns (still longer than any that is)."""

    def first_prompt_len(row):
        turns = row["conversations"]
        first_user = next(i for i, t in enumerate(turns) if t["role"] == "user")
        return len(_prompt_ids(tokenizer, turns[: first_user + 1], max_prompt, template))

    order = sorted(rows, key=lambda r: (first_prompt_len(r), r["id"]))
    return [[r["id"] for r in order[i : i + batch_size]] for i in range(0, len(order), batch_size)]


def answer_cap(key: int, max_new_tokens: int, min_cap: int | None) -> int:
    """One answer's token cap: `max_new_tokens`, or with `data.regenerate.min_cap` one drawn
    uniformly from min_cap..max_new_tokens by the answer's stream key (`Conversation.key`), so
    every engine and every rerun cuts the same answer at the same length. A random-weight
    target's answers never end: with one cap every row ends at the same step and decoding runs
    in waves (the 8B rehearsal: 10 waves for 8.2 waves of turns); drawn caps end rows one at a
    time, as real answers do."""
    caps = cap_range(max_new_tokens, min_cap)
    return max_new_tokens if caps is None else random.Random(key).randint(*caps)


class Generator:
    """Batched generation with the target (left padding, KV cache): greedy, or keyed sampling
    at `sampling` with streams from `seed` (`Conversation.key`)."""

    def __init__(
        self,
        target_dir: Path,
        dtype: str,
        device: str,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        seed: int = 0,
        template: dict | None = None,
        min_cap: int | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # auto: a GPU no other job holds (shards run one per GPU, in parallel), else the CPU
        self.device = claim_gpu() if device == "auto" else torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.tokenizer.padding_side = "left"
        self.dtype = resolve_dtype(dtype, self.device)
        require_target_fits(target_dir, self.dtype, self.device, "regeneration")
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.max_new_tokens, self.min_cap = max_new_tokens, min_cap
        self.sampling, self.seed, self.template = sampling or Sampling(), seed, template or {}
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *self._config_eos()} - {None})
        if not self.eos_ids:
            raise UserError(f"{target_dir}: the target defines no end-of-sequence token")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0]

    def _sampler(self, prompts, keys, width):
        """Keyed sampling as a logits processor over greedy search: the drawn token alone keeps
        a finite score, so `generate`'s argmax takes it (None when greedy)."""
        from transformers import LogitsProcessorList

        if self.sampling.greedy:
            return None
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        streams = torch.tensor(keys, dtype=torch.long, device=self.device)

        def draw(input_ids, scores):
            # the position of the token drawn now, in its own prompt + answer
            positions = lengths + (input_ids.shape[1] - width)
            token = keyed_sample(scores, self.sampling, streams, positions)
            return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)

        return LogitsProcessorList([draw])

    def cap(self, key: int) -> int:
        """The token cap of the answer whose stream key is `key` (`answer_cap`)."""
        return answer_cap(key, self.max_new_tokens, self.min_cap)

    def _config_eos(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], keys: list[int] | None = None
    ) -> list[tuple[list[int], bool]]:
        """Continuations (the stop token kept where one ended them) and whether each finished;
        sampled with each prompt's stream `keys` where `sampling` asks for it, each cut at its
        own cap (`cap`; a token depends only on those before it, so the cut rows are what a
        shorter generation gives)."""
        caps = (
            [self.cap(k) for k in keys]
            if keys is not None
            else [self.max_new_tokens] * len(prompts)
        )
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            do_sample=False,
            max_new_tokens=max(caps),
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            # A static cache avoids re-concatenating the KV cache every step (half the CPU time).
            cache_implementation="static",
            logits_processor=self._sampler(prompts, keys, width),
        )
        results = []
        for row, cap in zip(out[:, width:].tolist(), caps, strict=True):
            row = row[:cap]
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            # the ids exactly as generated, including the stop token when there is one
            results.append((row[: stop + 1], True) if stop is not None else (row, False))
        return results


@lru_cache(maxsize=4)
def _drops_calls(tokenizer) -> bool:
    return tools.template_drops_calls(tokenizer) is not None


class Conversation:
    """One row being regenerated: its turns so far and the assistant turns still to do. Each
    assistant turn is answered with the turns before it as the prompt, earlier assistant turns
    already replaced by the target's own answers.

    A turn with tool calls is kept as the data has it (the calls, and the results after them,
    come from the tools, which regeneration cannot run); the plain answers around them are the
    target's. Where the target's template cannot render tool calls, a conversation that uses
    them is left as it is (tokenize leaves it out and counts it)."""

    def __init__(self, row: dict):
        self.row = row
        self.turns = [dict(t) for t in row["conversations"]]
        self.todo = [
            i
            for i, t in enumerate(self.turns)
            if t["role"] == "assistant" and not tools.has_calls(t)
        ]
        self.uses_tools = tools.uses_tools(self.turns)
        self.truncated: list[int] = []
        self.turn_ids: list[list[int]] = []
        self.dropped_turns = 0

    def key(self, seed: int) -> int:
        """The stream key of the next turn's answer: the run's seed, the row's id, the turn."""
        return row_key(seed, self.row["id"], self.todo[0])

    def prompt(self, tokenizer, max_prompt: int, template=None) -> list[int] | None:
        """The next turn's prompt, or None (and the conversation ends here, see `end_here`)
        when it fills `max_prompt` tokens."""
        if self.uses_tools and _drops_calls(tokenizer):
            self.todo = []
            return None
        prompt = _prompt_ids(tokenizer, self.turns[: self.todo[0]], max_prompt, template)
        if len(prompt) < max_prompt:
            return prompt
        self.end_here()
        return None

    def answer(self, tokens: list[int], finished: bool, tokenizer) -> None:
        turn = self.todo.pop(0)
        content = tokens[:-1] if finished else tokens
        self.turns[turn]["content"] = tokenizer.decode(content, skip_special_tokens=True)
        self.turn_ids.append(tokens)
        if not finished:
            self.truncated.append(turn)

    def end_here(self) -> None:
        """Drop the next assistant turn and all after it: its prompt alone fills the training
        length, so nothing of it could be trained on."""
        self.dropped_turns = len(self.todo)
        self.turns = self.turns[: self.todo[0]]
        self.todo = []

    def result(self) -> dict:
        return {
            "id": self.row["id"],
            "source": self.row["source"],
            "conversations": self.turns,
            "truncated_turns": self.truncated,
            "turn_token_ids": self.turn_ids,
        }


def regenerate_batch(gen, rows: list[dict], max_prompt: int, on_done=None):
    """Regenerate all assistant turns of the rows, turn by turn across the batch: every
    conversation's next turn in one `gen.generate` call (transformers' `generate`, every turn
    waiting for the batch's longest answer; or vLLM's, which schedules them itself).
    `on_done(conversation)` is called after each call for the conversations it completed."""
    convs = [Conversation(r) for r in rows]
    n_tokens = 0
    while todo := [c for c in convs if c.todo]:
        ready, prompts = [], []
        for conv in todo:
            if (prompt := conv.prompt(gen.tokenizer, max_prompt, gen.template)) is not None:
                ready.append(conv)
                prompts.append(prompt)
        if ready:
            keys = [conv.key(gen.seed) for conv in ready]
            for conv, (tokens, finished) in zip(ready, gen.generate(prompts, keys), strict=True):
                conv.answer(tokens, finished, gen.tokenizer)
                n_tokens += len(tokens)
        for conv in todo if on_done else ():
            if not conv.todo:
                on_done(conv)
    return convs, n_tokens
