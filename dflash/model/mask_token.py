"""The drafter's MASK token, for any target: an embedding row the target never emits.

`target.mask_token_id: null` takes the tokenizer's own mask token, else the first unused special
token: a special token that no rendered conversation holds. What a template emits is found by
rendering sample conversations through the target's own chat template (a system turn, two
rounds, a generation prompt, and a tool call where the template takes one) and collecting every
special token in them, plus the end-of-sequence, start and padding tokens; a special token the
template's source names literally counts as emitted too, and so do the tokenizer's end, start,
padding and unknown tokens. SmolLM2's template emits <|im_start|> and <|im_end|>, its unknown
token is <|endoftext|> (ids 0-2), so its first unused one is 3, <repo_name>.

A configured id that the template emits is refused: a MASK the target writes itself, such as
the end-of-turn, would look to the drafter like real context.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# listed in messages: enough to pick from, short enough for one line
LISTED = 12

SAMPLE_TURNS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 is 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "3 + 3 is 6."},
]
SAMPLE_TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C in Paris."},
]


def special_ids(tokenizer) -> dict[int, str]:
    """id -> text of every special token: the named ones and added tokens marked special."""
    out = {i: tokenizer.convert_ids_to_tokens(i) for i in tokenizer.all_special_ids}
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            out[int(i)] = str(added.content)
    return dict(sorted(out.items()))


def _renders(tokenizer) -> list[str]:
    """The sample conversations as the template renders them; a sample it refuses (no system
    role, no tools) is left out."""
    samples = [SAMPLE_TURNS, SAMPLE_TURNS[1:], SAMPLE_TOOL_TURNS]
    texts = []
    for turns in samples:
        for prompt in (False, True):
            try:
                texts.append(
                    tokenizer.apply_chat_template(
                        turns if not prompt else turns[:-1],
                        tokenize=False,
                        add_generation_prompt=prompt,
                    )
                )
            except Exception:  # noqa: BLE001 (jinja raises what the template's author chose)
                continue
    return texts


def emitted_ids(tokenizer, eos_ids=()) -> set[int]:
    """Special tokens the target writes or reads in every chat: those in the rendered sample
    conversations, those the template's source names, and the end, start, padding and unknown
    tokens."""
    specials = special_ids(tokenizer)
    named = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")
    found = {getattr(tokenizer, name, None) for name in named}
    found |= set(eos_ids)
    for text in _renders(tokenizer):
        found |= set(tokenizer(text, add_special_tokens=False)["input_ids"]) & specials.keys()
    source = tokenizer.chat_template or ""
    source = " ".join(source.values()) if isinstance(source, dict) else source
    found |= {i for i, text in specials.items() if text and text in source}
    return {i for i in found if i is not None}


def _listed(tokenizer, ids) -> str:
    ids = sorted(ids)
    shown = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in ids[:LISTED])
    return shown + (f" and {len(ids) - LISTED} more" if len(ids) > LISTED else "")


def choose_mask_token(
    tokenizer, vocab_size: int, configured: int | None, where: str, eos_ids=()
) -> tuple[int, str]:
    """(the MASK id, how it was chosen): the configured id, checked against the vocabulary and
    the chat template; else the tokenizer's own mask token; else the first unused special
    token. Raises UserError naming the key and the ids to pick from."""
    emitted = emitted_ids(tokenizer, eos_ids)
    specials = special_ids(tokenizer)
    unused = [i for i in specials if i not in emitted and 0 <= i < vocab_size]
    choices = f"unused special tokens: {_listed(tokenizer, unused)}" if unused else ""
    if configured is not None:
        if configured in emitted:
            raise UserError(
                f"target.mask_token_id: {configured}"
                f" {tokenizer.convert_ids_to_tokens(configured)!r} is a token the chat template"
                f" of target {where} emits, so the drafter could not tell MASK from real context:"
                f" set it to an unused special token"
                + (f" ({choices}), or null to take {unused[0]}" if unused else "")
                + f"; the template emits {_listed(tokenizer, emitted)}"
            )
        return configured, "configured"
    own = tokenizer.mask_token_id
    if own is not None and own not in emitted:
        return own, f"the tokenizer's mask token {tokenizer.mask_token!r}"
    if not unused:
        raise UserError(
            f"target {where} has no mask token and no unused special token: set"
            f" target.mask_token_id to an id in 0..{vocab_size - 1} that the chat template never"
            f" emits (an embedding row past the tokenizer's {len(tokenizer)} tokens, where there is"
            f" one); the template emits {_listed(tokenizer, emitted)}"
        )
    token = tokenizer.convert_ids_to_tokens(unused[0])
    return unused[0], f"the first unused special token {token!r} ({choices})"


def check_mask_token(
    tokenizer: Callable, vocab_size: int, configured: int | None, where: str, eos_ids=()
) -> tuple[int, str]:
    """The drafter's MASK id for a target and how it was chosen (`choose_mask_token`).
    `tokenizer` is called only when there is one to read: a configured id for a model folder
    without tokenizer files (a benchmark's random target) is checked against the vocabulary."""
    if configured is not None and not 0 <= configured < vocab_size:
        raise UserError(
            f"target.mask_token_id={configured} is outside the vocabulary of target {where}"
            f" (0..{vocab_size - 1}): set it to an unused special token id, or null to have one"
            " chosen"
        )
    tok = tokenizer()
    if tok is None:
        if configured is None:
            raise UserError(f"target {where}: no tokenizer to choose target.mask_token_id from")
        return configured, "configured"
    return choose_mask_token(tok, vocab_size, configured, where, eos_ids)


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def config_eos_ids(model_dir: str | Path) -> list[int]:
    """The end-of-sequence ids of the folder's generation_config.json (a model may stop on more
    than its tokenizer's eos token)."""
    import json

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def mask_token_choice(model_dir: str | Path, configured: int | None) -> tuple[int, str]:
    """(`check_mask_token`'s id, how it was chosen) for an HF directory."""
    from transformers import AutoConfig, AutoTokenizer

    if not Path(model_dir).is_dir():
        raise UserError(f"target {model_dir}: no such directory")
    vocab = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    return check_mask_token(
        lambda: AutoTokenizer.from_pretrained(model_dir) if has_tokenizer(model_dir) else None,
        vocab,
        configured,
        str(model_dir),
        config_eos_ids(model_dir),
    )


def resolve_mask_token(model_dir: str | Path, configured: int | None) -> int:
    """The MASK id for an HF directory, before any expensive stage."""
    return mask_token_choice(model_dir, configured)[0]
