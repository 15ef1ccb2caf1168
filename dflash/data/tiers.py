"""The static engine's prompt tiers, without torch (`dflash plan` reads them too)."""

SMALLEST_TIER = 256  # a row's cache holds its tier + max_new_tokens


def prompt_tiers(max_prompt: int, smallest: int = SMALLEST_TIER) -> list[int]:
    """Prompt-length limits of the static engine's caches: powers of two from `smallest`, then
    `max_prompt` (a prompt is always shorter than that)."""
    tiers = []
    while smallest < max_prompt:
        tiers.append(smallest)
        smallest *= 2
    return [*tiers, max_prompt]
