"""Patch-series tooling: turn patches/ + overlay/ + the runtime package into a patched engine.

Modules, one job each:
  targets   the pinned targets file (patches/targets.toml) and alias resolution
  registry  download a pinned file from the package index, checksum-verified, cached
  fetch     the upstream tree at a pinned tag: git clone, or the registry artifact as a git repo
  series    a quilt patch directory: series file, patch parsing, series hash
  overlay   the overlay tree: where its files land and the no-silent-overwrite check
  apply     atomic apply of series + overlay to a git tree or an installed package
  journal   what makes a change survive a signal or a kill: held signals, rollback, recovery
  export    `edit` work trees and deterministic `export` back to patches/
  rebase    replay the series onto a new upstream release (GitPython)
  verify    upstream's CPU tests, unpatched vs patched, regressions only
  envbuild  the virtualenv flavour of the image build (build.sh --venv)
  images    the image build: docker or buildah, their command line, the build context
  standin   a stand-in for a target's official image, built here (build.sh --stand-in-base)

Engine-specific facts live in patches/targets.toml (and, for the stand-in bases, docker/stand-in/),
never in this code. Standard library and git only (GitPython for rebase): nothing here imports torch.
Errors, progress output and the subcommand type are shared with the serving tools (prefill_accel.errors,
.progress, .commands).
"""
