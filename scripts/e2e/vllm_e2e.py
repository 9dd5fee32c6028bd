"""End-to-end check and timing of prefill-accel in vLLM 0.26.0 against upstream vLLM, on the GPU machine.

Run after scripts/e2e/device-setup.sh has installed upstream vLLM into $E2E_SITE (default /tmp/site),
the patched copy into $E2E_PATCHED (default /tmp/site-patched) and the converted models into
$E2E_MODELS (default /tmp/hf/{smollm2,gemma3}). Every engine runs in its own process under the Python
path of its side; the driver alternates requests between the two sides of a pair, so each ratio is
measured side by side in one run, on the same GPU.

Phases (--phases, comma separated):
  offline  GPU 0: greedy tokens at threshold 0 equal to upstream (SmolLM2; mixed batch, chunked
           prefill, prefix-cache hit); Gemma 3 needles 8K-32K, default thresholds; TTFT of the
           offline LLM at 8K-128K (SmolLM2, default config), median of --repeats.
  serve    GPU 1 (GPU 0 on a one-GPU machine): TTFT through `vllm serve` with streaming at 8K-128K;
           the mixed load (one long request + a stream of short chats), upstream defaults against our
           scheduler flags, each also unloaded.
  chunk    GPU 0: one SmolLM2-shaped chunk, our search and attention vs vLLM's FA3
           (scripts/e2e/bench_chunk.py), and the density the search keeps inside the engine.
  tp       both GPUs: Gemma 3 with tensor parallel 2, greedy tokens at threshold 0 equal to upstream
           TP=2, and the 128K TTFT ratio.
  qwen     GPU 0: Qwen2.5-Coder-1.5B, a model trained for long context (32K, 128K with its documented
           YaRN, applied through vLLM's rope override past 32K): the override checked against the
           harness's transformers model, greedy tokens at threshold 0, needles at 32K / 64K / 128K (8
           depths each, default config), offline and served TTFT at --lengths, `prefill-accel bench`
           against the two servers, and per-layer attention time of whole prefills (bench_chunk.py).
           The checks (nothing timed: rope, equality, needles, the engine's density, the captures and
           the --accuracy-run harness runs) share the GPU, --check-workers at once; the timed stages
           follow one at a time.
  v0       GPU 0: vLLM 0.6.3.post1, the V0 engine, on Qwen2.5-Coder-1.5B, from the environment the front
           door builds (`scripts/build.sh vllm-0.6.x --venv $E2E_V0_VENV --gpu`: the patched side) with
           upstream's wheel unpacked into $E2E_V0_UPSTREAM (scripts/e2e/device-v0.sh does both): greedy
           tokens at threshold 0, needles at 32K and 128K (YaRN through V0's rope_scaling), offline TTFT
           at --lengths, TTFT through its OpenAI server with `prefill-accel bench` against the two
           servers, and the mixed load (the scheduler flags against upstream 0.6.3's defaults). Runs
           alone: the other phases speak vLLM 0.26's API.
  sglang   GPU 0: SGLang 0.5.16's offline Engine on Qwen2.5-Coder-1.5B, upstream installed in $E2E_SGL_SITE
           and the patched files in $E2E_SGL_PATCHED ahead of it (scripts/e2e/device-sglang.sh), decoding
           with fa3, the patched side prefilling with sparse_prefill: greedy tokens at threshold 0, needles
           at 32K and 128K and offline TTFT as in the v0 phase, in SGLang's terms (sglang_engine); TTFT
           through sglang.launch_server with `prefill-accel bench` and SGLang's bench_serving, and the
           mixed load (decode protection and srpf against SGLang's defaults). Runs alone.
Results: --out DIR/results.json (every number) and the tables printed at the end (markdown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import select
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))

from prefill_accel.accuracy.models import MODELS as MODEL_SPECS  # noqa: E402
from prefill_accel.accuracy.needle import build_prompts, parse_answer  # noqa: E402
from prefill_accel.serving import client as serving_client  # noqa: E402
from prefill_accel.serving.stats import percentile  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402  (imported here: a lazy import from two threads races)

SITE = os.environ.get("E2E_SITE", "/tmp/site")
PATCHED = os.environ.get("E2E_PATCHED", "/tmp/site-patched")
MODELS = Path(os.environ.get("E2E_MODELS", "/tmp/hf"))
GGUF_ONLY = os.environ.get("E2E_GGUF_PATH", "/tmp/bundle/gguf-only")  # the GGUF reader alone (unpack-stage.sh)
LOGS = Path(os.environ.get("E2E_LOGS", "/tmp/e2e-logs"))
KV_BYTES = 8 << 30
GPU_UTIL = 0.12  # only the start-up free-memory check reads it: the KV cache size is fixed by KV_BYTES
LONG_LEN = 131072 + 1024  # max_model_len for the long-context runs (beyond SmolLM2's 8K: speed only)
QWEN = "qwen2.5-coder-1.5b"
V0_VENV = Path(os.environ.get("E2E_V0_VENV", "/tmp/venv-vllm-0.6.x"))
V0_UPSTREAM = os.environ.get("E2E_V0_UPSTREAM", "/tmp/site-0.6")  # upstream 0.6.3.post1's wheel, unpacked
V0_GPU_UTIL = 0.3  # V0 sizes its profile's budget from it; the cache itself is KV_BYTES (num_gpu_blocks_override)
V0_NO_PROMPT_LOGPROBS = (
    "vLLM 0.6.3.post1 fails prompt_logprobs on a prefix-cache hit (sampler.get_logprobs asserts "
    "len(next_token_ids) == len(query_indices); upstream issue vllm-project/vllm#8268, seen on the unpatched "
    "engine on the H200 2026-12-04), so V0 runs compare greedy tokens only"
)
SGL_SITE = os.environ.get("E2E_SGL_SITE", "/tmp/sglang-site")
SGL_PATCHED = os.environ.get("E2E_SGL_PATCHED", "/tmp/sglang-patched")
SGL_MEM_FRACTION = 0.3  # SGLang's static memory share; the KV pool itself is KV_BYTES (max_total_tokens)
START_ONE = threading.Lock()
NEEDLE_DEPTHS = [round(0.05 + 0.9 * i / 7, 3) for i in range(8)]
PRINT_LOCK = threading.Lock()
RESULTS_LOCK = threading.Lock()
OUT_DIR = Path(".")


def say(*parts) -> None:
    with PRINT_LOCK:
        print(time.strftime("%H:%M:%S"), *parts, flush=True)


ENGINE = "vllm"
"""The engine of every worker in the run: "vllm" (vLLM 0.26.0); "vllm-v0", set by the v0 phase (vLLM
0.6.3.post1: the patched side from E2E_V0_VENV, the upstream side from E2E_V0_UPSTREAM ahead of it, the
arguments translated by v0_engine); "sglang", set by the sglang phase (SGLang 0.5.16's Engine, the
arguments translated by sglang_engine)."""


def starting():
    """Held while an engine starts: V0 and SGLang size their memory from what is free on the GPU, so theirs
    start one at a time; vLLM 0.26's are given their KV cache in bytes and start side by side."""
    return START_ONE if ENGINE != "vllm" else contextlib.nullcontext()


def side_env(side: str, gpus: str) -> dict[str, str]:
    env = dict(os.environ)
    if ENGINE == "vllm-v0":  # the venv holds the patched vLLM and the runtime package the front door installed
        path = [V0_UPSTREAM] if side == "upstream" else []
    elif ENGINE == "sglang":
        path = [SGL_SITE] if side == "upstream" else [SGL_PATCHED, SGL_SITE, str(ROOT / "kernels")]
    else:
        path = [SITE] if side == "upstream" else [PATCHED, SITE, str(ROOT / "kernels")]
    env.update(
        PYTHONPATH=":".join(path),
        CUDA_VISIBLE_DEVICES=gpus,
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def last_exception(path: Path) -> str:
    """The last line of a log that names a raised exception ("ImportError: ..."), or "": a server that fails a
    request after its 200 header ends the stream early, and only its log says why."""
    raised = [line for line in log_tail(path, 2000).splitlines() if re.match(r"[\w.]*(Error|Exception): ", line)]
    return raised[-1] if raised else ""


# --------------------------------------------------------------------------------------------- engines


class EngineError(RuntimeError):
    pass


class Worker:
    """An offline engine in its own process (scripts/e2e/engine_worker.py)."""

    def __init__(self, name: str, side: str, gpus: str, engine: dict, timeout: float = 420.0,
                 extra_env: dict[str, str] | None = None):  # fmt: skip
        self.name, self.side = name, side
        self.log = LOGS / f"{name}.log"
        python, env, api = sys.executable, {**side_env(side, gpus), **(extra_env or {})}, "vllm"
        if ENGINE == "vllm-v0":
            engine, backend_env = v0_engine(engine)
            python, env = str(V0_VENV / "bin" / "python"), {**env, **backend_env}
        elif ENGINE == "sglang":
            engine, engine_env = sglang_engine(engine)
            env, api = {**env, **engine_env}, "sglang"
        with starting():
            read_fd, write_fd = os.pipe()
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    [python, str(Path(__file__).with_name("engine_worker.py")), "--engine", json.dumps(engine),
                     "--api", api, "--reply-fd", str(write_fd)],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(write_fd,),
                    text=True,
                )  # fmt: skip
            os.close(write_fd)
            self.replies = os.fdopen(read_fd, "r")
            ready = self._reply(timeout)
        self.startup_seconds = ready["startup_seconds"]
        say(f"{name} ({side}) ready in {self.startup_seconds:.0f} s")

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            readable, _, _ = select.select([self.replies], [], [], 5.0)
            if readable:
                line = self.replies.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise EngineError(f"{self.name} ({self.side}) died or timed out; log tail:\n{log_tail(self.log)}")

    def call(self, timeout: float = 300.0, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.replies.close()


class Server:
    """`vllm serve` in its own process (vLLM 0.6.3's OpenAI server in the v0 phase, v0_server; SGLang's
    launch_server in the sglang phase, sglang_server)."""

    def __init__(self, name: str, side: str, gpus: str, model: Path, port: int, args: list[str]):
        self.name, self.side, self.port, self.model = name, side, port, str(model)
        self.log = LOGS / f"{name}.log"
        SERVER_LOGS.append(self.log)
        max_len = long_len(model.name)
        env = side_env(side, gpus)
        if ENGINE == "vllm-v0":
            command, backend_env = v0_server(model.name, port, args)
            self.model, env = command[command.index("--model") + 1], {**env, **backend_env}
        elif ENGINE == "sglang":
            command, engine_env = sglang_server(model.name, port, args)
            env = {**env, **engine_env}
        else:
            command = [sys.executable, "-c", "from vllm.entrypoints.cli.main import main; main()", "serve", str(model),
                       "--port", str(port), "--dtype", "bfloat16", "--seed", "0", "--kv-cache-memory-bytes", str(KV_BYTES),
                       "--gpu-memory-utilization", str(GPU_UTIL), "--max-model-len", str(max_len),
                       "--hf-overrides", json.dumps(long_context_overrides(model.name, max_len)),
                       *args]  # fmt: skip
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = 420.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name} ({self.side}) exited; log tail:\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        self.startup_seconds = time.monotonic() - self.started
                        say(f"{self.name} ({self.side}) serving on :{self.port} after {self.startup_seconds:.0f} s")
                        return
            except OSError:
                pass
            time.sleep(2)
        self.proc.kill()
        raise EngineError(f"{self.name} ({self.side}) not ready in {timeout:.0f} s; log tail:\n{log_tail(self.log)}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def engine_kwargs(model: str, *, max_model_len: int, chunk: int, eager: bool, tp: int = 1, **extra) -> dict:
    kwargs = dict(
        model=str(MODELS / model), dtype="bfloat16", seed=0, max_model_len=max_model_len,
        max_num_batched_tokens=chunk, enable_prefix_caching=True, kv_cache_memory_bytes=KV_BYTES,
        gpu_memory_utilization=GPU_UTIL, enforce_eager=eager, tensor_parallel_size=tp,
    )  # fmt: skip
    overrides = long_context_overrides(model, max_model_len)
    if overrides:
        kwargs["hf_overrides"] = overrides
    kwargs.update(extra)
    return kwargs


def long_len(model: str) -> int:
    """max_model_len of a model's long-context runs: its documented extension (Qwen2.5: YaRN to 128K),
    else LONG_LEN past its training length (speed only)."""
    spec = MODEL_SPECS[model]
    return int(spec.max_length * spec.long_context.factor) if spec.long_context else LONG_LEN


def long_context_overrides(model: str, max_model_len: int) -> dict:
    """vLLM's hf_overrides for a run past the model's training length: the model's documented rope
    scaling where it has one (vLLM 0.26 derives the longer maximum from it), else a rotary table sized
    for the run (SmolLM2 and Gemma 3 past their training length: speed only)."""
    spec = MODEL_SPECS[model]
    if max_model_len <= spec.max_length:
        return {}
    if spec.long_context is None:
        return {"max_position_embeddings": max_model_len}
    config = json.loads((MODELS / model / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config["rope_theta"]
    return {"rope_parameters": spec.long_context.parameters(theta, spec.max_length)}


def prompt_len(model: str, length: int, room: int = 64) -> int:
    """The prompt length a run at ``length`` uses: ``room`` tokens short of the model's longest runs, so
    the output fits (YaRN's rotary table ends at the extended length)."""
    return min(length, long_len(model) - room)


def v0_checkpoint(model: str) -> Path:
    """The converted checkpoint as vLLM 0.6.3's transformers (4.46) reads it, beside the original
    (weights and other files linked): transformers 5 writes rope_theta inside rope_parameters, where 4.46
    does not look (it would take its default base, silently), writes extra_special_tokens as a list,
    which 4.46's tokenizer loader cannot read, and names a tokenizer read from tokenizer.json alone
    TokenizersBackend, a class 4.46 does not have (SmolLM2's; its PreTrainedTokenizerFast reads the same file)."""
    source, target = MODELS / model, MODELS / "v0" / model
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        link = target / path.name
        if path.name not in ("config.json", "tokenizer_config.json") and not link.exists():
            link.symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    for key, value in (config.get("rope_parameters") or {}).items():
        if key == "rope_theta" or (key == "rope_type" and value != "default"):
            config.setdefault(key, value)
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    (target / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = json.loads((source / "tokenizer_config.json").read_text())
    if isinstance(tokenizer.get("extra_special_tokens"), list):
        del tokenizer["extra_special_tokens"]
    if tokenizer.get("tokenizer_class") == "TokenizersBackend":  # 5's generic tokenizer.json class, 4.46's name
        tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=1))
    return target


def v0_engine(kwargs: dict) -> tuple[dict, dict[str, str]]:
    """vLLM 0.26 ``LLM`` arguments (engine_kwargs, sparse) in vLLM 0.6.3's terms, and the environment the
    engine needs: the backend through VLLM_ATTENTION_BACKEND, chunked prefill asked for (V0 turns it on by
    itself only past 32K), the KV cache as a block count (V0 has no byte size; its cache is otherwise what
    gpu_memory_utilization leaves after profiling), the model's rope scaling as rope_scaling (V0 has no
    hf_overrides), on the checkpoint V0 reads (v0_checkpoint)."""
    kwargs = dict(kwargs)
    env = {}
    backend = kwargs.pop("attention_backend", None)
    if backend:
        env["VLLM_ATTENTION_BACKEND"] = backend
    model = Path(kwargs["model"]).name
    overrides = kwargs.pop("hf_overrides", {})
    if set(overrides) - {"rope_parameters"}:
        raise EngineError(f"{model}: the V0 engine takes no hf_overrides ({overrides}); runs past the training "
                          "length need the model's documented rope scaling")  # fmt: skip
    if "rope_parameters" in overrides:
        kwargs["rope_scaling"] = {k: v for k, v in overrides["rope_parameters"].items() if k != "rope_theta"}
    config = json.loads((MODELS / model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = 16 * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2  # bf16 K+V
    kwargs.update(model=str(v0_checkpoint(model)), enable_chunked_prefill=True, gpu_memory_utilization=V0_GPU_UTIL,
                  num_gpu_blocks_override=kwargs.pop("kv_cache_memory_bytes") // block_bytes, block_size=16)  # fmt: skip
    return kwargs, env


def sglang_engine(kwargs: dict) -> tuple[dict, dict[str, str]]:
    """vLLM 0.26 ``LLM`` arguments (engine_kwargs, sparse) as SGLang 0.5.16 ``Engine`` (ServerArgs) fields,
    and the environment it needs: fa3 for decoding, sparse_prefill for prefill on the patched side; the
    chunk as chunked_prefill_size (and the prefill batch's token cap); the radix cache for prefix caching;
    the KV pool as a token count (SGLang has no byte size); CUDA graphs off for eager; the model's rope
    scaling as a config override, with the longer context allowed (SGLang derives none from YaRN's
    parameters)."""
    kwargs = dict(kwargs)
    model = Path(kwargs.pop("model"))
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2  # bf16 K+V
    engine = dict(model_path=str(model), dtype=kwargs.pop("dtype"), random_seed=kwargs.pop("seed"),
                  context_length=kwargs.pop("max_model_len"), tp_size=kwargs.pop("tensor_parallel_size"),
                  chunked_prefill_size=kwargs["max_num_batched_tokens"],
                  max_prefill_tokens=kwargs.pop("max_num_batched_tokens"),
                  disable_radix_cache=not kwargs.pop("enable_prefix_caching"),
                  max_total_tokens=kwargs.pop("kv_cache_memory_bytes") // token_bytes,
                  mem_fraction_static=SGL_MEM_FRACTION, disable_cuda_graph=kwargs.pop("enforce_eager"),
                  attention_backend="fa3", log_level="info")  # fmt: skip
    kwargs.pop("gpu_memory_utilization")
    env = {}
    overrides = kwargs.pop("hf_overrides", {})
    if overrides:
        engine["json_model_override_args"] = json.dumps(overrides)
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    if kwargs.pop("attention_backend", None):
        engine["prefill_attention_backend"] = "sparse_prefill"
    engine.update({k: kwargs.pop(k) for k in list(kwargs) if k.startswith("sparse_prefill_")})
    if kwargs:
        raise EngineError(f"sglang_engine: no SGLang translation for {sorted(kwargs)}")
    return engine, env


def take_flag(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a command line, removed from it with its value (None: not there)."""
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1]
    del args[i : i + 2]
    return value


def v0_server(model: str, port: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command of vLLM 0.6.3's OpenAI server for a run that `vllm serve MODEL ARGS` makes on 0.26, and
    the environment it needs: as v0_engine (the backend through VLLM_ATTENTION_BACKEND, the cache as a block
    count, the rope scaling, the checkpoint V0 reads) with prefix caching on as 0.26's default. Chunked
    prefill is asked for wherever the run sets flags (a step budget, or the scheduler's flags, which need
    it); a run with none keeps V0's own default (on a GPU, chunked prefill past 32K tokens of
    max_model_len), as an operator of upstream 0.6.3 sees it. Both sides take lm-format-enforcer as the
    guided-decoding backend: upstream 0.6.3 builds a guide for every request and so imports its default
    backend, outlines, on each, which cannot be imported where the index's only pyairports is empty (the
    front door's --gpu environment); a request without a guide is served alike by either backend."""
    args = list(args)
    backend = take_flag(args, "--attention-backend")
    env = {"VLLM_ATTENTION_BACKEND": backend} if backend else {}
    max_len = long_len(model)
    kwargs, _ = v0_engine(engine_kwargs(model, max_model_len=max_len, chunk=16384, eager=False))
    command = [str(V0_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", kwargs["model"],
               "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--seed", "0",
               "--max-model-len", str(max_len), "--gpu-memory-utilization", str(V0_GPU_UTIL),
               "--num-gpu-blocks-override", str(kwargs["num_gpu_blocks_override"]), "--block-size", "16",
               "--enable-prefix-caching", "--guided-decoding-backend", "lm-format-enforcer"]  # fmt: skip
    if "rope_scaling" in kwargs:
        command += ["--rope-scaling", json.dumps(kwargs["rope_scaling"])]
    if args or env:
        command.append("--enable-chunked-prefill")
    return command + args, env


def sglang_server(model: str, port: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The `sglang.launch_server` command for a run that `vllm serve MODEL ARGS` makes on 0.26 (the Engine's
    fields of sglang_engine as flags), and its environment. Of vLLM's flags, --max-num-batched-tokens becomes
    the chunk size and --attention-backend SPARSE_PREFILL the prefill backend; the rest are SGLang's own."""
    args = list(args)
    chunk, backend = take_flag(args, "--max-num-batched-tokens"), take_flag(args, "--attention-backend")
    kwargs = engine_kwargs(model, max_model_len=long_len(model), chunk=int(chunk or 16384), eager=False,
                           **(sparse() if backend else {}))  # fmt: skip
    engine, env = sglang_engine(kwargs)
    if chunk is None:  # SGLang's own chunk and prefill cap, as an operator gets them
        del engine["chunked_prefill_size"], engine["max_prefill_tokens"]
    command = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in engine.items():
        if value is True:
            command.append("--" + key.replace("_", "-"))
        elif value is not False:
            command += ["--" + key.replace("_", "-"), str(value)]
    return command + args, env


SPARSE_FLAGS: dict[str, object] = {}
"""--sparse-flag values: every patched engine of the run gets them, under a stage's own values."""


def sparse(**flags) -> dict:
    """Engine kwargs that select the SPARSE_PREFILL backend with the given --sparse-prefill-* values."""
    flags = {**SPARSE_FLAGS, **flags}
    return {"attention_backend": "SPARSE_PREFILL", **{f"sparse_prefill_{k}": v for k, v in flags.items()}}


def sparse_flags_note() -> str:
    """`` with --sparse-prefill-estimator=exact ...`` for the run's --sparse-flag values, else empty."""
    return "".join(f" with --sparse-prefill-{k.replace('_', '-')}={v}" for k, v in SPARSE_FLAGS.items())


def parse_env_setting(text: str) -> tuple[str, str]:
    """``PREFILL_ACCEL_SPLIT_KV=0`` -> ("PREFILL_ACCEL_SPLIT_KV", "0")."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (an environment variable), got {text!r}")
    return name, value


def parse_sparse_flag(text: str) -> tuple[str, object]:
    """``estimator=exact`` -> ("estimator", "exact"); numbers and true/false are converted."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a --sparse-prefill-* suffix), got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


# --------------------------------------------------------------------------------------------- prompts


class Corpus:
    """Real text for long prompts: the Python sources of the installed torch package, tokenized."""

    def __init__(self, tokenizer, min_tokens: int):
        import torch

        files = sorted(Path(torch.__file__).parent.rglob("*.py"))
        chunks, total = [], 0
        for path in files:
            text = path.read_text(errors="replace")
            chunks.append(f"# file: {path.name}\n{text}\n")
            total += len(text) // 3
            if total > 2 * min_tokens:
                break
        self.ids = tokenizer("".join(chunks), add_special_tokens=False).input_ids
        if len(self.ids) < min_tokens:
            raise RuntimeError(f"corpus has {len(self.ids)} tokens, fewer than {min_tokens}")

    def window(self, length: int, index: int) -> list[int]:
        """A prompt of ``length`` tokens; windows of different ``index`` start at different tokens, so none
        reuses another's cached prefix."""
        start = (index * 7919) % max(len(self.ids) - length, 1)
        return self.ids[start : start + length]


def tokenizer_for(model: str):
    return AutoTokenizer.from_pretrained(MODELS / model)


def chat_prompt(tokenizer, corpus: Corpus, rng: random.Random, length: int, index: int) -> list[int]:
    """A short chat request: a code snippet of about ``length`` tokens and a question about it."""
    snippet = tokenizer.decode(corpus.window(length, 10_000 + index))
    messages = [{"role": "user", "content": f"Explain what this code does:\n{snippet}"}]
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


# --------------------------------------------------------------------------------------------- stats


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def compare_tokens(upstream: dict, patched: dict) -> list[dict]:
    """Per prompt: equal or not, the first differing position and upstream's top-1/top-2 logprob margin there."""
    rows = []
    for i, (a, b) in enumerate(zip(upstream["tokens"], patched["tokens"])):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        row = {"prompt": i, "equal": first is None, "tokens": len(a), "first_diff": first}
        tops = upstream.get("top")
        if first is not None and tops and tops[i] and first < len(tops[i]) and len(tops[i][first]) > 1:
            row["upstream_margin"] = tops[i][first][0][1] - tops[i][first][1][1]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------- offline


def start_both(first, second) -> tuple[Worker, Worker]:
    """Two workers from their constructors, the first closed when the second fails to start."""
    one = first()
    try:
        return one, second()
    except Exception:
        one.close()
        raise


def pair(name: str, gpus: str, upstream: dict, patched: dict,
         patched_env: dict[str, str] | None = None) -> tuple[Worker, Worker]:  # fmt: skip
    return start_both(lambda: Worker(f"{name}-upstream", "upstream", gpus, upstream),
                      lambda: Worker(f"{name}-patched", "patched", gpus, patched, extra_env=patched_env))  # fmt: skip


STATS_LINE = "sparse prefill: "  # prefill_accel.stats' line, logged every PREFILL_ACCEL_STATS calls


def stats_lines(log: Path) -> list[str]:
    """The sparse path's statistics lines (PREFILL_ACCEL_STATS) in an engine's log, oldest first."""
    return [line.split(STATS_LINE, 1)[1] for line in log.read_text(errors="replace").splitlines() if STATS_LINE in line]


def sparse_tokens(lines: list[str], calls_per_forward: int) -> int:
    """Tokens the sparse kernel computed in the forwards that statistics ``lines`` cover: their query tokens
    over the kernel calls one forward makes (layers x ranks)."""
    return sum(int(re.search(r"(\d+) query tokens", line)[1]) for line in lines) // calls_per_forward


def equality_stage(results: dict, gpus: str, model: str, tp: int, tag: str) -> None:
    """Greedy tokens at threshold 0: one mixed batch (long prompts chunked, short ones, decodes), then a
    prompt whose first 3072 tokens hit the prefix cache so its continuation chunk is computed sparse. The
    patched engine logs the sparse path's statistics once per forward (PREFILL_ACCEL_STATS at the layer
    count; each rank its own), so the prefix hit's lines say how many of its tokens the kernel computed."""
    layers = json.loads((MODELS / model / "config.json").read_text())["num_hidden_layers"]
    tok = tokenizer_for(model)
    corpus = Corpus(tok, 40_000)
    max_len = MODEL_SPECS[model].max_length
    lengths = [1500, 3000, 6000, max_len - 64]
    longs = [build_prompts(tok, n, [0.3 + 0.1 * i], seed=i)[0].input_ids for i, n in enumerate(lengths)]
    shorts = [corpus.window(100 + 60 * i, 50 + i) for i in range(6)]
    base = dict(max_model_len=max_len, chunk=2048, eager=True, tp=tp)
    up, pa = pair(f"{tag}-eq", gpus, engine_kwargs(model, **base),
                  engine_kwargs(model, **base, **sparse(threshold=0.0, min_len=512)),
                  patched_env={"PREFILL_ACCEL_STATS": str(layers)})  # fmt: skip
    try:
        batch = longs + shorts
        out = {side: w.call(op="generate", prompts=batch, max_tokens=32, logprobs=2) for side, w in (("u", up), ("p", pa))}
        rows = compare_tokens(out["u"], out["p"])
        prefix = corpus.window(3072, 3)
        first, second = prefix + corpus.window(900, 4), prefix + corpus.window(1500, 5)
        cache = {}
        for side, w in (("u", up), ("p", pa)):
            w.call(op="generate", prompts=[first], max_tokens=1)
            logged = len(stats_lines(w.log))
            cache[side] = w.call(op="generate", prompts=[second], max_tokens=32, logprobs=2)
            hit_lines = stats_lines(w.log)[logged:]  # the patched side's, the last: upstream logs none
        hit_sparse = sparse_tokens(hit_lines, layers * tp)
        rows += [dict(r, prompt="prefix-cache hit") for r in compare_tokens(cache["u"], cache["p"])]
        for row, n in zip(rows, [len(p) for p in batch] + [len(second)]):
            row["prompt_tokens"] = n
        result = results[f"{tag}_greedy_threshold0"] = {
            "model": model, "tp": tp, "equal": sum(r["equal"] for r in rows), "prompts": len(rows), "rows": rows,
            "engine": "chunked prefill 2048, prefix caching on, patched --sparse-prefill-min-len 512",
            "prefix_hit": {"prompt_tokens": len(second), "shared_prefix_tokens": len(prefix),
                           "computed_sparse_tokens": hit_sparse, "stats": hit_lines},
        }  # fmt: skip
        say(f"{tag} greedy threshold 0: {sum(r['equal'] for r in rows)}/{len(rows)} prompts equal; "
            f"differing: {[r for r in rows if not r['equal']]}; the prefix-cache hit ({len(second)} tokens, "
            f"{len(prefix)} shared): {hit_sparse} computed by the sparse kernel")
        if ENGINE == "vllm-v0":  # the scored texts extend cached prompts; V0's sampler asserts on prompt logprobs after a prefix hit
            result["teacher_forced"] = {"skipped": V0_NO_PROMPT_LOGPROBS}
        else:
            result["teacher_forced"] = teacher_forced(up, pa, batch + [second], out["u"]["tokens"] + cache["u"]["tokens"])
    finally:
        up.close()
        pa.close()


def teacher_forced(up: Worker, pa: Worker, prompts: list[list[int]], generated: list[list[int]]) -> dict:
    """Both sides score the same text, each prompt followed by upstream's greedy tokens: at every
    generated position, does the patched engine's top-1 match upstream's, and by how much does the
    log-prob of upstream's token differ? Free of the divergence that one flipped near-tie causes in
    free-running generation."""
    texts = [p + g[:-1] for p, g in zip(prompts, generated)]
    tops = {side: w.call(op="prompt_logprobs", prompts=texts, k=2)["top"] for side, w in (("u", up), ("p", pa))}
    positions = agree = 0
    max_diff = 0.0
    for prompt, gen, top_u, top_p in zip(prompts, generated, tops["u"], tops["p"]):
        for i, token in enumerate(gen):
            pos = len(prompt) + i
            if pos >= len(top_u) or top_u[pos] is None or top_p[pos] is None:
                continue
            positions += 1
            agree += top_u[pos][0][0] == top_p[pos][0][0]
            lp_u, lp_p = dict(map(tuple, top_u[pos])).get(token), dict(map(tuple, top_p[pos])).get(token)
            if lp_u is not None and lp_p is not None:
                max_diff = max(max_diff, abs(lp_u - lp_p))
    return {"positions": positions, "top1_agree": agree, "max_abs_logprob_diff": max_diff}


def needle_stage(results: dict, gpus: str, model: str, lengths: list[int], depths: list[float], key: str,
                 **flags) -> None:  # fmt: skip
    """Needle answers of upstream and patched (default config, with ``flags``), greedy, at each length on
    the engine that serves it: up to the model's training length natively, past it with the model's
    documented long-context override (one engine pair each). Nothing here is timed, so the pairs run side
    by side and each pair's two sides generate at once."""
    native = MODEL_SPECS[model].max_length
    groups = [(max_len, group) for max_len, group in ((native, [n for n in lengths if n <= native]),
                                                      (long_len(model), [n for n in lengths if n > native])) if group]

    def run_group(max_len: int, group: list[int]) -> list[dict]:
        tok = tokenizer_for(model)  # one per thread: a fast tokenizer is not safe to share while encoding
        base = dict(max_model_len=max_len, chunk=16384, eager=True)
        up, pa = pair(f"{model}-needle-{max_len}", gpus, engine_kwargs(model, **base),
                      engine_kwargs(model, **base, **sparse(**flags)))  # fmt: skip
        rows = []
        try:
            for length in group:
                prompts = build_prompts(tok, length, depths, seed=length)
                ids = [p.input_ids for p in prompts]
                def generate(worker):
                    return worker.call(op="generate", prompts=ids, max_tokens=12, timeout=1200)["tokens"]

                with ThreadPoolExecutor(max_workers=2) as sides:
                    tokens = list(sides.map(generate, (up, pa)))
                answers = [[parse_answer(tok.decode(t)) for t in side] for side in tokens]
                mine = [{"length": length, "depth": p.depth, "value": p.value, "upstream": a_up, "patched": a_pa,
                         "max_model_len": max_len} for p, a_up, a_pa in zip(prompts, *answers)]  # fmt: skip
                rows += mine
                say(f"{model} needles {length}: upstream {sum(r['upstream'] == r['value'] for r in mine)}/{len(mine)}, "
                    f"patched {sum(r['patched'] == r['value'] for r in mine)}/{len(mine)}, "
                    f"same answer {sum(r['upstream'] == r['patched'] for r in mine)}/{len(mine)}")  # fmt: skip
        finally:
            up.close()
            pa.close()
        return rows

    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        rows = [row for part in pool.map(lambda g: run_group(*g), groups) for row in part]
    summary = {}
    for length in lengths:
        sel = [r for r in rows if r["length"] == length]
        summary[length] = {
            "upstream_correct": sum(r["upstream"] == r["value"] for r in sel),
            "patched_correct": sum(r["patched"] == r["value"] for r in sel),
            "same_answer": sum(r["upstream"] == r["patched"] for r in sel),
            "prompts": len(sel),
        }
    flag_text = "".join(f" --sparse-prefill-{k.replace('_', '-')} {v}" for k, v in flags.items())
    results[key] = {"model": model, "engine": f"chunked prefill 16384, eager; patched: default sparse config{flag_text}"
                    + sparse_flags_note() + f"; past {native} tokens {long_context_overrides(model, native + 1)}",
                    "by_length": summary, "rows": rows}  # fmt: skip


def ttft_pairs(up: Worker | Server, pa: Worker | Server, measure, lengths: list[int], repeats: int, corpus: Corpus,
               seed: int, labels: tuple[str, str] = ("upstream", "patched")) -> dict:  # fmt: skip
    """Median TTFT per length, the two sides alternating (which goes first alternates too); ``labels``
    name the baseline and the side measured against it (the keys ``<label>_ms``; speedup = baseline / other)."""
    base, other = labels
    table = {}
    for length in lengths:
        warm = corpus.window(length, seed + length)
        for side in (up, pa):
            measure(side, warm)
        times = {base: [], other: []}
        for r in range(repeats):
            prompt = corpus.window(length, seed + length + 1 + r)
            order = ((up, base), (pa, other)) if r % 2 == 0 else ((pa, other), (up, base))
            for side, key in order:
                times[key].append(measure(side, prompt))
        u, p = median(times[base]), median(times[other])
        table[length] = {f"{base}_ms": u * 1e3, f"{other}_ms": p * 1e3, "speedup": u / p, "samples": times}
        say(f"TTFT {length}: {base} {u * 1e3:.1f} ms, {other} {p * 1e3:.1f} ms, {u / p:.2f}x")
    return table


def offline_ttft_table(model: str, workers: tuple[Worker, Worker], lengths: list[int], repeats: int,
                       labels: tuple[str, str] = ("upstream", "patched")) -> dict:  # fmt: skip
    """Offline TTFT (one output token) of two started workers at the model's prompt lengths, the two
    alternating (ttft_pairs); the workers are closed afterwards."""
    first, second = workers
    try:
        corpus = Corpus(tokenizer_for(model), max(lengths) + 64 * 1024)
        return ttft_pairs(first, second, lambda w, ids: w.call(op="ttft", prompt=ids, timeout=900)["seconds"],
                          [prompt_len(model, n) for n in lengths], repeats, corpus, 0, labels)  # fmt: skip
    finally:
        first.close()
        second.close()


def offline_ttft_stage(results: dict, gpus: str, model: str, lengths: list[int], repeats: int, key: str) -> None:
    max_len = long_len(model)
    base = dict(max_model_len=max_len, chunk=16384, eager=False)
    workers = pair(f"{model}-ttft", gpus, engine_kwargs(model, **base), engine_kwargs(model, **base, **sparse()))
    table = offline_ttft_table(model, workers, lengths, repeats)
    if ENGINE == "sglang":
        engine = (f"Engine, context_length {max_len} {long_context_overrides(model, max_len)}, chunked_prefill_size "
                  "16384, radix cache on, CUDA graphs (defaults), decode fa3; patched: prefill sparse_prefill")
    else:
        engine = (f"LLM, max_model_len {max_len} {long_context_overrides(model, max_len)}, chunked prefill 16384, "
                  "prefix caching on, CUDA graphs + torch.compile (defaults); patched")
    results[key] = {"model": model, "engine": engine + ", default sparse config" + sparse_flags_note(),
                    "by_length": table}  # fmt: skip


def variant_ttft_stage(results: dict, gpus: str, model: str, lengths: list[int], repeats: int,
                       env: dict[str, str]) -> None:  # fmt: skip
    """What a runtime switch is worth end to end: offline TTFT of the patched engine at the default
    config with ``env`` set (e.g. PREFILL_ACCEL_SPLIT_KV=0) against the same engine without it."""
    max_len = long_len(model)
    kwargs = engine_kwargs(model, max_model_len=max_len, chunk=16384, eager=False, **sparse())
    workers = start_both(lambda: Worker(f"{model}-ttft-variant", "patched", gpus, kwargs, extra_env=env),
                         lambda: Worker(f"{model}-ttft-default", "patched", gpus, kwargs))  # fmt: skip
    table = offline_ttft_table(model, workers, lengths, repeats, ("variant", "default"))
    results[f"{model}_variant_ttft"] = {
        "model": model, "variant": " ".join(f"{name}={value}" for name, value in env.items()),
        "engine": f"LLM, max_model_len {max_len}, chunked prefill 16384, defaults; both patched, default sparse config"
                  + sparse_flags_note(), "by_length": table,
    }  # fmt: skip


def offline_phase(results: dict, gpus: str, args) -> None:
    for name, stage in (
        ("smol_equality", lambda: equality_stage(results, gpus, "smollm2", 1, "smollm2")),
        ("gemma_needles", lambda: needle_stage(results, gpus, "gemma3", [8192, 16384, 24576, 32768 - 32],
                                               [0.1, 0.3, 0.5, 0.7, 0.9], "gemma_needles", min_len=2048)),
        ("offline_ttft", lambda: offline_ttft_stage(results, gpus, "smollm2", args.lengths, args.repeats, "offline_ttft")),
    ):
        run_stage(results, name, stage)


SKIP: set[str] = set()
SERVER_LOGS: list[Path] = []  # every server's log, in start order: a failed stage names its servers' last exceptions


def run_stage(results: dict, name: str, stage) -> None:
    if name in SKIP:
        say(f"stage {name} skipped (--skip)")
        return
    t0 = time.monotonic()
    error_text = None
    servers = len(SERVER_LOGS)
    try:
        stage()
    except Exception as error:  # one failing stage must not lose the others' results
        raised = "".join(f"\n  {log.name}: {line}" for log in SERVER_LOGS[servers:] if (line := last_exception(log)))
        say(f"stage {name} FAILED: {error}{raised}")
        error_text = f"{error}{raised}\n{traceback.format_exc()[-3000:]}"
    with RESULTS_LOCK:  # stages of one group run in threads: the dump reads a copy taken under the lock
        if error_text is not None:
            results.setdefault("errors", {})[name] = error_text
        results.setdefault("stage_seconds", {})[name] = round(time.monotonic() - t0, 1)
        (OUT_DIR / "results-partial.json").write_text(json.dumps(dict(results), indent=1, default=str))


# --------------------------------------------------------------------------------------------- serve


def timed_stream(port: int, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed /v1/completions request through the product's client (prefill_accel.serving): its send
    time, TTFT and the gaps between its streamed text chunks."""
    arrivals: list[float] = []
    sent = time.perf_counter()
    done = serving_client.stream_completion(
        serving_client.Server(f"http://127.0.0.1:{port}"), "completions", model, prompt, max_tokens,
        extra={"ignore_eos": True}, on_text=lambda piece: arrivals.append(time.perf_counter()),
    )  # fmt: skip
    return {"sent": sent, "ttft": done.ttft_s, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "chunks": len(arrivals)}  # fmt: skip


def served_ttft(server: Server, prompt: list[int]) -> float:
    return timed_stream(server.port, server.model, prompt, 1)["ttft"]


def mixed_load(server: Server, shorts: list[list[int]], long_prompt: list[int] | None, rate: float,
               seconds: float, seed: int) -> dict:  # fmt: skip
    """Short chats arrive as a Poisson stream of ``rate``/s for ``seconds``; the long request (if any) is
    sent 1 s in. Short-request TTFT and inter-token latency, and the long request's TTFT; ``requests``
    keeps each chat's send time (s after ``start``, the monotonic clock's reading that a step trace's
    ``t`` shares), TTFT and longest gap (ms), to tell which chats set a percentile. Each request is a thread of its own (a stream waits on the server, not on this process)."""
    rng = random.Random(seed)
    with ThreadPoolExecutor(max_workers=256) as pool:
        start = time.perf_counter()
        shorts_sent, long_sent, t, i = [], None, 0.0, 0
        while t < seconds:
            if long_prompt is not None and long_sent is None and t >= 1.0:
                long_sent = pool.submit(timed_stream, server.port, server.model, long_prompt, 4)
            time.sleep(max(0.0, start + t - time.perf_counter()))
            shorts_sent.append(pool.submit(timed_stream, server.port, server.model, shorts[i % len(shorts)], 48))
            i += 1
            t += rng.expovariate(rate)
        done = [future.result() for future in shorts_sent]
        long_result = long_sent.result() if long_sent is not None else None
    ttfts = [d["ttft"] for d in done]
    itls = [gap for d in done for gap in d["itl"]]
    result = {
        "short_requests": len(done), "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p50_ms": percentile(itls, 50) * 1e3, "itl_p99_ms": percentile(itls, 99) * 1e3,
        "start": start, "requests": [[round(d["sent"] - start, 4), round(d["ttft"] * 1e3, 2), round(max(d["itl"], default=0.0) * 1e3, 2)]
                     for d in done],
    }  # fmt: skip
    if long_result is not None:
        result["long_sent_s"] = round(long_result["sent"] - start, 4)
        result["long_ttft_ms"] = long_result["ttft"] * 1e3
        result["long_tokens"] = len(long_prompt)
    return result


def serve_phase(results: dict, gpus: str, args) -> None:
    tok = tokenizer_for("smollm2")
    corpus = Corpus(tok, max(args.lengths) + 64 * 1024)
    model = MODELS / "smollm2"

    def ttft() -> None:
        chunk = ["--max-num-batched-tokens", "16384"]
        with serving_pair(("serve-ttft-upstream", "upstream", gpus, model, 8101, chunk),
                          ("serve-ttft-patched", "patched", gpus, model, 8102,
                           [*chunk, "--attention-backend", "SPARSE_PREFILL"])) as (up, pa):  # fmt: skip
            table = ttft_pairs(up, pa, served_ttft, args.lengths, args.repeats, corpus, 500)
        results["serve_ttft"] = {"model": "smollm2", "engine": "vllm serve, streaming /v1/completions, "
                                 "--max-num-batched-tokens 16384 both sides; patched: --attention-backend "
                                 "SPARSE_PREFILL, default sparse config" + sparse_flags_note(), "by_length": table}  # fmt: skip

    run_stage(results, "serve_ttft", ttft)
    run_stage(results, "mixed_load", lambda: mixed_stage(results, gpus, tok, corpus, model, args))


class serving:
    """``with serving(...) as server``: a started, ready `vllm serve`, stopped on exit."""

    def __init__(self, *args):
        self.args = args

    def __enter__(self) -> Server:
        with starting():
            self.server = Server(*self.args)
            try:
                self.server.wait_ready()
            except Exception:
                self.server.close()
                raise
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.close()


@contextlib.contextmanager
def serving_pair(first: tuple, second: tuple):
    """``with serving_pair(upstream_args, patched_args) as (up, pa)``: two ready servers, each as serving's,
    started at once where `starting` lets them (vLLM 0.26's: the pair is ready when the slower is, where run
    15's patched server, compiling its kernels from an empty Triton cache, took about a minute longer than
    upstream's 82 s one after the other) and one at a time elsewhere; both stopped on exit."""
    pair = [serving(*first), serving(*second)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        entered = [pool.submit(server.__enter__) for server in pair]
    try:
        up, pa = (future.result() for future in entered)
        yield up, pa
    finally:
        for server, future in zip(pair, entered):
            if future.exception() is None:
                server.__exit__(None, None, None)


def mixed_stage(results: dict, gpus: str, tok, corpus: Corpus, model: Path, args) -> None:
    rng = random.Random(7)
    # Disjoint prompts for the warm-up, unloaded and loaded runs, so no run reuses another's cached prefix
    # beyond the chat template's.
    count = int(args.mixed_rate * args.mixed_seconds * 1.5) + 8
    shorts = [chat_prompt(tok, corpus, rng, rng.randint(200, 800), i) for i in range(3 * count)]
    prompts = {"warm": shorts[:count], "unloaded": shorts[count : 2 * count], "loaded": shorts[2 * count :],
               "long": corpus.window(args.mixed_long, 99), "warm_long": corpus.window(args.mixed_long // 2, 98)}  # fmt: skip
    table = {}
    engine_args = shlex.split(args.mixed_engine_args)
    targets = [args.mixed_target_ms]
    if args.mixed_target_ms is None:
        with serving("mixed-upstream", "upstream", gpus, model, 8103, []) as upstream:
            table["upstream defaults"] = run_mixed(upstream, prompts, args)
        itl_p99 = table["upstream defaults"]["unloaded"]["itl_p99_ms"]
        targets = list(dict.fromkeys(mixed_target(engine_args, itl_p99, float(factor))
                                     for factor in args.mixed_target_factors.split(",")))  # fmt: skip
        if engine_args:  # what the engine arguments alone do, apart from the scheduler flags
            with serving("mixed-upstream-args", "upstream", gpus, model, 8102, engine_args) as upstream:
                table["upstream, " + " ".join(engine_args)] = run_mixed(upstream, prompts, args)
    # Chunks stay below --sparse-prefill-min-len here: on this model the sparse path does not pay
    # off below 16K-token chunks (chunk_bench), so the scheduler flags are what this run compares.
    servers = [(target, backend) for target in targets for backend in args.mixed_backends.split(",")]
    for i, (target, backend) in enumerate(servers):
        flags = mixed_flags(backend, target) + engine_args
        label = "patched, " + " ".join(flags)
        label += f" (server {i + 1})" if label in table else ""  # a backend listed twice, for an A/B/A run
        with serving(f"mixed-patched-{i}", "patched", gpus, model, 8104 + i, flags) as ours:
            table[label] = run_mixed(ours, prompts, args)
    for row in table.values():
        unloaded, loaded = row["unloaded"], row["loaded"]
        row["ttft_p99_ratio"] = loaded["ttft_p99_ms"] / unloaded["ttft_p99_ms"]
        row["itl_p99_ratio"] = loaded["itl_p99_ms"] / unloaded["itl_p99_ms"]
    results["mixed_load"] = {"model": model.name, "long_tokens": len(prompts["long"]), "rate_per_s": args.mixed_rate,
                             "seconds": args.mixed_seconds, "short_max_tokens": 48, "configs": table}  # fmt: skip


# Without mixed chunks SGLang's prefill batches run instead of the decodes and hold the chats that join a
# chunk's batch, so its target is set for the short requests' TTFT (<= 3x unloaded): a chat waits for at
# most the batch running when it arrives and the one it joins, so 3x of run 2's ~15 ms unloaded TTFT p99
# needs batches of about 15 ms; 20 ms leaves the document's late chunks room for reading ~98K tokens of
# context (docs/sglang-0.5.md, Scheduler). Run 3 measured what it costs the decodes: ITL p99 57 ms.
SGLANG_STEP_TARGET_MS = 20.0


def mixed_target(engine_args: list[str], upstream_itl_p99_ms: float, factor: float = 1.3) -> float:
    """The patched mixed-load server's --max-step-latency-ms. Where the decodes ride in the step (vLLM;
    SGLang with --enable-mixed-chunk) the target bounds the decode interval, so it comes from upstream's
    unloaded decode latency (``factor`` times its p99), as an operator would set it; SGLang's prefill-only
    batches are timed for the chats' TTFT instead (SGLANG_STEP_TARGET_MS)."""
    if ENGINE == "sglang" and "--enable-mixed-chunk" not in engine_args:
        return SGLANG_STEP_TARGET_MS
    return max(round(factor * upstream_itl_p99_ms, 1), 4.0)


def mixed_flags(backend: str, target_ms: float) -> list[str]:
    """The patched mixed-load server's flags: the scheduler's, with ``--attention-backend backend``
    ('default' leaves vLLM's choice). On SGLang: decode protection every 2 prefill batches,
    shortest-remaining-prefill-first and the step-time target."""
    chosen = [] if backend == "default" else ["--attention-backend", backend]
    if ENGINE == "sglang":
        return [*chosen, "--max-consecutive-prefill-batches", "2", "--schedule-policy", "srpf",
                "--max-step-latency-ms", str(target_ms)]  # fmt: skip
    return [*chosen, "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "1",
            "--long-prefill-token-threshold", "4096", "--prefill-order", "srpf",
            "--max-step-latency-ms", str(target_ms)]  # fmt: skip


def run_mixed(server: Server, prompts: dict, args) -> dict:
    # Warm the server's paths (short chats, a long prefill) before measuring.
    mixed_load(server, prompts["warm"], None, args.mixed_rate, 3.0, 1)
    mixed_load(server, prompts["warm"][:1], prompts["warm_long"], 1.0, 1.5, 2)
    row = {
        "unloaded": mixed_load(server, prompts["unloaded"], None, args.mixed_rate, args.mixed_seconds, 3),
        "loaded": mixed_load(server, prompts["loaded"], prompts["long"], args.mixed_rate, args.mixed_seconds, 3),
    }
    brief = {window: {k: v for k, v in figures.items() if k != "requests"} for window, figures in row.items()}
    say(f"{server.name}: unloaded {brief['unloaded']}, loaded {brief['loaded']}")
    return row


# --------------------------------------------------------------------------------------------- tp


def tp_phase(results: dict, gpus: str, args) -> None:
    run_stage(results, "tp2_equality", lambda: equality_stage(results, gpus, "gemma3", 2, "gemma3_tp2"))

    def ttft() -> None:
        tok = tokenizer_for("gemma3")
        corpus = Corpus(tok, 131072 + 64 * 1024)
        base = dict(max_model_len=LONG_LEN, chunk=16384, eager=False, tp=2)
        up, pa = pair("gemma-tp2-ttft", gpus, engine_kwargs("gemma3", **base),
                      engine_kwargs("gemma3", **base, **sparse()))  # fmt: skip
        try:
            table = ttft_pairs(up, pa, lambda w, ids: w.call(op="ttft", prompt=ids)["seconds"], [32768, 131072],
                               args.repeats, corpus, 900)  # fmt: skip
        finally:
            up.close()
            pa.close()
        results["tp2_ttft"] = {"model": "gemma3", "tp": 2, "engine": "LLM, TP=2, chunked prefill 16384, defaults; "
                               "patched: default sparse config (3 of 18 layers full attention)" + sparse_flags_note(),
                               "by_length": table}

    run_stage(results, "tp2_ttft", ttft)


# --------------------------------------------------------------------------------------------- qwen


def transformers_greedy(model: str, prompts: list[list[int]], max_tokens: int, rope) -> list[list[int]]:
    """Greedy tokens of the converted checkpoint in transformers (the harness's model, as vLLM loads it),
    on GPU 0 in this process, with ``rope`` (a RopeScaling, or None) applied to its config first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODELS / model)
    if rope is not None:
        rope.apply(config)
    hf = AutoModelForCausalLM.from_pretrained(MODELS / model, config=config, dtype=torch.bfloat16).to("cuda").eval()
    try:
        with torch.no_grad():
            return [hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_tokens, do_sample=False)[0, len(ids):]
                    .tolist() for ids in prompts]  # fmt: skip
    finally:
        del hf
        torch.cuda.empty_cache()


def rope_check_stage(results: dict, gpus: str, model: str) -> None:
    """vLLM 0.26 applies the long-context override: on short prompts, upstream vLLM's greedy tokens agree
    with the harness's transformers model natively and with the override, and the override changes
    vLLM's log-probs (it would not, were it ignored)."""
    spec = MODEL_SPECS[model]
    tok = tokenizer_for(model)
    corpus = Corpus(tok, 8192)
    rng = random.Random(11)
    prompts = [chat_prompt(tok, corpus, rng, 300 + 200 * i, 70 + i) for i in range(4)]
    runs = {}
    for label, max_len, rope in (("native", spec.max_length, None), (str(spec.long_context), long_len(model), spec.long_context)):
        worker = Worker(f"{model}-rope-{label.replace(':', '')}", "upstream", gpus,
                        engine_kwargs(model, max_model_len=max_len, chunk=2048, eager=True))  # fmt: skip
        try:
            vllm_out = worker.call(op="generate", prompts=prompts, max_tokens=24, logprobs=2)
        finally:
            worker.close()
        rows = compare_tokens(vllm_out, {"tokens": transformers_greedy(model, prompts, 24, rope)})
        runs[label] = {"max_model_len": max_len, "hf_overrides": long_context_overrides(model, max_len),
                       "equal": sum(r["equal"] for r in rows), "prompts": len(rows), "rows": rows,
                       "first_top": [top[0] for top in vllm_out["top"]]}  # fmt: skip
        say(f"{model} rope {label}: vLLM and transformers greedy tokens equal on {runs[label]['equal']}/{len(rows)}")
    native, scaled = runs.values()
    change = max(abs(a[0][1] - b[0][1]) for a, b in zip(native["first_top"], scaled["first_top"]))
    results[f"{model}_rope_check"] = {"runs": runs, "max_first_logprob_change": change, "override_applied": change > 1e-3}
    say(f"{model} rope override changes vLLM's first-token log-prob by up to {change:.4f}")


def serve_bench_stage(results: dict, gpus: str, model: str, args) -> None:
    """TTFT through `vllm serve` streaming, the two servers alternating, then `prefill-accel bench` against the
    same two servers."""
    path = MODELS / model
    chunk = ["--max-num-batched-tokens", "16384"]
    tok = tokenizer_for(model)
    corpus = Corpus(tok, max(args.lengths) + 64 * 1024)
    with serving_pair((f"{model}-serve-upstream", "upstream", gpus, path, 8111, chunk),
                      (f"{model}-serve-patched", "patched", gpus, path, 8112,
                       [*chunk, "--attention-backend", "SPARSE_PREFILL"])) as (up, pa):  # fmt: skip
        table = ttft_pairs(up, pa, served_ttft, [prompt_len(model, n) for n in args.lengths], args.repeats, corpus, 500)
        server = {"vllm-v0": "vLLM 0.6.3's OpenAI server (v0_server)",
                  "sglang": "sglang.launch_server (sglang_server)"}.get(ENGINE, "vllm serve")
        results[f"{model}_serve_ttft"] = {
            "model": model, "engine": f"{server}, streaming /v1/completions, --max-num-batched-tokens 16384, "
            f"--max-model-len {long_len(model)} {long_context_overrides(model, long_len(model))} both sides; patched: "
            "--attention-backend SPARSE_PREFILL, default sparse config" + sparse_flags_note(), "by_length": table,
        }  # fmt: skip
        results[f"{model}_bench"] = run_bench(up, pa, model, args)
        if ENGINE == "sglang":
            results[f"{model}_bench_serving"] = sglang_bench_serving(up, pa, model, tok, corpus, args)


def sglang_bench_serving(up: Server, pa: Server, model: str, tok, corpus: Corpus, args) -> dict:
    """SGLang's own benchmark (its users' tool) against the two servers, beside `prefill-accel bench`: per
    length, --repeats requests one at a time, one output token; its median TTFT. The runs go through its
    entry point in one process (sglang_bench_serving.py), upstream and patched in turn at each length.

    Its `random` dataset over a file of this corpus's text in ShareGPT's layout, one entry per request, each
    longer than the length asked, so that every prompt is real text cut to the length as token ids
    (--tokenize-prompt; as text, ids decode and tokenise back to another length: run 4, 2026-12-06). Its
    `random-ids` prompts (consecutive token ids) failed at 131008 on both servers in run 5 (2026-12-06), and
    bench_serving counts a first token only when the streamed text is not empty, which one token after
    such a prompt need not give. Its warm-up request is the first measured prompt, so the radix cache is
    flushed after it (--flush-cache): otherwise one of the measured requests is a full cache hit. Each run's
    details (--output-details) keep every request's TTFT and error; a run that records no first token has
    no figure and its first error is kept."""
    runs, outputs = [], {}
    for length in [prompt_len(model, n) for n in args.lengths]:
        dataset = OUT_DIR / f"bench-serving-prompts-{length}.json"
        texts = [tok.decode(corpus.window(length + 512, 60_000 + 97 * length + i)) for i in range(args.repeats + 1)]
        dataset.write_text(json.dumps([{"conversations": [{"value": text}, {"value": ""}]} for text in texts]))
        for label, server in (("upstream", up), ("patched", pa)):
            out = outputs[length, label] = OUT_DIR / f"bench-serving-{label}-{length}.jsonl"
            out.unlink(missing_ok=True)
            runs.append(["--backend", "sglang", "--base-url", f"http://127.0.0.1:{server.port}", "--model", server.model,
                         "--tokenizer", server.model, "--dataset-name", "random", "--dataset-path", str(dataset),
                         "--random-input-len", str(length), "--random-output-len", "1", "--random-range-ratio", "1",
                         "--num-prompts", str(args.repeats), "--max-concurrency", "1", "--request-rate", "inf",
                         "--seed", str(length), "--flush-cache", "--tokenize-prompt", "--output-details",
                         "--disable-tqdm", "--output-file", str(out)])  # fmt: skip
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_bench_serving.py"))],
                          input=json.dumps(runs), env=side_env("upstream", ""), capture_output=True, text=True,
                          timeout=3600)  # fmt: skip
    (LOGS / "bench-serving.log").write_text(proc.stdout + proc.stderr)
    table = {}
    for (length, label), out in outputs.items():
        lines = out.read_text().splitlines() if out.is_file() else []
        row = table.setdefault(length, {})
        found = json.loads(lines[-1]) if lines else {}
        row[f"{label}_ms"] = found.get("median_ttft_ms") or None
        row[f"{label}_ttfts_ms"] = [round(t * 1e3, 1) for t in found.get("ttfts") or []]
        errors = [error for error in found.get("errors") or [] if error]
        if not row[f"{label}_ms"]:
            row[f"{label}_error"] = (errors[0][-600:] if errors else
                                     "no first token recorded" if lines else "no result written (bench-serving.log)")
        if label == "patched":
            if row["upstream_ms"] and row["patched_ms"]:
                row["speedup"] = row["upstream_ms"] / row["patched_ms"]
            say(f"bench_serving {length}: " + str({k: v for k, v in row.items() if not k.endswith("ttfts_ms")}))
    return {"command": "python -m sglang.bench_serving --backend sglang --dataset-name random --dataset-path FILE "
            f"--random-output-len 1 --num-prompts {args.repeats} --max-concurrency 1 --flush-cache --tokenize-prompt",
            "exit": proc.returncode, "by_length": table}  # fmt: skip


def run_bench(up: Server, pa: Server, model: str, args) -> dict:
    """`prefill-accel bench` itself (the product's client) against the two servers: its table and JSON."""
    import importlib.util

    out = OUT_DIR / f"bench-{model}"
    command = [sys.executable, "-m", "prefill_accel.cli", "bench", "-q", "--url", f"http://127.0.0.1:{pa.port}",
               "--baseline-url", f"http://127.0.0.1:{up.port}", "--model", pa.model, "--api", "completions",
               "--lengths", ",".join(map(str, args.lengths)), "--repeats", str(args.repeats), "--max-tokens", "8",
               "--ignore-eos", "--tokenizer", pa.model, "--out", str(out)]  # fmt: skip
    if importlib.util.find_spec("matplotlib") is None:
        command.append("--no-plots")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "kernels"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    (LOGS / f"bench-{model}.log").write_text(proc.stdout + proc.stderr)
    say(f"prefill-accel bench exit {proc.returncode}:\n{proc.stdout}")
    report = out / "results.json"
    return {"command": " ".join(command), "exit": proc.returncode, "table": proc.stdout,
            "results": json.loads(report.read_text()) if report.is_file() else None}  # fmt: skip


def harness_env(gpus: str) -> dict[str, str]:
    """The accuracy harness's environment: the checkout's runtime package and the GGUF reader alone
    (scripts/e2e/unpack-stage.sh), under the GPU image's transformers, not vLLM's site."""
    return {**side_env("patched", gpus), "PYTHONPATH": f"{GGUF_ONLY}:{ROOT / 'kernels'}"}


def staged_gguf(model: str) -> Path:
    spec = MODEL_SPECS[model]
    return Path(os.environ.get("PREFILL_ACCEL_CACHE", "/tmp/bundle/cache")) / "models" / model / spec.gguf_name


def harness(name: str, gpus: str, model: str, args: list[str], timeout: float = 1500) -> str:
    """``python -m prefill_accel.accuracy --gguf <model> --device cuda ARGS`` with its log in LOGS/name.log;
    its standard output, or EngineError with the log's tail."""
    log = LOGS / f"{name}.log"
    command = [sys.executable, "-m", "prefill_accel.accuracy", "--gguf", str(staged_gguf(model)), "--device", "cuda", *args]
    proc = subprocess.run(command, env=harness_env(gpus), capture_output=True, text=True, timeout=timeout)
    log.write_text(" ".join(command) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise EngineError(f"{name} failed; log tail:\n{log_tail(log)}")
    return proc.stdout


def capture_dir() -> Path:
    return OUT_DIR.parent / "captures"


def capture_stage(gpus: str, model: str, args) -> None:
    """The model's own q/k/v of layers --capture-layers, at its training length natively and at the longest
    length with its long-context rope scaling (the accuracy harness's --capture), for layer_time_stage."""
    spec = MODEL_SPECS[model]
    capture_dir().mkdir(parents=True, exist_ok=True)
    for length in (spec.max_length, prompt_len(model, max(args.lengths))):
        rope = ["--rope-scaling", str(spec.long_context)] if spec.long_context and length > spec.max_length else []
        harness(f"capture-{model}-{length}", gpus, model,
                ["--lengths", str(length), "--layers", args.capture_layers, "--capture", str(capture_dir()), *rope])  # fmt: skip


def accuracy_stage(results: dict, gpus: str, model: str, run: int, run_args: str) -> None:
    """One accuracy-harness run (--accuracy-run): its JSON in OUT_DIR/accuracy-<model>-<run>.json, its
    printed tables in the results and the log."""
    out = OUT_DIR / f"accuracy-{model}-{run}.json"
    text = harness(f"accuracy-{model}-{run}", gpus, model, [*shlex.split(run_args), "--out", str(out)], timeout=2400)
    with RESULTS_LOCK:
        results.setdefault(f"{model}_accuracy", {})[run] = {"args": run_args, "table": text, "json": out.name}
    say(f"{model} accuracy run {run} ({run_args}):\n{text}")


def layer_time_stage(results: dict, gpus: str, model: str, args) -> None:
    """Per-layer attention time of whole prefills, ours against vLLM's FA3, and the search's share
    (scripts/e2e/bench_chunk.py --prefill), at the model's shape on structured inputs and on the
    model's own q/k/v from capture_stage."""
    out, log = OUT_DIR / f"layers-{model}.json", LOGS / f"bench-chunk-{model}.log"
    heads, kv_heads, head_dim = args.model_shape.split("/")
    command = [sys.executable, str(ROOT / "scripts" / "e2e" / "bench_chunk.py"), "--prefill", "--chunk", "16384",
               "--lengths", ",".join(str(prompt_len(model, n)) for n in args.lengths if n >= 16384),
               "--heads", heads, "--kv-heads", kv_heads, "--head-dim", head_dim, "--estimators", "mixed",
               "--real", *map(str, sorted(capture_dir().glob(f"{staged_gguf(model).stem}_L*_layer*.pt"))),
               "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, env=side_env("patched", gpus), capture_output=True, text=True, timeout=1800)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise EngineError(f"bench_chunk.py --prefill failed; log tail:\n{log_tail(log)}")
    results[f"{model}_layer_times"] = json.loads(out.read_text())
    say("\n".join(line for line in proc.stdout.splitlines() if line.startswith("|")))


def qwen_phase(results: dict, gpus: str, args) -> None:
    """The checks first, side by side on the GPU (they time nothing: rope, greedy equality, needles, the
    engine's density per chunk, the captures and the accuracy runs; at most --check-workers at once), then
    the timed stages one at a time on an otherwise idle GPU."""
    lengths = [32768 - 32, 65536, 131072 - 64]  # the longest leave room for the answer under YaRN's 128K
    checks = [
        ("qwen_needles", lambda: needle_stage(results, gpus, QWEN, lengths, NEEDLE_DEPTHS, "qwen_needles")),
        ("qwen_equality", lambda: equality_stage(results, gpus, QWEN, 1, "qwen")),
        *[(f"qwen_accuracy_{n}", lambda n=n, a=a: accuracy_stage(results, gpus, QWEN, n, a))
          for n, a in enumerate(args.accuracy_run, 1)],
        ("qwen_captures", lambda: capture_stage(gpus, QWEN, args)),
        ("qwen_engine_density", lambda: engine_density_stage(results, gpus, QWEN, "qwen_engine_density")),
        ("qwen_rope_check", lambda: rope_check_stage(results, gpus, QWEN)),
    ]  # fmt: skip
    with ThreadPoolExecutor(max_workers=args.check_workers) as pool:
        for job in [pool.submit(run_stage, results, name, stage) for name, stage in checks]:
            job.result()
    timed = [("qwen_offline_ttft", lambda: offline_ttft_stage(results, gpus, QWEN, args.lengths, args.repeats,
                                                              "qwen_offline_ttft"))]  # fmt: skip
    if args.variant_env:
        long_lengths = [n for n in args.lengths if n >= 32768]
        timed.append(("qwen_variant_ttft", lambda: variant_ttft_stage(results, gpus, QWEN, long_lengths, args.repeats,
                                                                      dict(args.variant_env))))  # fmt: skip
    timed += [("qwen_layer_times", lambda: layer_time_stage(results, gpus, QWEN, args)),
              ("qwen_serve", lambda: serve_bench_stage(results, gpus, QWEN, args))]  # fmt: skip
    for name, stage in timed:
        run_stage(results, name, stage)


def engine_phase(results: dict, gpus: str, args, engine: str, tag: str) -> None:
    """Another engine (``engine``: ENGINE's "vllm-v0" or "sglang") patched against its upstream on
    Qwen2.5-Coder-1.5B, each stage its own pair, started in turn: greedy tokens at threshold 0, needles at
    32K and 128K (default config), offline TTFT, the mixed load, greedy tokens at threshold 0 on SmolLM2
    (another head layout, 9 / 3 with d=64; trained to 8K, so no needles past it) and on SGLang its offline
    TTFT with the rotary table sized for the run (speed only; V0 takes no such override), and last, the
    longest, TTFT through its server with `prefill-accel bench` (and SGLang's bench_serving). Stages and
    results are named ``tag``_..."""
    global ENGINE
    ENGINE = engine
    tok = tokenizer_for(QWEN)
    stages = [
        (f"{tag}_equality", lambda: equality_stage(results, gpus, QWEN, 1, f"{tag}_qwen")),
        (f"{tag}_needles", lambda: needle_stage(results, gpus, QWEN, [32768 - 32, 131072 - 64], NEEDLE_DEPTHS,
                                                f"{tag}_qwen_needles")),
        (f"{tag}_offline_ttft", lambda: offline_ttft_stage(results, gpus, QWEN, args.lengths, args.repeats,
                                                           f"{tag}_qwen_offline_ttft")),
        (f"{tag}_mixed_load", lambda: mixed_stage(results, gpus, tok, Corpus(tok, 256 * 1024), MODELS / QWEN, args)),
        (f"{tag}_smol_equality", lambda: equality_stage(results, gpus, "smollm2", 1, f"{tag}_smollm2")),
    ]  # fmt: skip
    if engine == "sglang":  # V0 takes no max_position_embeddings override, and SmolLM2 holds 8K
        stages.append((f"{tag}_smol_offline_ttft", lambda: offline_ttft_stage(
            results, gpus, "smollm2", args.lengths, args.repeats, f"{tag}_smollm2_offline_ttft")))
    stages.append((f"{tag}_serve", lambda: serve_bench_stage(results, gpus, QWEN, args)))
    for name, stage in stages:
        run_stage(results, name, stage)


# --------------------------------------------------------------------------------------------- chunk


def chunk_phase(results: dict, gpus: str, args) -> None:
    """Where a sparse chunk's time goes: scripts/e2e/bench_chunk.py (our stages vs vLLM's FA3 on one
    SmolLM2-shaped chunk), and the density the search keeps inside the engine (PREFILL_ACCEL_STATS)."""

    def bench() -> None:
        out, log = OUT_DIR / "chunk.json", LOGS / "bench-chunk.log"
        command = [sys.executable, str(ROOT / "scripts" / "e2e" / "bench_chunk.py"), "--out", str(out)]
        proc = subprocess.run(command, env=side_env("patched", gpus), capture_output=True, text=True, timeout=540)
        log.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise EngineError(f"bench_chunk.py failed; log tail:\n{log_tail(log)}")
        results["chunk_bench"] = json.loads(out.read_text())
        say("\n".join(line for line in proc.stdout.splitlines() if line.startswith("|")))

    run_stage(results, "chunk_bench", bench)
    run_stage(results, "engine_density", lambda: engine_density_stage(results, gpus, "smollm2", "engine_density"))


def engine_density_stage(results: dict, gpus: str, model: str, key: str) -> None:
    """The density the search keeps inside the engine, and the search's and attention's time per chunk
    (PREFILL_ACCEL_STATS: one log line per chunk through every layer; each call synchronised, so these
    are not the TTFT runs): a 16K prompt (one chunk), a 32K one, then a 128K one."""
    layers = json.loads((MODELS / model / "config.json").read_text())["num_hidden_layers"]
    corpus = Corpus(tokenizer_for(model), 131072 + 64 * 1024)
    kwargs = engine_kwargs(model, max_model_len=long_len(model), chunk=16384, eager=True, **sparse())
    worker = Worker(f"{model}-stats", "patched", gpus, kwargs, extra_env={"PREFILL_ACCEL_STATS": str(layers)})
    try:
        for length in (16384, 32768, prompt_len(model, 131072)):
            worker.call(op="ttft", prompt=corpus.window(length, 4242 + length))
    finally:
        worker.close()
    lines = stats_lines(worker.log)
    results[key] = {"model": model, "lines": lines,
                    "note": f"per chunk of 16384 queries, {layers} layers each; 16K prompt, 32K, then 128K; in the "
                    "qwen phase it runs beside the other checks, so its milliseconds are not the kernels' own"}  # fmt: skip
    say(f"{model} engine density:\n" + "\n".join(lines))


# --------------------------------------------------------------------------------------------- report


JIT_LINE = "Triton kernel JIT compilation during inference: "  # vLLM's JIT monitor
WARMUP_LINE = "prefill-accel: compiled and tuned the kernels"


def compilations(logs: Path) -> dict:
    """Per engine log: the warm-up's line (what it ran and how long it took) and the Triton kernels vLLM's
    JIT monitor saw compile during inference, in order, so a run shows what the warm-up left out."""
    found = {}
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace").splitlines()
        warmups = [line.split(WARMUP_LINE, 1)[1].strip() for line in text if WARMUP_LINE in line]
        compiled = [line.split(JIT_LINE, 1)[1].split(".", 1)[0] for line in text if JIT_LINE in line]
        if warmups or compiled:
            found[log.stem] = {"warmup": warmups, "jit_during_inference": compiled}
    return found


def report(results: dict) -> str:
    lines = [f"# {results['engine']} end to end: {results['device']}, {results['date']}", ""]
    if f"{QWEN}_rope_check" in results:
        r = results[f"{QWEN}_rope_check"]
        lines.append(f"{QWEN} rope override applied by vLLM: {r['override_applied']} (first-token log-prob changes by up to "
                     f"{r['max_first_logprob_change']:.4f}); greedy tokens vLLM = transformers: "
                     + ", ".join(f"{label} {run['equal']}/{run['prompts']}" for label, run in r["runs"].items()))
    for key in [key for key in results if key.endswith("_greedy_threshold0")]:  # equality_stage's, in run order
        r = results[key]
        lines.append(f"Greedy tokens, threshold 0, {r['model']} TP={r['tp']}: **{r['equal']}/{r['prompts']}** "
                     f"prompts equal to upstream ({r['engine']})")  # fmt: skip
        hit = r.get("prefix_hit")
        if hit:
            lines.append(f"  prefix-cache hit: {hit['computed_sparse_tokens']} of its {hit['prompt_tokens']} tokens "
                         f"computed by the sparse kernel ({hit['shared_prefix_tokens']} shared with a cached prompt)")
        t = r.get("teacher_forced")
        if t and "skipped" in t:
            lines.append(f"  teacher-forced comparison not run: {t['skipped']}")
        elif t:
            lines.append(f"  teacher-forced on upstream's tokens: top-1 equal at {t['top1_agree']}/{t['positions']} "
                         f"positions, max |log-prob difference| {t['max_abs_logprob_diff']:.3f} nats")  # fmt: skip
        for row in r["rows"]:
            if not row["equal"]:
                lines.append(f"  - prompt {row['prompt']} ({row['prompt_tokens']} tokens): first difference at "
                             f"output token {row['first_diff']}, upstream top-1/top-2 margin "
                             f"{row.get('upstream_margin', float('nan')):.3f} nats")  # fmt: skip
    for key in ("gemma_needles", "qwen_needles", "v0_qwen_needles", "sglang_qwen_needles"):
        if key in results:
            lines += ["", f"| {results[key]['model']} needles | upstream correct | patched correct | same answer |",
                      "|---|---|---|---|"]  # fmt: skip
            for length, s in results[key]["by_length"].items():
                lines.append(f"| {length} | {s['upstream_correct']}/{s['prompts']} | {s['patched_correct']}/{s['prompts']} "
                             f"| {s['same_answer']}/{s['prompts']} |")  # fmt: skip
    for key in ("offline_ttft", "serve_ttft", "tp2_ttft", "qwen_offline_ttft", f"{QWEN}_serve_ttft",
                "v0_qwen_offline_ttft", "sglang_qwen_offline_ttft", "sglang_smollm2_offline_ttft"):
        if key in results:
            lines += ["", f"| {key} ({results[key]['model']}) | upstream ms | patched ms | speedup |", "|---|---|---|---|"]
            for length, row in results[key]["by_length"].items():
                lines.append(f"| {length} | {row['upstream_ms']:.1f} | {row['patched_ms']:.1f} | {row['speedup']:.2f}x |")
    if f"{QWEN}_variant_ttft" in results:
        r = results[f"{QWEN}_variant_ttft"]
        lines += ["", f"| {QWEN}, patched with {r['variant']} against without | with ms | without ms | without is "
                  "faster by |", "|---|---|---|---|"]  # fmt: skip
        for length, row in r["by_length"].items():
            lines.append(f"| {length} | {row['variant_ms']:.1f} | {row['default_ms']:.1f} | {row['speedup']:.2f}x |")
    if "mixed_load" in results:
        m = results["mixed_load"]
        lines += ["", f"Mixed load: one {m['long_tokens']}-token request + short chats at {m['rate_per_s']}/s for "
                  f"{m['seconds']} s", "",
                  "| config | short TTFT p50 / p99 unloaded (ms) | loaded (ms) | p99 ratio | ITL p99 unloaded / loaded "
                  "(ms) | ratio | long TTFT (ms) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for label, row in m["configs"].items():
            un, lo = row["unloaded"], row["loaded"]
            lines.append(f"| {label} | {un['ttft_p50_ms']:.1f} / {un['ttft_p99_ms']:.1f} | {lo['ttft_p50_ms']:.1f} / "
                         f"{lo['ttft_p99_ms']:.1f} | {row['ttft_p99_ratio']:.2f} | {un['itl_p99_ms']:.1f} / "
                         f"{lo['itl_p99_ms']:.1f} | {row['itl_p99_ratio']:.2f} | {lo.get('long_ttft_ms', 0):.0f} |")
    if f"{QWEN}_bench" in results:
        lines += ["", f"`prefill-accel bench` (exit {results[f'{QWEN}_bench']['exit']}):", "", results[f"{QWEN}_bench"]["table"]]
    if f"{QWEN}_bench_serving" in results:
        lines += ["", f"| SGLang bench_serving ({QWEN}) | upstream median TTFT ms | patched | speedup |", "|---|---|---|---|"]
        for length, row in results[f"{QWEN}_bench_serving"]["by_length"].items():
            cells = [f"{row[k]:.1f}" if row.get(k) else "failed" for k in ("upstream_ms", "patched_ms")]
            lines.append(f"| {length} | {cells[0]} | {cells[1]} | {row['speedup']:.2f}x |" if "speedup" in row
                         else f"| {length} | {cells[0]} | {cells[1]} | - |")  # fmt: skip
    for name, error in results.get("errors", {}).items():
        lines += ["", f"ERROR in {name}: {error.splitlines()[0] if error else ''}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="offline,serve")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mixed-long", type=int, default=98304, help="tokens of the long request of the mixed load")
    parser.add_argument("--mixed-rate", type=float, default=4.0, help="short chats per second")
    parser.add_argument("--mixed-seconds", type=float, default=20.0)
    parser.add_argument("--mixed-target-ms", type=float, help="--max-step-latency-ms of the patched mixed-load "
                        "server; given, the upstream server is not run (default: on vLLM 1.3x upstream's unloaded "
                        "ITL p99, as on SGLang with --enable-mixed-chunk in --mixed-engine-args; else on SGLang "
                        "SGLANG_STEP_TARGET_MS, 20)")
    parser.add_argument("--mixed-target-factors", default="1.3", help="comma-separated multiples of upstream's "
                        "unloaded ITL p99, one patched mixed-load server per resulting target (and backend), where "
                        "the target comes from it (no --mixed-target-ms): a higher target admits more chats whole")
    parser.add_argument("--mixed-backends", default="SPARSE_PREFILL", help="comma-separated --attention-backend "
                        "values, one patched mixed-load server each, in this order, same scheduler flags; "
                        "'default' leaves vLLM's choice (the scheduler flags alone)")
    parser.add_argument("--mixed-engine-args", default="", help="more vLLM arguments (one shell-quoted string) for "
                        "every patched mixed-load server and for a second upstream server, run after upstream's "
                        "defaults, so their effect shows apart from the scheduler flags")
    parser.add_argument("--skip", default="", help="comma-separated stage names to leave out (smol_equality, "
                        "gemma_needles, offline_ttft, serve_ttft, mixed_load, chunk_bench, engine_density, "
                        "tp2_equality, tp2_ttft, qwen_rope_check, qwen_equality, qwen_needles, qwen_accuracy_N, qwen_captures, "
                        "qwen_engine_density, qwen_offline_ttft, qwen_variant_ttft, qwen_serve, qwen_layer_times, v0_equality, "
                        "v0_needles, v0_offline_ttft, v0_serve, v0_mixed_load, sglang_equality, sglang_needles, sglang_offline_ttft, sglang_serve, sglang_mixed_load, v0_smol_equality, sglang_smol_equality, sglang_smol_offline_ttft)")  # fmt: skip
    parser.add_argument("--capture-layers", default="7,21", help="layers of the qwen phase's captured q/k/v")
    parser.add_argument("--accuracy-run", action="append", default=[], metavar="ARGS",
                        help="arguments of one accuracy-harness run on the qwen model among the qwen phase's checks "
                        "(repeatable; each its own process and JSON), e.g. '--lengths 32768 --thresholds 0.004,0.008'")
    parser.add_argument("--variant-env", type=parse_env_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="a setting of the qwen phase's variant TTFT stage (repeatable): offline TTFT at 32K and "
                        "longer of a patched engine with these environment variables against one without, e.g. "
                        "PREFILL_ACCEL_SPLIT_KV=0; without it the stage does not run")  # fmt: skip
    parser.add_argument("--check-workers", type=int, default=4, help="qwen phase checks run at once on the GPU")
    parser.add_argument("--model-shape", default="12/2/128", help="query heads / KV heads / head_dim of the qwen "
                        "phase's structured per-layer timing")  # fmt: skip
    parser.add_argument("--sparse-flag", type=parse_sparse_flag, action="append", default=[], metavar="NAME=VALUE",
                        help="a --sparse-prefill-NAME value for every patched engine (repeatable), e.g. estimator=exact")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    SKIP.update(name for name in args.skip.split(",") if name)
    SPARSE_FLAGS.update(args.sparse_flag)

    import torch

    LOGS.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    device = f"{gpus}x {torch.cuda.get_device_name(0)}" if gpus else "no GPU"
    phases = args.phases.split(",")
    alone = {"v0": "vLLM 0.6.3.post1", "sglang": "SGLang 0.5.16"}
    for phase in set(alone) & set(phases):
        if len(phases) > 1:
            parser.error(f"--phases {phase} runs alone (its engines are {alone[phase]}'s, the others vLLM 0.26's)")
    engine = alone.get(phases[0], "vLLM 0.26.0")
    results = {"device": device, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "engine": engine,
               "command": " ".join(sys.argv)}  # fmt: skip
    global OUT_DIR
    out = OUT_DIR = Path(args.out)
    # Two GPUs run the offline and serve phases side by side; one GPU runs them in turn (their timings
    # must not share it).
    with ThreadPoolExecutor(max_workers=2 if gpus > 1 else 1) as pool:
        jobs = []
        if "offline" in phases:
            jobs.append(pool.submit(run_stage, results, "offline", lambda: offline_phase(results, "0", args)))
        if "serve" in phases:
            gpu = "1" if gpus > 1 and "offline" in phases else "0"
            jobs.append(pool.submit(run_stage, results, "serve", lambda: serve_phase(results, gpu, args)))
        for job in jobs:
            job.result()
    if "chunk" in phases:
        chunk_phase(results, "0", args)
    if "tp" in phases:
        tp_phase(results, "0,1", args)
    if "qwen" in phases:
        qwen_phase(results, "0", args)
    if "v0" in phases:
        engine_phase(results, "0", args, "vllm-v0", "v0")
    if "sglang" in phases:
        engine_phase(results, "0", args, "sglang", "sglang")
    results["compilations"] = compilations(LOGS)
    for name, seen in results["compilations"].items():
        say(f"{name}: warm-up {'; '.join(seen['warmup']) or 'none'}; compiled during inference: "
            f"{', '.join(seen['jit_during_inference']) or 'nothing'}")
    (out / f"results-{'-'.join(phases)}.json").write_text(json.dumps(results, indent=1, default=str))
    text = report(results)
    (out / f"report-{'-'.join(phases)}.md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
