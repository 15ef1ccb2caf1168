"""Models: the frozen target, the drafter, attention masks and losses (single-device code)."""
