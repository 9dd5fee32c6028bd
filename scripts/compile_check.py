#!/usr/bin/env python3
"""Compile every Triton kernel launch of prefill-accel for a CUDA target without a GPU.

The host functions run on small CPU inputs with every kernel launch recorded instead of run (each
tile shape an autotuned kernel may pick counts as a launch); each recorded launch is then compiled
for the target with triton's bundled ptxas. This catches what the interpreter lets through (code
that does not compile, shared memory past the GPU's limit) before a GPU run. Argument values that
triton would specialise on (ints equal to 1, alignment) are not, so the compiled code can differ in
detail from the GPU's, not in what compiles or in the shared memory the tiles need.

  python scripts/compile_check.py              # sm_90 (H100, H200): 227 KB of shared memory per block
  python scripts/compile_check.py --stable     # batches of other lengths compile nothing new (no compiling)

``--stable`` records the launches of batches that an engine of one shape meets (fresh prompts and chunks
after a prefix, lengths with and without a factor of 16, requests sliced out of a larger batch) and
checks that launches with the same compile-time arguments are specialised alike by Triton, so a server
that compiled one of them at warm-up compiles nothing inside a request.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import inspect
import itertools
import multiprocessing
import os
import signal
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check.py compiles for a GPU: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from prefill_accel import SparsePrefillConfig  # noqa: E402
from prefill_accel.layout import BatchLayout  # noqa: E402
from prefill_accel.ops import attention, search, staging  # noqa: E402
from prefill_accel.ops.common import TENSOR_DESCRIPTORS, TensorDescriptor  # noqa: E402

# K/V read modes this Triton compiles: TMA needs tensor descriptors (Triton >= 3.4; vLLM 0.6.3 runs 3.0).
READ_MODES = ("pointer", "tma") if TENSOR_DESCRIPTORS else ("pointer",)
# Triton 3.0 (beside torch 2.4) names the AST's fixed arguments `constants`, with the rest typed in
# `signature`; later releases type every parameter, fixed ones as "constexpr", and fix them in `constexprs`.
NAMED_CONSTANTS = "constants" in inspect.signature(ASTSource).parameters

SHARED_LIMIT = {90: 232448}  # bytes per block with the opt-in maximum
JOBS: list = []  # the launches to compile, shared with forked workers (kernels do not pickle)
PARENT = [0]  # the pid of the process whose pool compiles them
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def record_launches() -> list[tuple[JITFunction, dict, dict]]:
    """Make kernel launches record (kernel, arguments by name, options) instead of running."""
    launches = []

    def jit_run(self, *args, grid, warmup, **kwargs):
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
        bound = dict(zip(self.arg_names, args)) | kwargs
        # Descriptors are copied: an autotuning pre-hook reshapes the same object for the next tile.
        bound = {name: copy.copy(value) if TENSOR_DESCRIPTORS and isinstance(value, TensorDescriptor) else value
                 for name, value in bound.items()}  # fmt: skip
        launches.append((self, bound, options))

    def autotuned_run(self, *args, grid, warmup, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        named = self.nargs | kwargs
        for config in self.prune_configs(kwargs):
            if config.pre_hook:
                config.pre_hook(named | config.all_kwargs())
            jit_run(self.fn, *args, grid=grid, warmup=warmup, **kwargs, **config.all_kwargs())

    JITFunction.run = jit_run
    Autotuner.run = autotuned_run
    return launches


def argument(param, args: dict):
    """A launch's value of one kernel parameter, its default where the launch leaves it out."""
    return args[param.name] if param.name in args else param.default


def compile_launch(kernel: JITFunction, args: dict, options: dict, capability: int):
    """Compile one recorded launch; constexpr parameters and None arguments are fixed values."""
    signature, constexprs = {}, {}
    for i, param in enumerate(kernel.params):
        value = argument(param, args)
        fixed = param.is_constexpr or value is None
        if NAMED_CONSTANTS:
            if fixed:
                constexprs[param.name] = value
            if not param.is_constexpr:
                signature[param.name] = "*i8" if value is None else mangle_type(value)
        elif fixed:
            signature[param.name], constexprs[(i,)] = "constexpr", value
        else:
            signature[param.name] = mangle_type(value)
    if NAMED_CONSTANTS:
        source = ASTSource(fn=kernel, signature=signature, constants=constexprs)
    else:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def variant(kernel: JITFunction, args: dict, options: dict) -> tuple:
    """What makes two launches compile alike: constexprs, argument types, options."""
    values = [(p, argument(p, args)) for p in kernel.params]
    fixed = tuple((p.name, value) for p, value in values if p.is_constexpr or value is None)
    types = tuple(mangle_type(value) for p, value in values if not p.is_constexpr and value is not None)
    return kernel.__name__, fixed, types, tuple(sorted(options.items()))


def specialisation(kernel: JITFunction, args: dict) -> tuple:
    """How Triton specialises a launch's runtime arguments (type and value class: an int equal to 1, an
    int or address divisible by 16), as it does at a launch; the parameters a kernel leaves
    unspecialised give their type only."""
    from triton._C.libtriton import native_specialize_impl  # Triton >= 3.4

    values = [(p, argument(p, args)) for p in kernel.params]
    return tuple((p.name, native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize, True))
                 for p, value in values if not p.is_constexpr and value is not None)  # fmt: skip


def run_engine_batches() -> None:
    """The host functions on batches one engine shape meets (12 query and 2 KV heads of 128, pages of
    16 and 64, blocks of 128): (query, key) lengths of fresh prompts and of chunks after a prefix,
    with and without a factor of 16, a one-token chunk after a long prefix (its long dense row is
    split), and requests sliced out of the engine's per-request tensors at an offset."""
    batches = [[(4096, 4096)], [(4163, 4163)], [(2048, 5049)], [(1, 4353)], [(1500, 1500), (2600, 4000)]]
    config = SparsePrefillConfig(min_q_len=0, last_query_blocks=1)
    for page_size in (16, 64):
        pages = -(-8192 // page_size)
        k_cache = torch.zeros(3 * pages, page_size, 2, 128, dtype=torch.bfloat16)
        for lengths in batches:
            total_q = sum(q for q, _ in lengths)
            q = torch.zeros(total_q, 12, 128, dtype=torch.bfloat16)
            # The engine's block table and lengths: one row per request slot, this batch from slot 1 on.
            table = torch.arange(3 * pages, dtype=torch.int32).view(3, pages)[1 : 1 + len(lengths)]
            seq_lens = torch.tensor([0] + [k for _, k in lengths] + [0] * (2 - len(lengths)), dtype=torch.int32)
            seqlens = seq_lens[1 : 1 + len(lengths)]
            cu = torch.tensor([0] + list(itertools.accumulate(q_len for q_len, _ in lengths)), dtype=torch.int32)
            for estimator in ("mixed", "exact"):
                cfg = config.replace(estimator=estimator)
                layout = BatchLayout.build(cu, seqlens, cfg, q.device)
                index = search.select_blocks(q, k_cache, table, cu, seqlens, layout, cfg, 128**-0.5)
            index.counts.fill_(1)  # nothing ran: give the host code an index it can read
            index.indices.zero_()
            staging.gather_kv(k_cache, k_cache, table, 0, lengths[0][1])
            for reads in READ_MODES:
                args = (q, k_cache, k_cache, table, cu, seqlens, layout)
                attention.block_sparse_attention(*args, None, 0.1, False, None, kv_reads=reads)
                attention.block_sparse_attention(*args, index, 0.1, False, None, kv_reads=reads)


def check_stable(launches: list) -> int:
    """Exit status of --stable: 1 when launches with the same compile-time arguments are specialised
    differently (each such kernel and argument printed)."""
    seen: dict[tuple, dict] = defaultdict(dict)
    for kernel, named, options in launches:
        key = variant(kernel, named, options)
        seen[key[:2] + key[3:]][specialisation(kernel, named)] = named
    unstable = 0
    for key, specs in seen.items():
        if len(specs) > 1:
            unstable += 1
            differing = sorted({name for spec in specs for name, value in spec if len({dict(s)[name] for s in specs}) > 1})
            print(f"UNSTABLE {key[0]}: {len(specs)} specialisations, differing in {', '.join(differing)}")
    print(f"{len(launches)} launches in {len(seen)} compile-time variants; {unstable} specialised by batch")
    return 1 if unstable else 0


def run_host_functions() -> None:
    """Every path of the kernels' host functions on small inputs, at head_dim 64, 128 and 256: each
    estimator; the dense route's page gather; dense and sparse attention (with mean correction and
    split-KV) with pointer reads and TMA reads from a staged copy (pages of 16), and TMA reads in place
    (pages of 64)."""
    for head_dim in (64, 128, 256):
        for page_size, modes in ((16, READ_MODES), (64, READ_MODES[1:])):
            length = 36 * 128  # a launch of the smallest size class: the split-KV plan, ranges and merge launch too
            q = torch.zeros(length, 8, head_dim, dtype=torch.bfloat16)
            k_cache = torch.zeros(-(-length // page_size) + 1, page_size, 2, head_dim, dtype=torch.bfloat16)
            table = torch.arange(k_cache.shape[0] - 1, dtype=torch.int32).view(1, -1)
            cu, seqlens = torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
            for estimator in ("pooled", "bound", "mixed", "exact"):
                config = SparsePrefillConfig(min_q_len=0, estimator=estimator, last_query_blocks=1)
                layout = BatchLayout.build(cu, seqlens, config, q.device)
                index = search.select_blocks(q, k_cache, table, cu, seqlens, layout, config, head_dim**-0.5)
            index.counts.fill_(1)  # nothing ran: give the host code an index it can read
            index.indices.zero_()
            staging.gather_kv(k_cache, k_cache, table, 0, length)  # the dense route's gather
            for reads in modes:
                args = (q, k_cache, k_cache, table, cu, seqlens, layout)
                attention.block_sparse_attention(*args, None, 0.1, False, None, kv_reads=reads)
                attention.block_sparse_attention(*args, index, 0.1, True, None, kv_reads=reads)


def die_with_parent(parent: int | None = None) -> None:
    """Pool initializer (and the start of each compile's child): a process is killed when the process
    that forked it (``parent``, else the check) ends, however it ends (a timeout's SIGKILL included),
    so no compile outlives the check."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != (PARENT[0] if parent is None else parent):  # the parent ended before the call
        os._exit(1)


def compile_one(number: int) -> tuple[str, int | None, str]:
    """(kernel variant, shared bytes or None, error) of launch ``JOBS[number]``, compiled in a forked
    child: a compiler that aborts (Triton 3.0 does on some layouts) is reported like an error."""
    kernel, named, options, capability, shape = JOBS[number]
    read, write = os.pipe()
    worker = os.getpid()
    child = os.fork()
    if child == 0:
        die_with_parent(worker)
        os.close(read)
        try:
            result = str(compile_launch(kernel, named, options, capability).metadata.shared)
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the script fails
            result = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        result = pipe.read()
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):
        return shape, None, f"the compiler died of signal {os.WTERMSIG(status)}"
    return (shape, int(result), "") if result.isdigit() else (shape, None, result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capability", type=int, default=90, choices=sorted(SHARED_LIMIT))
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles run in parallel")
    parser.add_argument("--stable", action="store_true", help="check that batch lengths change no specialisation")
    args = parser.parse_args()
    launches = record_launches()
    if args.stable:
        run_engine_batches()
        return check_stable(launches)
    run_host_functions()
    jobs, groups, seen = JOBS, defaultdict(list), set()
    for kernel, named, options in launches:
        key = variant(kernel, named, options)
        if key in seen:
            continue
        seen.add(key)
        tile = ("BLOCK_M", "BLOCK_N")
        shape = kernel.__name__ + "(" + ", ".join(f"{k}={v}" for k, v in key[1] if k.isupper()) + "".join(f", {k}={v}" for k, v in key[3]) + ")"
        # The launches an autotuner chooses among: the same kernel and arguments but for the tile.
        types = tuple(t.split("[")[0] for t in key[2])  # a descriptor's block shape follows the tile
        groups[(key[0], tuple(kv for kv in key[1] if kv[0] not in tile), types)].append(shape)
        jobs.append((kernel, named, options, args.capability, shape))
    print(f"compiling {len(jobs)} kernel variants with {args.jobs} workers (triton {triton.__version__})", flush=True)
    PARENT[0] = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop at once; the workers follow (die_with_parent)
        signal.signal(sig, lambda number, frame: os._exit(128 + number))
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork"), initializer=die_with_parent) as pool:
        results = {shape: (shared, error) for shape, shared, error in pool.map(compile_one, range(len(jobs)))}
    limit = SHARED_LIMIT[args.capability]
    failures = [f"{shape}: {error}" for shape, (shared, error) in results.items() if error]
    for shapes in groups.values():  # an autotuner skips tiles past the limit, so one that fits is enough
        if not any(results[shape][0] is not None and results[shape][0] <= limit for shape in shapes):
            failures += [f"{shape}: {results[shape][0]} bytes of shared memory, over {limit}" for shape in shapes
                         if results[shape][0] is not None]  # fmt: skip
    print(f"compiled {len(jobs) - sum(1 for _, e in results.values() if e)} of {len(jobs)} kernel variants for "
          f"sm_{args.capability}; {len(failures)} failures")
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
