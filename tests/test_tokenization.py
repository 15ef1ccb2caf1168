"""Loss-mask placement, checked against decoded text with the real SmolLM2 tokenizer."""

import pytest

from dflash.data.tokenization import encode, has_trainable_pair

pytestmark = pytest.mark.slow

TURNS = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]


def trainable_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of trainable tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_mask_covers_assistant_content_and_end_of_turn(tokenizer):
    ids, mask, cut = encode(tokenizer, TURNS, truncated=set(), max_length=1000)
    assert not cut
    eot = tokenizer.eos_token
    assert eot == "<|im_end|>"
    assert trainable_runs(tokenizer, ids, mask) == [
        "Paris is the capital of France." + eot,
        "Rome, since 1871." + eot,
    ]
    # Same tokens as the template's own tokenization: nothing is re-split at span edges.
    reference = tokenizer.apply_chat_template(TURNS, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert ids == list(reference)
    untrained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "Paris" not in untrained and "France?" in untrained


def test_truncated_turn_trains_content_but_not_end_of_turn(tokenizer):
    ids, mask, _ = encode(tokenizer, TURNS, truncated={4}, max_length=1000)
    runs = trainable_runs(tokenizer, ids, mask)
    assert runs[1] == "Rome, since 1871."
    assert runs[0].endswith("<|im_end|>")


def test_truncation_to_max_length(tokenizer):
    ids, mask, cut = encode(tokenizer, TURNS, truncated=set(), max_length=40)
    assert len(ids) == len(mask) == 40 and cut


def test_trainable_pair_rule():
    assert not has_trainable_pair([0, 1, 0, 1])
    assert has_trainable_pair([0, 1, 1, 0])


@pytest.mark.parametrize("content", ["end", "m", "Rome, since 1871.  "])
def test_truncated_content_never_matches_inside_the_end_of_turn(tokenizer, content):
    turns = [*TURNS[:4], {"role": "assistant", "content": content}]
    ids, mask, _ = encode(tokenizer, turns, truncated={4}, max_length=1000)
    runs = trainable_runs(tokenizer, ids, mask)
    assert "<|im_end|>" not in runs[-1]
    assert runs[-1] == content


def test_generated_ids_are_used_exactly_not_re_encoded(tokenizer):
    # "\n\n" (1116) then "1" "." is how SmolLM2 generates a list; re-encoding the decoded text
    # gives "\n" "\n" "1" "." instead. The training row must hold what the target emitted.
    generated = tokenizer(" Steps:", add_special_tokens=False)["input_ids"] + [1116, 33, 30]
    assert (
        tokenizer(tokenizer.decode(generated), add_special_tokens=False)["input_ids"] != generated
    )
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [*TURNS[:4], {"role": "assistant", "content": tokenizer.decode(generated)}]
    ids, mask, _ = encode(tokenizer, turns, set(), 1000, last_turn_ids=generated + [stop])
    prompt = tokenizer.apply_chat_template(turns[:4], tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert ids == prompt + generated + [stop]
    assert mask[len(prompt) :] == [1] * (len(generated) + 1)
    # the earlier assistant turn is still located in the text
    assert trainable_runs(tokenizer, ids[: len(prompt)], mask[: len(prompt)]) == [
        "Paris is the capital of France.<|im_end|>"
    ]


class Spy:
    """The tokenizer, recording the length of every text it tokenizes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_huge_message_is_cut_by_characters_before_it_is_tokenized(tokenizer):
    """Without max_chars, ten 10 MB messages took 3.1 GB and 16 s a row: the text is now cut
    near max_length * CHARS_PER_TOKEN characters first, and the tokens kept are the same."""
    from dflash.data.bounded import CHARS_PER_TOKEN
    from dflash.data.generation import _prompt_ids
    from dflash.data.tokenization import assistant_spans

    answer = "The answer, told at length: " + " ".join(f"w{i}" for i in range(100_000))
    turns = [TURNS[1], {"role": "assistant", "content": answer}, *TURNS[3:]]
    spy = Spy(tokenizer)
    ids, mask, cut = encode(spy, turns, truncated=set(), max_length=64)
    assert cut and max(spy.lengths) < 64 * CHARS_PER_TOKEN + 1000 < len(answer) // 100
    # the uncut reference: the whole text tokenized (0.7 MB: affordable once, here)
    text, spans = assistant_spans(tokenizer, turns, set())
    whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ids == whole["input_ids"][:64]
    starts = [start for start, _ in whole["offset_mapping"][:64]]
    assert mask == [int(any(lo <= s < hi for lo, hi in spans)) for s in starts]
    assert mask[-1] == 1  # the answer's tokens, trainable
    # regeneration's prompts too: longer than the bound says, never tokenized whole
    prompt = _prompt_ids(tokenizer, [{"role": "user", "content": answer}], 64)
    assert 64 < len(prompt) < 64 * CHARS_PER_TOKEN
