"""A config file that is not valid YAML, named with its file, line and column.

Snakemake reads `--configfile` before the workflow's own code runs and reports a syntax error
as "Config file is not valid JSON or YAML", naming neither the file nor the line. `install()`
(run at the start of every Python of this environment: scripts/setup.sh writes a .pth file
that calls it) wraps Snakemake's config loader once `snakemake.common.configfile` is imported,
so that the same error says where: `config file my.yaml, line 12, column 3: YAML syntax error:
mapping values are not allowed here`. It changes nothing else, and nothing when the file reads.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder
from pathlib import Path

MODULE = "snakemake.common.configfile"


def syntax_error(path) -> str | None:
    """`config file PATH, line L, column C: YAML syntax error: ...` for a file that does not
    parse as YAML (nor JSON), else None."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return f"config file {path}: cannot be read: {e}"
    try:
        yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"config file {path}{where}: YAML syntax error: {e.problem or e.context}"
    except yaml.YAMLError as e:
        return f"config file {path}: YAML syntax error: {e}"
    return None


def _patch(module) -> None:
    if getattr(module, "_names_the_line", False):
        return
    load = module._load_configfile

    def load_naming_the_line(configpath_or_obj, filetype="Config"):
        try:
            return load(configpath_or_obj, filetype)
        except Exception as e:
            if filetype == "Config" and isinstance(configpath_or_obj, (str, Path)):
                if (message := syntax_error(configpath_or_obj)) is not None:
                    # the same error, re-raised: Snakemake shows no frames of its own code
                    e.args = (message,)
            raise

    module._load_configfile = load_naming_the_line
    module._names_the_line = True


class _Finder(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Wrap Snakemake's config loader when it is imported (now, if it already is)."""
    if MODULE in sys.modules:
        _patch(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
