"""The pinned targets file (patches/targets.toml): load it, resolve aliases, add a target."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (some official engine images): pip vendors the same parser
    from pip._vendor import tomli as tomllib

from ..errors import UsageError

TARGETS_FILE = Path("patches") / "targets.toml"
ROOT_ENV = "PREFILL_ACCEL_ROOT"


@dataclasses.dataclass(frozen=True)
class Target:
    """One pinned upstream release and everything the tools need to know about it."""

    engine: str
    version: str
    series_version: int
    git_url: str
    git_tag: str
    git_commit: str
    artifact: str
    artifact_sha256: str
    wheel: str
    wheel_sha256: str
    base_image: str
    torch: str
    path_prefix: str
    package: str
    cpu_tests: tuple[str, ...] = ()
    no_cpu_tests_reason: str = ""
    cpu_test_plugins: tuple[str, ...] = ()
    cpu_test_models: tuple[str, ...] = ()
    venv_requirements: str = ""
    venv_remove: tuple[str, ...] = ()
    gpu_constraints: tuple[str, ...] = ()
    gpu_tests: tuple[str, ...] = ()
    """Upstream test files (or node ids) that `verify --gpu` runs on a GPU machine for the patched areas."""
    gpu_test_models: tuple[str, ...] = ()
    """As cpu_test_models, for the gpu_tests."""
    gpu_wheels: tuple[str, ...] = ()
    """The engine's wheels for other Pythons, "FILENAME SHA256" each: `build --venv --gpu` installs the one
    that fits the environment's Python where ``wheel`` (pinned for the CPU tests' Python) does not."""
    gpu_first_use_imports: tuple[str, ...] = ()
    """Modules the engine imports on a feature's first use (a request), not at startup, "MODULE FEATURE"
    each: `build --venv --gpu` imports each and names the features that would fail where one does not."""
    overlay_replaces: tuple[str, ...] = ()
    run_example: str = ""

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.version}"

    @property
    def package_path(self) -> str:
        """Tree-relative directory of the Python package, e.g. "vllm" or "python/sglang"."""
        return f"{self.path_prefix}{self.package}"

    @property
    def image(self) -> str:
        return f"prefill-accel/{self.engine}:{self.version}-pa{self.series_version}"

    def wheel_for(self, python_tag: str) -> tuple[str, str]:
        """The pinned engine wheel (file name, sha256) that installs on CPython ``python_tag`` ("cp312"):
        ``wheel``, else the first of ``gpu_wheels`` that does."""
        pins = [(self.wheel, self.wheel_sha256), *((entry.split() + [""])[:2] for entry in self.gpu_wheels)]
        for name, sha256 in pins:
            if wheel_installs_on(name, python_tag):
                return name, sha256
        raise UsageError(f"{self.name}: no pinned wheel installs on {python_tag} ({', '.join(name for name, _ in pins)}); "
                         f"add one to gpu_wheels in {TARGETS_FILE}")  # fmt: skip

    def patch_dir(self, root: Path) -> Path:
        return root / "patches" / self.engine / self.version

    def overlay_dir(self, root: Path) -> Path:
        return root / "overlay" / self.engine / self.version

    def to_toml(self) -> str:
        """This target as a `[targets."NAME"]` table, in field order."""
        lines = [f'[targets."{self.name}"]']
        for field in dataclasses.fields(self):
            lines.append(f"{field.name} = {_toml_value(getattr(self, field.name))}")
        return "\n".join(lines) + "\n"


def wheel_installs_on(filename: str, python_tag: str) -> bool:
    """Whether a wheel installs on CPython ``python_tag`` ("cp312") by its file name's Python and ABI tags:
    that version's own, a CPython stable-ABI wheel (abi3) of that version or older, or pure Python 3."""
    *_, python, abi, _platform = filename.removesuffix(".whl").split("-")
    minor = int(python_tag.removeprefix("cp3"))
    for tag in python.split("."):
        if tag == python_tag or tag == "py3":
            return True
        if abi == "abi3" and tag.startswith("cp3") and int(tag.removeprefix("cp3")) <= minor:
            return True
    return False


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        if not value:
            return "[]"
        return "[\n" + "".join(f"    {_toml_value(v)},\n" for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def find_root(start: Path | None = None) -> Path:
    """The prefill-accel checkout: $PREFILL_ACCEL_ROOT, else the nearest parent holding patches/targets.toml."""
    if os.environ.get(ROOT_ENV):
        root = Path(os.environ[ROOT_ENV]).resolve()
        if not (root / TARGETS_FILE).is_file():
            raise UsageError(f"${ROOT_ENV}={root} has no {TARGETS_FILE}")
        return root
    candidates = [Path(start or Path.cwd()).resolve(), Path(__file__).resolve()]
    for candidate in candidates:
        for directory in [candidate, *candidate.parents]:
            if (directory / TARGETS_FILE).is_file():
                return directory
    raise UsageError(
        f"cannot find {TARGETS_FILE}: run from a prefill-accel checkout or set ${ROOT_ENV}"
    )


class Targets:
    """All targets and aliases of one checkout."""

    def __init__(self, root: Path):
        self.root = root
        self.path = root / TARGETS_FILE
        with open(self.path, "rb") as f:
            data = tomllib.load(f)
        self.aliases: dict[str, str] = dict(data.get("aliases", {}))
        self.targets: dict[str, Target] = {}
        for name, table in data.get("targets", {}).items():
            target = _target_from_table(name, table, self.path)
            self.targets[target.name] = target

    @classmethod
    def load(cls, root: Path | None = None) -> "Targets":
        return cls(root or find_root())

    def resolve(self, name: str) -> Target:
        """A target by name or alias; a usage error listing the known names otherwise."""
        resolved = self.aliases.get(name, name)
        if resolved not in self.targets:
            known = ", ".join([*self.targets, *self.aliases])
            raise UsageError(f"unknown target {name!r}; known: {known}")
        return self.targets[resolved]

    def for_engine(self, engine: str, version: str) -> Target:
        return self.resolve(f"{engine}-{version}")

    def add(self, target: Target) -> None:
        """Append a new target table to the targets file (existing text and comments are kept)."""
        if target.name in self.targets:
            raise UsageError(f"target {target.name} already exists in {self.path}")
        text = self.path.read_text()
        self.path.write_text(text.rstrip("\n") + "\n\n" + target.to_toml())
        self.targets[target.name] = target


def target_from_toml(text: str) -> Target:
    """The single target of a `[targets."NAME"]` TOML snippet (as written by Target.to_toml)."""
    (name, table), = tomllib.loads(text)["targets"].items()
    return _target_from_table(name, table, Path("<snippet>"))


def _target_from_table(name: str, table: dict, path: Path) -> Target:
    fields = {f.name for f in dataclasses.fields(Target)}
    unknown = set(table) - fields
    if unknown:
        raise UsageError(f"{path}: target {name}: unknown keys {sorted(unknown)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    try:
        target = Target(**values)
    except TypeError as e:
        raise UsageError(f"{path}: target {name}: {e}") from None
    if target.name != name:
        raise UsageError(f"{path}: table {name!r} describes {target.name!r}")
    if target.path_prefix and not target.path_prefix.endswith("/"):
        raise UsageError(f"{path}: target {name}: path_prefix must end with '/'")
    if not target.cpu_tests and not target.no_cpu_tests_reason:
        raise UsageError(f"{path}: target {name}: no cpu_tests; say why in no_cpu_tests_reason")
    return target
