"""The tooling subcommands of `prefill-accel`: targets, fetch, apply, install, build, verify, edit, export, rebase."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

from ..commands import Command, progress_of
from .targets import Targets


def _target_arg(parser) -> None:
    parser.add_argument("target", metavar="TARGET", help="a target or alias (see `prefill-accel targets`)")


# targets -------------------------------------------------------------------------------------------

def _configure_targets(p):
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _run_targets(args) -> int:
    targets = Targets.load()
    if args.json:
        print(json.dumps({"targets": {n: dataclasses.asdict(t) for n, t in targets.targets.items()},
                          "aliases": targets.aliases}, indent=2))
        return 0
    aliases: dict[str, list[str]] = {}
    for alias, name in targets.aliases.items():
        aliases.setdefault(name, []).append(alias)
    for name, t in targets.targets.items():
        also = f" (alias {', '.join(aliases[name])})" if name in aliases else ""
        print(f"{name}{also}\n  image {t.image} FROM {t.base_image}, torch {t.torch}\n"
              f"  upstream {t.git_url} @ {t.git_tag}, artifact {t.artifact}\n"
              f"  upstream CPU tests: {len(t.cpu_tests)} file(s)"
              + (f" ({t.no_cpu_tests_reason})" if t.no_cpu_tests_reason else ""))
    return 0


# fetch / apply / install ----------------------------------------------------------------------------

def _configure_fetch(p):
    _target_arg(p)
    p.add_argument("dir", type=Path, metavar="DIR", help="new directory for the upstream git tree")


def _run_fetch(args) -> int:
    from .fetch import fetch

    targets = Targets.load()
    target = targets.resolve(args.target)
    fetch(target, args.dir, targets.root, progress_of(args))
    print(f"{target.name}: upstream tree at {target.git_tag} in {args.dir}")
    return 0


def _configure_apply(p):
    _target_arg(p)
    p.add_argument("tree", type=Path, metavar="TREE",
                   help="an upstream git tree (from fetch) or the directory holding the installed package "
                        "(site-packages)")
    p.add_argument("--no-overlay", action="store_true", help="apply the patches only (no overlay, no stamp)")


def _run_apply(args) -> int:
    from .apply import apply

    targets = Targets.load()
    target = targets.resolve(args.target)
    result = apply(target, args.tree, targets.root, progress_of(args), with_overlay=not args.no_overlay)
    print(f"{target.name}: applied {len(result.patches)} patch(es) and {len(result.overlay)} overlay "
          f"file(s) to {result.layout.root} ({result.layout.kind}), series hash {result.series_hash}")
    return 0


def _configure_install(p):
    _target_arg(p)
    p.add_argument("--python", default="python3", help="interpreter of the environment to patch (default python3)")
    p.add_argument("--no-runtime", action="store_true", help="do not pip-install the runtime package")


def _run_install(args) -> int:
    from .install import install, patched_modules

    targets = Targets.load()
    target = targets.resolve(args.target)
    result = install(target, targets.root, args.python, progress_of(args), runtime=not args.no_runtime)
    print(f"{target.name}: patched {result.layout.root} (series hash {result.series_hash}); "
          f"changed modules: {', '.join(patched_modules(result)) or 'none'}")
    return 0


# build -------------------------------------------------------------------------------------------------

def _configure_build(p):
    from .images import BUILDERS
    from .standin import DEBIAN_SUITE

    _target_arg(p)
    p.add_argument("--venv", type=Path, metavar="DIR",
                   help="build a virtualenv in DIR instead of an image (the default where no image builder works)")
    flavour = p.add_mutually_exclusive_group()
    flavour.add_argument("--gpu", action="store_true", default=None,
                         help="with --venv: the engine with the dependencies its wheel pins (CUDA torch, Triton, "
                              "its CUDA kernels), as the official image installs it (the default where nvidia-smi "
                              "lists a GPU)")
    flavour.add_argument("--cpu", dest="gpu", action="store_false",
                         help="with --venv: the pinned CPU import/test dependencies, no CUDA packages (the default "
                              "without a GPU)")
    p.add_argument("--builder", choices=BUILDERS,
                   help="image builder (default: docker where a Docker engine answers, else buildah where installed)")
    p.add_argument("--stand-in-base", action="store_true",
                   help="build FROM a stand-in for the official image, made here (a Debian rootfs by debootstrap, "
                        "as root; the pinned engine with its CPU dependencies): the image builds and its engine "
                        "parses its flags without the official image or a GPU; tagged IMAGE-stand-in")
    p.add_argument("--debian-mirror", metavar="URL",
                   help="where debootstrap fetches the stand-in's Debian packages (default: the archive this "
                        f"machine's apt uses for {DEBIAN_SUITE})")


def _run_build(args) -> int:
    from ..errors import UsageError
    from . import envbuild, images, standin

    targets = Targets.load()
    target = targets.resolve(args.target)
    progress = progress_of(args)
    if args.venv is not None and (args.builder or args.stand_in_base):
        raise UsageError("--venv builds a virtualenv, not an image: drop --builder and --stand-in-base")
    if args.venv is None and args.gpu is not None:
        raise UsageError(f"--{'gpu' if args.gpu else 'cpu'} picks the virtualenv's dependencies: pass --venv DIR too")
    builder = None if args.venv is not None else images.choose_builder(args.builder)
    if builder is None and args.stand_in_base:
        raise UsageError(f"--stand-in-base builds images: {images.no_builder_message()}")
    series = envbuild.series_hash(target, targets.root)
    if builder is not None and args.stand_in_base:
        base = standin.build_stand_in_base(builder, target, targets.root, progress, args.debian_mirror)
        image = images.build_image(builder, target, targets.root, progress, base, standin.image_tag(target))
        print(f"Built image {image} (series hash {series}) FROM {base}, a stand-in for {target.base_image}: "
              f"its engine parses its flags and starts until it needs a GPU; it serves nothing.")
        return 0
    if builder is not None:
        image = images.build_image(builder, target, targets.root, progress)
        print(f"Built image {image} (series hash {series}) with {builder}.\nRun it:\n  "
              + target.run_example.format(image=image))
        if builder == "buildah":
            print(f"(buildah keeps it in containers-storage, where podman runs it; `buildah push {image} "
                  f"docker-daemon:{image}` hands it to a Docker engine.)")
        return 0
    venv = args.venv or targets.root / "build" / "venv" / target.name
    if args.venv is None:
        progress.note(f"{images.no_builder_message()}: building the virtualenv flavour instead (same install step).")
    gpu = envbuild.gpu_listed() if args.gpu is None else args.gpu
    if args.gpu is None:
        progress.note("A GPU is listed: building with the engine's CUDA dependencies (--cpu for the CPU set)." if gpu
                      else "No GPU listed: building with the CPU import/test dependencies (--gpu for the CUDA set).")
    python = envbuild.build_venv(target, targets.root, venv, progress, gpu=gpu)
    flavour = "its CUDA dependencies" if gpu else "its CPU import/test dependencies (no GPU runs)"
    print(f"Built virtualenv {venv} with patched {target.name} (series hash {series}) and {flavour}.\nUse it:\n  "
          f"{shlex.quote(str(python))} -c 'import {target.package}'\nThe image flavour (needs an image builder "
          f"and a GPU) runs as:\n  " + target.run_example.format(image=target.image))
    return 0


# verify ------------------------------------------------------------------------------------------------

def _configure_verify(p):
    _target_arg(p)
    p.add_argument("--python", help="interpreter with the engine's test dependencies (default: the target's "
                                    "cached test environment, $PREFILL_ACCEL_CACHE/envs/TARGET, built on first use; "
                                    "this interpreter for a target without upstream CPU tests)")
    p.add_argument("--work", type=Path, help="keep the trees and test reports in this new directory")
    p.add_argument("--tests", nargs="+", metavar="PATH",
                   help="upstream tests to run instead of the target's cpu_tests or gpu_tests (tree-relative)")
    p.add_argument("--gpu", action="store_true",
                   help="run the target's gpu_tests on this machine's GPU: the wheel keeps its compiled kernels and "
                        "Triton compiles for the device; needs --python of a GPU environment (build.sh --venv DIR --gpu)")


def _run_verify(args) -> int:
    from .verify import verify

    targets = Targets.load()
    target = targets.resolve(args.target)
    report = verify(target, targets.root, args.python, args.work, args.tests, progress_of(args), args.gpu)
    print(report.render())
    return 0 if report.ok else 1


# edit / export -----------------------------------------------------------------------------------------

def _configure_edit(p):
    _target_arg(p)
    p.add_argument("dir", type=Path, nargs="?", metavar="DIR", help="work tree (default build/edit/TARGET)")


def _run_edit(args) -> int:
    from .export import default_work_tree, edit

    targets = Targets.load()
    target = targets.resolve(args.target)
    tree = args.dir or default_work_tree(target, targets.root)
    edit(target, tree, targets.root, progress_of(args))
    print(f"{tree}: {target.git_tag} plus the {target.name} series as commits.\n"
          f"Edit with git (one commit per patch; amend, rebase -i, add commits), then:\n"
          f"  prefill-accel export {target.name}" + (f" --tree {tree}" if args.dir else ""))
    return 0


def _configure_export(p):
    _target_arg(p)
    p.add_argument("--tree", type=Path, help="the edit work tree (default build/edit/TARGET)")


def _run_export(args) -> int:
    from .export import default_work_tree, export

    targets = Targets.load()
    target = targets.resolve(args.target)
    names = export(target, args.tree or default_work_tree(target, targets.root), targets.root,
                   progress=progress_of(args))
    print(f"{target.patch_dir(targets.root)}: {len(names)} patch(es)\n" + "".join(f"  {n}\n" for n in names), end="")
    return 0


# rebase -------------------------------------------------------------------------------------------------

def _configure_rebase(p):
    p.add_argument("engine", metavar="ENGINE")
    p.add_argument("from_version", metavar="FROM", help="a pinned version of ENGINE")
    p.add_argument("to_version", metavar="TO", help="the new upstream version")
    p.add_argument("--upstream", metavar="URL_OR_PATH",
                   help="git repository holding TO's tag (default: fetch TO like any target)")
    p.add_argument("--work", type=Path, help="work tree (default build/rebase/ENGINE-TO)")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="finish a rebase whose conflicts were resolved and staged in the work tree")


def _run_rebase(args) -> int:
    from .rebase import continue_rebase, default_work_tree, rebase

    targets = Targets.load()
    work = args.work or default_work_tree(args.engine, args.to_version, targets.root)
    if args.cont:
        target = continue_rebase(targets, work, progress_of(args))
    else:
        target = rebase(targets, args.engine, args.from_version, args.to_version, work, args.upstream,
                        progress_of(args))
    print(f"{target.name}: series rebased; review with `git diff -- patches overlay`")
    return 0


TOOLING_COMMANDS: dict[str, Command] = {
    "targets": Command("list the pinned targets and aliases", _configure_targets, _run_targets),
    "fetch": Command("clone a target's upstream tree at its pinned tag (git, else the registry artifact)",
                     _configure_fetch, _run_fetch),
    "apply": Command("apply the patch series and overlay to a tree, all or nothing", _configure_apply, _run_apply),
    "install": Command("patch the engine installed in a Python environment and add the runtime package",
                       _configure_install, _run_install),
    "build": Command("build the patched engine: an image (docker or buildah), or a virtualenv without either",
                     _configure_build, _run_build),
    "verify": Command("run upstream's CPU tests unpatched vs patched plus ours; fail on regressions",
                      _configure_verify, _run_verify),
    "edit": Command("make a git work tree with the series as commits for hand editing", _configure_edit, _run_edit),
    "export": Command("regenerate patches/ENGINE/VERSION from an edit work tree, deterministically",
                      _configure_export, _run_export),
    "rebase": Command("replay a series onto a new upstream release with 3-way merges",
                      _configure_rebase, _run_rebase),
}
