"""Just enough of a Dockerfile reader for the tests: what a build stage ends with as ENTRYPOINT and WORKDIR.

A stage inherits both from the stage (or image) it is FROM; `resolve` follows FROM through the stages of
the same file, as a build of that stage (`--target NAME`) does.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field


@dataclass
class Stage:
    name: str
    base: str
    entrypoint: list[str] | None = None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comments and blank lines dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def stages(text: str) -> dict[str, Stage]:
    """Every stage of the Dockerfile text by name (an unnamed stage by its index)."""
    found: dict[str, Stage] = {}
    stage = None
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(found))
            stage = found[name] = Stage(name, words[0])
            continue
        if stage is None:
            continue
        stage.instructions.append((keyword, rest))
        if keyword == "ENTRYPOINT":
            stage.entrypoint = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
    return found


def resolve(text: str, name: str) -> tuple[list[str] | None, str | None]:
    """(ENTRYPOINT, WORKDIR) of stage `name` as built, following FROM through the file's stages; what an
    external base image sets is unknown here and reads as None."""
    found = stages(text)
    chain, current = [], found[name]
    while True:
        chain.append(current)
        if current.base not in found:
            break
        current = found[current.base]
    entrypoint = next((s.entrypoint for s in chain if s.entrypoint is not None), None)
    workdir = None
    for stage in reversed(chain):  # relative WORKDIRs build on the inherited one
        for keyword, rest in stage.instructions:
            if keyword == "WORKDIR":
                workdir = posixpath.join(workdir or "/", rest)
    return entrypoint, workdir
