"""Does a wheel set carried to the GPU box install whole there? Every requirement (Requires-Dist)
of every wheel in DIR, with its environment markers read for the box (CPython 3.12 on Linux
x86_64) and the extras other wheels ask for, must be met by a wheel in DIR or by a package of the
box's image; a pin on an image package whose version is known must hold. `pip install --no-deps
--target` checks none of this.

    python3 tools/gpu-box/wheel_closure.py DIR [--accept WHO:WHAT ...] [--leave NAME ...] [--missing]
    python3 tools/gpu-box/wheel_closure.py DIR --installed      # on the box

The image's packages are tools/gpu-box/image-packages.txt (versions where known), or with
--installed those of the Python running this (importlib.metadata: on the box, with PYTHONPATH
empty, the image itself, so every pin is checked). Prints the set's wheels that shadow an image
package, the pins it could not check, and what is missing or in conflict: exit 1 for anything
missing or a conflict not accepted (`--accept mistral-common:numpy`: that package's requirement
on that one, known broken and harmless; `--leave tilelang`: a requirement left out of the set on
purpose, listed but not missing). With --missing, only the missing requirements, one a
line, as `pip download` takes them (to grow a set).
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

IMAGE = Path(__file__).with_name("image-packages.txt")
# The box's interpreter (KINDS.md: python3 is Python 3.12.3 on Linux x86_64)
BOX = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "platform_release": "",
    "platform_version": "",
}


def metadata(wheel: Path) -> tuple[str, Version, list[Requirement]]:
    """A wheel's name, version and requirements, from its .dist-info/METADATA."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if len(names) != 1:
            raise SystemExit(f"{wheel}: {len(names)} .dist-info/METADATA files, not one")
        meta = Parser().parsestr(z.read(names[0]).decode())
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    return canonicalize_name(meta["Name"]), Version(meta["Version"]), requires


def listed_packages(path: Path) -> dict[str, Version | None]:
    """Image package -> its version where the list gives one (NAME or NAME==VERSION a line)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version) if version else None
    return out


def installed_packages() -> dict[str, Version | None]:
    """The packages of the Python running this, with their versions."""
    from importlib.metadata import distributions

    out = {}
    for dist in distributions():
        try:
            out.setdefault(canonicalize_name(dist.metadata["Name"]), Version(dist.version))
        except (InvalidVersion, TypeError):
            continue
    return out


def closure(
    wheels: list[Path], image: dict[str, Version | None], leave: frozenset[str] = frozenset()
) -> dict[str, list[str]]:
    """What the set leaves unmet: `missing` ("requirement  # who needs it": neither carried nor in
    the image), `conflicts` (a version that breaks a pin), `unchecked` (a pin on an image package
    of unknown version), `left` (a requirement on a package of `leave`, left out on purpose),
    `shadows` (a carried wheel over the image's own package)."""
    found = {}
    for wheel in wheels:
        name, version, requires = metadata(wheel)
        if name in found:
            raise SystemExit(f"{wheel}: a second wheel of {name} in the set")
        found[name] = (version, requires)
    extras = {name: {""} for name in found}  # the extras some wheel asks of each package
    report = {"missing": set(), "conflicts": set(), "unchecked": set(), "left": set()}
    done, changed = set(), True
    while changed:  # an extra asked late opens requirements of a wheel already read
        changed = False
        for name, (version, requires) in found.items():
            for extra in sorted(extras[name]):
                if (name, extra) in done:
                    continue
                done.add((name, extra))
                changed = True
                for req in requires:
                    if req.marker and not req.marker.evaluate({**BOX, "extra": extra}):
                        continue
                    dep = canonicalize_name(req.name)
                    if dep in leave and dep not in found:
                        report["left"].add(f"{req}  # {name} {version}")
                        continue
                    extras.setdefault(dep, {""}).update(req.extras)
                    judge(report, f"{name} {version}", req, dep, found, image)
    shadows = {f"{n} {found[n][0]} (image: {image[n] or 'version not listed'})"
               for n in found if n in image}  # fmt: skip
    return {**{k: sorted(v) for k, v in report.items()}, "shadows": sorted(shadows)}


def judge(report: dict, who: str, req: Requirement, dep: str, found: dict, image: dict) -> None:
    spec = f"{req.name}{req.specifier}"
    if dep in found:
        if not req.specifier.contains(found[dep][0], prereleases=True):
            report["conflicts"].add(f"{who} needs {spec}; the set has {found[dep][0]}")
    elif dep in image:
        if image[dep] is None:
            if req.specifier:
                report["unchecked"].add(f"{who} needs {spec}; the image's version is not listed")
        elif not req.specifier.contains(image[dep], prereleases=True):
            report["conflicts"].add(f"{who} needs {spec}; the image has {image[dep]}")
    else:
        report["missing"].add(f"{spec}  # {who}")


def accepted(conflict: str, accepts: list[str]) -> bool:
    """`who:what` accepts the conflict of package `who` on its requirement `what`."""
    for pair in accepts:
        who, _, what = pair.partition(":")
        words = conflict.split()
        if canonicalize_name(words[0]) == canonicalize_name(who) and canonicalize_name(
            Requirement(words[3].rstrip(";")).name
        ) == canonicalize_name(what):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a folder of wheels")
    parser.add_argument("--image", type=Path, default=IMAGE, help="the image's package list")
    parser.add_argument("--installed", action="store_true", help="the running Python's packages")
    parser.add_argument("--accept", action="append", default=[], metavar="WHO:WHAT")
    parser.add_argument(
        "--leave",
        action="append",
        default=[],
        metavar="NAME",
        help="a package left out on purpose: requirements on it are not missing",
    )
    parser.add_argument("--missing", action="store_true", help="print only what is missing")
    args = parser.parse_args(argv)
    wheels = sorted(args.dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"{args.dir}: no wheels")
    image = installed_packages() if args.installed else listed_packages(args.image)
    report = closure(wheels, image, frozenset(canonicalize_name(n) for n in args.leave))
    if args.missing:
        print("\n".join(dict.fromkeys(m.split("  # ")[0] for m in report["missing"])))
        return 0
    known = [c for c in report["conflicts"] if accepted(c, args.accept)]
    report["conflicts"] = [c for c in report["conflicts"] if c not in known]
    total = sum(w.stat().st_size for w in wheels)
    print(f"{args.dir}: {len(wheels)} wheels, {total / 1e6:.0f} MB")
    for key, title in (("shadows", "carried over the image's own"),
                       ("unchecked", "pins on image packages of unlisted version"),
                       ("accepted", "conflicts accepted (--accept)"),
                       ("left", "left out on purpose (--leave)"),
                       ("conflicts", "CONFLICTS"), ("missing", "MISSING")):  # fmt: skip
        lines = known if key == "accepted" else report[key]
        if lines:
            print(f"{title} ({len(lines)}):\n  " + "\n  ".join(lines))
    bad = report["missing"] or report["conflicts"]
    print("the set installs whole" if not bad else "the set does NOT install whole")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
