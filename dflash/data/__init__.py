"""Data stages: sources -> expand -> regenerate -> tokenize -> length statistics."""
