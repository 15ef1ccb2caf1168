"""Config mistakes as one line each, naming where they are: the file and line that set the key
(or `--config`), the key, and for a misspelt key the nearest valid one (difflib). Snakemake's own
schema check printed the whole schema section below a typo (218-229 lines), and a YAML syntax
error named neither the file nor the line (`dflash.yaml_lines` answers that one)."""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml


def describe(schema: dict) -> str:
    """What a schema accepts, in words: "an integer >= 1", "'auto'", "one of [a, b]"."""
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"]))
    if "oneOf" in schema or "anyOf" in schema:
        return " or ".join(describe(s) for s in schema.get("oneOf") or schema["anyOf"])
    kind = schema.get("type", "a value")
    kinds = kind if isinstance(kind, list) else [kind]
    words = " or ".join("null" if k == "null" else f"a{'n' * (k[0] in 'aeiou')} {k}" for k in kinds)
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<=")):
        if key in schema:
            words += f" {sign} {schema[key]}"
    return words


def key_line(path: Path, keys: list) -> int | None:
    """The line (1-based) of a dotted key in a YAML file, where the file sets it."""
    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for key in keys:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if k.value == str(key)), None)
            if found is None:
                return line
            line, node = found[0].start_mark.line + 1, found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def where(keys: list, configfiles: list[str], cli: dict | None) -> str:
    """`file, line N` of the last config file that sets the key (later files win), `--config`
    for a key given there, else the workflow's config."""
    if cli and _holds(cli, keys):
        return "--config"
    for name in reversed(configfiles):
        try:
            data = yaml.safe_load(Path(name).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if _holds(data, keys[:1]) and (line := key_line(Path(name), keys)):
            return f"{name}, line {line}"
    return "the workflow config"


def _holds(data, keys: list) -> bool:
    for key in keys:
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and key < len(data):
            data = data[key]
        else:
            return False
    return True


def one_line(error, configfiles: list[str] = (), cli: dict | None = None) -> list[str]:
    """A jsonschema error as lines of `where: key: what is wrong`, one per unknown key."""
    path = list(error.absolute_path)
    dotted = ".".join(map(str, path))
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        lines = []
        for key in sorted(set(error.instance) - set(known)):
            full = f"{dotted}.{key}" if dotted else key
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = (
                f"did you mean {f'{dotted}.' if dotted else ''}{near[0]}?"
                if near
                else f"the keys here are {', '.join(known)}"
            )
            lines.append(f"{where([*path, key], configfiles, cli)}: {full}: unknown key; {hint}")
        return lines
    if error.validator in ("oneOf", "anyOf"):
        what = f"{error.instance!r} is not {describe(error.schema)}"
    else:
        what = error.message
    return [f"{where(path, configfiles, cli)}: {dotted or '<top>'}: {what}"]
