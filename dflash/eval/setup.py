"""What every eval command loads before it decodes (`Setup`): the target with a KV cache, the
drafter, the eval prompts encoded with the target's chat template, its stop tokens and the
fingerprints of both models' weights; and the decoding of every prompt by every method, logged.
The two stages that use it are `dflash.eval.run` (`run`: acceptance; `run_ddtree`: tree budgets).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.config import expand_user
from dflash.eval.decode import (
    GREEDY,
    DrafterProposer,
    Generation,
    Proposer,
    generate,
    generate_tree,
)
from dflash.eval.lookup import prompt_lookup_draft
from dflash.eval.probe import probe_steps
from dflash.eval.sessions import target_session
from dflash.eval.sets import EvalPrompt, load_eval_set
from dflash.gpus import claim_gpu
from dflash.host import HostMonitor, describe_host, summarize_host
from dflash.io import read_json, sha256_file, sha256_json
from dflash.model.drafter import load_drafter
from dflash.model.precision import resolve_dtype
from dflash.model.sampling import row_key
from dflash.model.step import resolve_device
from dflash.model.target import eos_ids, load_target  # noqa: F401 (eos_ids re-exported)

log = logging.getLogger(__name__)

Method = Callable[[list[int]], Generation]  # a prompt's ids -> its decoding

# NVML asked about the GPU this often while decoding: a method decodes for a minute or less
HOST_GPU_EVERY_S = 5.0


class LookupProposer(Proposer):
    def __init__(self, block_size: int):
        self.block_size = block_size

    def propose(self, committed, features):
        return prompt_lookup_draft(committed, self.block_size - 1)


def encode(tokenizer, prompt: EvalPrompt, template_kwargs: dict | None = None) -> list[int]:
    """The prompt's ids through the target's chat template (`data.chat_template_kwargs`, e.g.
    Qwen3's enable_thinking, as regeneration and tokenization render it)."""
    text = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eval_prompts(config: dict, held_out: Path, cap: int | None = None) -> list[EvalPrompt]:
    """The prompts of every eval set; `cap` limits each set further (DDTree's subset)."""
    prompts = []
    cache_dir = expand_user(config["cache_dir"])
    for i, spec in enumerate(config["eval"]["sets"]):
        spec = dict(spec)
        if spec["format"] == "held_out" and not spec.get("path"):
            spec["path"] = str(held_out)
        spec.setdefault("max_prompts", config["eval"]["max_prompts"])
        if cap is not None:
            spec["max_prompts"] = min(spec["max_prompts"], cap)
        prompts += load_eval_set(spec, key=f"eval.sets[{i}]", cache_dir=cache_dir)
    return prompts


def weights_sha256(folder: Path) -> str:
    """sha256 of a model's weights: of its model.safetensors, or over every shard's sha256 for a
    large model saved in shards (model-00001-of-00004.safetensors, ...)."""
    files = sorted(folder.glob("*.safetensors"))
    if [f.name for f in files] == ["model.safetensors"]:
        return sha256_file(files[0])
    return sha256_json({f.name: sha256_file(f) for f in files})


def load_models(config: dict, target: Path, drafter: Path):
    """(target, drafter, dtype) on the evaluation's device and dtype (`eval.device`,
    `eval.dtype`): on `auto`, a GPU of its own where the host has several (the eval rules run side
    by side)."""
    auto_gpu = config["eval"]["device"] == "auto" and torch.cuda.is_available()
    device = claim_gpu() if auto_gpu else resolve_device(config["eval"]["device"])
    dtype = resolve_dtype(config["eval"]["dtype"], device)
    model = load_target(target, dtype=dtype, device=device)
    return model, load_drafter(drafter, dtype=dtype, device=device).eval(), dtype


class Setup:
    """What every eval command loads: the target with a KV cache, the drafter, the prompts."""

    def __init__(self, args, max_prompts: int | None = None):
        from transformers import AutoTokenizer

        config = self.config = args.config
        self.model, self.drafter, self.dtype = load_models(config, args.target, args.drafter)
        self.target_path = Path(args.target)  # for the float32 recheck of a bf16 divergence
        self.tokenized = getattr(args, "tokenized", None)  # held-out rows: tau_sim
        exported = read_json(Path(args.drafter) / "config.json")
        self.drafter_trained_on = exported.get("dflash_training_answers")
        device = self.model.get_input_embeddings().weight.device
        self.tokenizer = AutoTokenizer.from_pretrained(args.target)
        self.session = target_session(self.model, self.drafter.config.target_layer_ids)
        log.info("target session: %s on %s", type(self.session).__name__, device)
        self.embed, self.head = self.model.get_input_embeddings(), self.model.lm_head.weight
        # the trained drafter's proposer, shared by every method that drafts with it
        self.proposer = DrafterProposer(self.drafter, self.embed, self.head)
        self.probes: dict = {}  # the fixed steps, timed once every method has decoded
        self._fixed = None  # sessions no method decodes with, for `probes`' fixed-cache timing
        self.block_size = self.drafter.config.block_size
        self.stop = eos_ids(args.target, self.tokenizer)
        self.prompts = eval_prompts(config, args.held_out, max_prompts)
        self.first_turns = list(self.prompts)  # later turns join `prompts` as they are decoded
        self.encoded: list[list[int]] = []
        self.template_kwargs = config["data"]["chat_template_kwargs"]
        self.max_new = config["eval"]["max_new_tokens"]
        self.sha = {
            "drafter_sha256": sha256_file(Path(args.drafter) / "model.safetensors"),
            "target_sha256": weights_sha256(Path(args.target)),
        }
        # what else the machine did while each method's clock ran (`hosts`): a wall clock
        # taken beside another busy process, on the CPU or the GPU, says so in the record
        uuids = (
            [str(torch.cuda.get_device_properties(device).uuid)] if device.type == "cuda" else []
        )
        self.monitor = HostMonitor(uuids, gpu_every_s=HOST_GPU_EVERY_S)
        self.hosts: dict[str, dict] = {}

    def chain(self, proposer: Proposer, rule=GREEDY) -> Method:
        """A method that decodes a prompt with `proposer`'s drafts (none: the target alone),
        verified under `rule` (greedy, or sampling at a temperature)."""
        return lambda ids: generate(self.session, proposer, ids, self.max_new, self.stop, rule)

    def tree(
        self, proposer: DrafterProposer, budget: int | None, topk: int, lookup: bool, rule=GREEDY
    ) -> Method:
        """A method that decodes a prompt with a draft tree (`generate_tree`): DDTree of
        `budget` nodes, or the drafter's chain (None); `lookup` adds prompt lookup's
        continuation as a branch."""
        return lambda ids: generate_tree(
            self.session, proposer, ids, self.max_new, self.stop, budget, topk, lookup, rule
        )

    def decode_all(
        self, methods: dict[str, Method], rule=GREEDY, seed: int = 0, first_turns=None
    ) -> dict[str, list[Generation]]:
        """Each prompt decoded by the target alone (the reference), then by every method, back
        to back. A slow spell of the machine (a shared host's CPU, seconds long) then falls on
        every method of the prompts it lasts, not on whichever method was running: a speedup
        is a ratio of clocks taken a second apart. Later turns (followups) are added to the
        prompts after the target's own answer to the turn before, and decoded too.

        Greedy (the first call): the host is watched and the fixed steps probed after it, and
        `prompts`/`encoded` are the greedy evaluation's. Sampled at `rule`'s temperature: each
        decoding's stream is seeded from the run's seed, `seed`, the method and the prompt, and
        a later turn follows the target's own sampled answer; `sampled` holds (prompts, their ids).
        `first_turns`: those to decode (None: every prompt's)."""
        sampled = rule is not GREEDY
        if sampled:  # sampling: each method's stream seeded from (run seed, seed, method, prompt)
            methods = {name: self._seeded(name, m, rule, seed) for name, m in methods.items()}
        target = self._seeded("target", self.chain(Proposer(), rule), rule, seed)
        gens: dict[str, list[Generation]] = {"target": [], **{name: [] for name in methods}}
        pending = list(self.first_turns if first_turns is None else first_turns)
        prompts, encoded_all = [], []
        if not sampled:
            self.monitor.window()  # loading the models is not a method's
        while pending:
            encoded = [encode(self.tokenizer, p, self.template_kwargs) for p in pending]
            for ids in encoded:
                gens["target"].append(target(ids))
                for name, method in methods.items():
                    gens[name].append(method(ids))
            answers = gens["target"][-len(pending) :]
            prompts += pending
            encoded_all += encoded
            pending = [
                p.followup(self.tokenizer.decode(g.tokens, skip_special_tokens=True))
                for p, g in zip(pending, answers, strict=True)
                if p.followups
            ]
        if sampled:
            self.sampled = (prompts, encoded_all)
            for name, gs in gens.items():
                log_generations(f"{name} at {rule.sampling.label}, seed {seed}", gs)
            return gens
        self.prompts, self.encoded = prompts, encoded_all
        host = summarize_host([self.monitor.window()])
        self.monitor.close()  # every clock has run
        log.info("host while the methods decoded: %s", describe_host(host))
        self.hosts = dict.fromkeys(gens, host)  # one window: the methods took turns in it
        for name, gs in gens.items():
            log_generations(name, gs)
        # one graph per step shape and span (sessions.attended): what the captures bought
        drafter = getattr(self.proposer, "session", None)  # made by its first decoding
        log.info("CUDA graphs held: target %d, drafter %d", graphs(self.session), graphs(drafter))
        self.probes = self.probe()
        log.info("the fixed steps after every method: %s", self.probes)
        return gens

    def _seeded(self, name: str, method: Method, rule, seed: int) -> Method:
        """`method` with `rule`'s stream started afresh for each prompt it decodes."""
        if rule is GREEDY:
            return method

        def decode(ids):
            rule.reseed(row_key(self.config["seed"], seed, name, *ids))
            return method(ids)

        return decode

    def probe(self) -> dict:
        """The fixed steps (`dflash.eval.probe`) on the live sessions and, on a GPU, on sessions
        of a fixed small cache that no method decodes with."""
        vocab = self.model.config.get_text_config().vocab_size
        out = {"live": probe_steps(self.session, self.proposer, vocab)}
        if self.session.device.type == "cuda":
            if self._fixed is None:
                layer_ids = self.drafter.config.target_layer_ids
                self._fixed = (
                    target_session(self.model, layer_ids),
                    DrafterProposer(self.drafter, self.embed, self.head),
                )
            out["fixed"] = probe_steps(*self._fixed, vocab)
        return out


def graphs(session) -> int:
    """How many CUDA graphs a static session holds (none on other sessions or devices)."""
    held = getattr(session, "graphs", None)
    return len(held.graphs) if held is not None else 0


def log_generations(name: str, gens: list[Generation]) -> None:
    tokens = sum(sum(g.accepted) for g in gens)
    seconds = sum(g.seconds for g in gens)
    rounds = sum(g.rounds for g in gens)
    log.info(
        "%s: %d tokens in %.1f s (%.1f tokens/s, %.3f ms a round), %d prompts; CUDA graph "
        "captures and compiles %.1f s more, not counted; torch.compile graphs so far: %s",
        name,
        tokens,
        seconds,
        tokens / seconds if seconds else 0.0,
        1000 * seconds / rounds if rounds else 0.0,
        len(gens),
        sum(g.setup_s for g in gens),
        # which shapes the fused decode layers were compiled for, and when: a round's cost can
        # depend on the first multi-token shape a process met (dynamic shapes from then on)
        torch._dynamo.utils.counters["stats"].get("unique_graphs", 0),
    )
