"""Print the requirements of a folder of wheels that no wheel in it meets, for a target CPython.

Usage: python scripts/e2e/unmet_requirements.py WHEELS_DIR PYTHON_VERSION      (e.g. 3.12)

`pip download --python-version` picks wheels by the target's tags but evaluates environment markers
with the interpreter that runs pip, so a dependency declared only for newer Pythons (vLLM 0.6.3.post1:
``six>=1.16.0; python_version > "3.11"``) is left out when a 3.11 machine stages for a 3.12 one, and the
offline install there fails. This reads every wheel's Requires-Dist, evaluates the markers for the target
(Linux x86_64 CPython, with the extras other wheels ask for), and prints one requirement per line that no
staged wheel satisfies (by name and version). Nothing printed: the set is closed.
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def target_environment(python_version: str) -> dict[str, str]:
    env = default_environment()
    full = python_version if python_version.count(".") == 2 else python_version + ".0"
    env.update(python_version=".".join(full.split(".")[:2]), python_full_version=full, implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")  # fmt: skip
    return env


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        metadata = Parser().parsestr(archive.read(name).decode())
    return [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]


def unmet(wheels: Path, python_version: str) -> list[str]:
    staged = {}
    requirements = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name, version, *_ = parse_wheel_filename(wheel.name)
        staged[name] = version
        requirements[name] = wheel_requirements(wheel)
    env = target_environment(python_version)
    # The extras each staged distribution is asked for, grown until no requirement adds one.
    extras: dict[str, set[str]] = {name: {""} for name in staged}
    changed = True
    while changed:
        changed = False
        for name, reqs in requirements.items():
            for req in reqs:
                if _applies(req, env, extras[name]):
                    wanted = extras.setdefault(canonicalize_name(req.name), {""})
                    if not set(req.extras) <= wanted:
                        wanted |= set(req.extras)
                        changed = True
    missing = []
    for name, reqs in requirements.items():
        for req in reqs:
            if not _applies(req, env, extras[name]):
                continue
            have = staged.get(canonicalize_name(req.name))
            if have is None or not req.specifier.contains(have, prereleases=True):
                missing.append(str(req).split(";")[0].strip())
    return sorted(set(missing))


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    return req.marker is None or any(req.marker.evaluate({**env, "extra": extra}) for extra in extras)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    for line in unmet(Path(sys.argv[1]), sys.argv[2]):
        print(line)


if __name__ == "__main__":
    main()
