"""The package's layout: no import circle among `dflash` modules, the one-way doors between its
subpackages, and no module over 400 lines. Read from the source with `ast`, so an import inside a
function counts as much as one at the top of a file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash"
MAX_LINES = 400

# (importer, imported): a module under the first prefix never imports one under the second.
DOORS = [
    ("dflash.data", "dflash.train"),
    ("dflash.data", "dflash.eval"),
    ("dflash.eval", "dflash.train"),
    ("dflash.model", "dflash.data"),
    ("dflash.model", "dflash.train"),
    ("dflash.model", "dflash.eval"),
    ("dflash.model", "dflash.cli"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The `dflash` modules that `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module `pkg.mod`; `from mod import name`, `mod`.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_imports():
    edges = graph()
    assert "dflash.model.drafter" in edges
    assert "dflash.io" in edges["dflash.model.drafter"]
    # `from dflash.model import modeling_dflash` names the module, not the package.
    assert "dflash.model.modeling_dflash" in edges["dflash.model.drafter"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert circles(graph()) == []


@pytest.mark.parametrize(("importer", "imported"), DOORS)
def test_one_way_doors(importer, imported):
    crossings = sorted(
        (name, dep)
        for name, deps in graph().items()
        if under(name, importer)
        for dep in deps
        if under(dep, imported)
    )
    assert crossings == [], f"{importer} imports {imported}"


def test_no_module_over_400_lines():
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


REPO = PACKAGE.parent


def test_bench_holds_benchmarks_only_and_the_product_reads_nothing_from_it():
    """The tooling that moves files to and from a GPU host without network lives in
    tools/gpu-box/, the model configs the product reads in config/models/; what the product's
    code, workflow and configs name under bench/ is a benchmark script or a result they cite."""
    bench = REPO / "bench"
    assert not sorted(bench.glob("*.sh")), "shell tooling belongs in tools/gpu-box/"
    assert not [p.name for p in bench.rglob("*carry*")]
    assert not [p for p in bench.iterdir() if p.is_dir() and p.name not in ("results",)]
    product = [
        *PACKAGE.rglob("*.py"),
        *(REPO / "workflow").rglob("*"),
        *(REPO / "config").rglob("*"),
    ]
    for path in product:
        if path.is_file() and path.suffix in (".py", ".smk", ".yaml", ".json", ""):
            for ref in re.findall(r"(?<![\w-])bench/[\w./-]*\w", path.read_text(errors="replace")):
                ok = ref.endswith(".py") or ref.startswith("bench/results")
                assert ok, f"{path.relative_to(REPO)} reads {ref} from bench/"


def test_the_gpu_box_scripts_parse_edit_no_git_metadata_and_name_no_machine_of_ours():
    import subprocess

    box = REPO / "tools" / "gpu-box"
    scripts = sorted(box.glob("*.sh"))
    assert {"h200.sh", "h200-carry.sh", "stages.sh"} <= {p.name for p in scripts}
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        assert ".git/info" not in text, script.name
        assert not re.search(r"(^|[\s\"'=(])/work/", text, flags=re.M), script.name  # ours
        assert "bench/h200" not in text and "bench/stages" not in text, script.name
    assert "/.carry*/" in (REPO / ".gitignore").read_text().splitlines()


def test_the_readme_tree_names_every_folder_of_the_repository_and_the_package():
    readme = (REPO / "README.md").read_text()
    tree = readme.split("## Layout", 1)[1].split("```", 2)[1]
    named, parent = set(), ""
    for line in tree.splitlines():
        if not line.strip():
            continue
        name = line.split()[0].rstrip("/")
        if line.startswith("  "):
            name = f"{parent}/{name}"
        else:
            parent = name
        named |= {"/".join(name.split("/")[: i + 1]) for i in range(name.count("/") + 1)}
    for name in named:
        assert (REPO / name).is_dir(), f"README's layout names {name}/, which does not exist"
    listed = subprocess_lines(["git", "-C", str(REPO), "ls-files"])
    folders = {p.split("/")[0] for p in listed if "/" in p and not p.startswith(".")}
    folders |= {f"dflash/{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders - {"resources"} <= named, folders - named


def subprocess_lines(cmd: list[str]) -> list[str]:
    import subprocess

    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
