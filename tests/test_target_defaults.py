"""Any target's defaults: the MASK token chosen among special tokens its chat template never
emits (a chosen one it emits refused), and target layer ids inside its depth, however shallow."""

from __future__ import annotations

import pytest

from dflash.errors import UserError
from dflash.model.layer_ids import check_layer_ids, default_layer_ids
from dflash.model.mask_token import choose_mask_token, emitted_ids


def reference_rule(layers: int, n: int) -> list[int]:
    """DESIGN 4's rule as written: round(1 + i * (L - 4) / (n - 1))."""
    return [round(1 + i * (layers - 4) / (n - 1)) for i in range(n)]


def test_a_shallow_target_gets_layer_ids_inside_its_depth():
    assert default_layer_ids(2, 2) == [1]  # the formula alone gave [1, -1]
    assert default_layer_ids(2, 5) == [1]
    assert default_layer_ids(1, 3) == [0]
    assert default_layer_ids(4, 2) == [1]
    assert default_layer_ids(5, 2) == [1, 2]
    for layers in range(1, 40):
        for n in range(1, 9):
            ids = default_layer_ids(layers, n)
            assert ids and all(0 <= i < layers for i in ids), (layers, n, ids)


def test_deep_targets_keep_the_reference_rule():
    for layers in range(8, 80):
        for n in range(2, 9):
            if len(set(reference_rule(layers, n))) == n:
                assert default_layer_ids(layers, n) == reference_rule(layers, n)
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's public drafters
    assert default_layer_ids(30, 1) == [15]


def test_layer_ids_outside_the_target_are_refused_with_the_valid_range():
    check_layer_ids([0, 1], 2, 2, "t")
    check_layer_ids(None, 2, 2, "t")
    with pytest.raises(UserError) as e:
        check_layer_ids([1, 5], 2, 2, "/models/tiny")
    assert str(e.value) == (
        "drafter.target_layer_ids: [5] outside the 2 layers of target /models/tiny: valid ids"
        " are 0..1 (null takes the default, [1])"
    )


def test_smollm2s_mask_token_is_its_first_special_the_template_never_emits(tokenizer):
    # <|im_start|> and <|im_end|> open and close every turn; <|endoftext|> is the unknown token
    assert {0, 1, 2} <= emitted_ids(tokenizer)
    mask, how = choose_mask_token(tokenizer, 49152, None, "smollm2")
    assert mask == 3 and "'<repo_name>'" in how
    assert "0 '<|endoftext|>'" not in how.split("unused special tokens:")[1]
    with pytest.raises(UserError) as e:
        choose_mask_token(tokenizer, 49152, 2, "smollm2")
    message = str(e.value)
    assert message.startswith("target.mask_token_id: 2 '<|im_end|>' is a token the chat template")
    assert "unused special tokens: 3 '<repo_name>', 4 '<reponame>'" in message
    assert "or null to take 3" in message
    assert choose_mask_token(tokenizer, 49152, 7, "smollm2") == (7, "configured")


def test_qwen3s_mask_token_and_an_id_past_its_tokenizer(qwen3_tokenizer):
    emitted = emitted_ids(qwen3_tokenizer)
    assert {151643, 151644, 151645} <= emitted  # <|endoftext|>, <|im_start|>, <|im_end|>
    mask, _ = choose_mask_token(qwen3_tokenizer, 151936, None, "qwen3")
    assert mask == 151646 and mask not in emitted  # <|object_ref_start|>
    # the public Qwen3 drafters' choice: the first embedding row past the tokenizer
    assert choose_mask_token(qwen3_tokenizer, 151936, 151669, "qwen3")[0] == 151669
    with pytest.raises(UserError, match="151645 '<\\|im_end\\|>' is a token the chat template"):
        choose_mask_token(qwen3_tokenizer, 151936, 151645, "qwen3")
