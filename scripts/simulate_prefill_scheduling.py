#!/usr/bin/env python3
"""Simulate vLLM's real scheduler (V1 or V0) on a long-plus-short workload with a cost model, no GPU.

Drives the scheduler of vLLM 0.26.0 (`--engine v1`, `vllm.v1.core.sched.scheduler.Scheduler`) or of
vLLM 0.6.3 (`--engine v0`, `vllm.core.scheduler.Scheduler`) step by step on simulated time: each step's
duration comes from a cost model (`Costs`: fixed + per token + per attention query-key pair + per token
of context a prefill chunk reads before its own + a fixed extra for a step carrying any prefill chunk; `--costs 8b`, an illustrative 8B-class model on one
H200-class GPU with dense attention, or `--costs smollm2`, SmolLM2-135M as measured on the H200), fed
back to the scheduler as its clock. Workloads: `doc` (default), background chats decoding from the
start, one 128K-token document, then short chat requests every half second while it prefills; `serve`,
the H200 mixed load of docs/e2e-vllm.md (Poisson chats, one long document or none).
Prints a Markdown table per scheduler configuration: short requests' time to first schedule
and to first token, decode step time (inter-token latency) and decode stalls, document TTFT.

Run it with a vLLM tree (patched or not) and the runtime package first on PYTHONPATH, in that
vLLM's CPU test environment; configurations whose options this vLLM lacks are reported as such:

  PYTHONPATH=<vLLM 0.26.0 tree>:kernels python scripts/simulate_prefill_scheduling.py
  PYTHONPATH=<vLLM 0.6.3 tree>:kernels python scripts/simulate_prefill_scheduling.py --engine v0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Costs:
    """Cost model of one step, seconds: fixed + per token + per attention query-key pair + per token of
    context a prefill chunk reads before its own tokens (prefill attention splits its work by query
    tiles, so a small chunk reads its context with few thread blocks) + a fixed extra when the step
    carries any prefill chunk (engines replay a decode-only batch as one CUDA graph and run the
    others piecewise)."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    per_context_s: float
    prefill_step_s: float = 0.0

    def step(self, chunks: dict[str, tuple[int, int]], decoding: set[str]) -> float:
        prefill = any(r not in decoding for r in chunks)
        return self.fixed_s + (self.prefill_step_s if prefill else 0.0) + sum(
            self.per_token_s * n + self.per_pair_s * attention_pairs(c, n)
            + (self.per_context_s * c if r not in decoding else 0.0)
            for r, (n, c) in chunks.items()
        )  # fmt: skip


# SmolLM2-135M on one H200 under vllm serve, from the runs of docs/e2e-vllm.md: ~2 ms decode steps (ITL
# p50), FA3's 9.87 ms per layer for a 16384-token chunk after 112K tokens (1.5e-10 s per pair over 30 layers),
# ~8-10 ms for a small chunk at 50K context (0.16 us per context token), 3.2 ms more for a step with a prefill
# chunk (run 9's step trace: 5.05 ms median for a step of decodes and a chunk of < 64 tokens, 1.79 ms for
# decodes alone; vLLM's default CUDA graph mode); 3 us per token fits the 8K chunks of a long prompt
# (chat-sized chunks measured 8-11 us, steps over 512 tokens leave the CUDA graphs: a cliff this linear
# model leaves out).
SMOLLM2 = Costs(fixed_s=0.002, per_token_s=3e-6, per_pair_s=1.5e-10, per_context_s=0.16e-6, prefill_step_s=0.0032)

COSTS = {
    # Illustrative: ~16 GFLOP of linear layers per token at ~550 TFLOP/s; 4 * d_model * layers = 0.5 MFLOP
    # per pair at ~400 TFLOP/s; 128 KiB of K/V per context token (32 layers x 8 KV heads x 128 x bf16 x 2)
    # read at ~1 TB/s.
    "8b": Costs(fixed_s=0.005, per_token_s=30e-6, per_pair_s=1.3e-9, per_context_s=0.13e-6),
    "smollm2": SMOLLM2,
    # The same with --compilation-config '{"cudagraph_mode": "FULL"}': mixed batches up to 512 tokens replay
    # one CUDA graph, a step of decodes and a prefill chunk takes 1.9-3.4 ms (run 10's trace).
    "smollm2-full-graphs": dataclasses.replace(SMOLLM2, prefill_step_s=0.0005),
}

# An 8B Llama-style config with a 128K context; only the scheduler and KV sizing read it.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}
BLOCK_SIZE = 16
NUM_BLOCKS = 60_000

PARTIAL = dict(max_num_partial_prefills=4, max_long_partial_prefills=1,
               long_prefill_token_threshold=8192)
SRPF = dict(prefill_order="srpf", prefill_aging_s=30.0)
TARGET = dict(max_step_latency_ms=60.0)
CONFIGS: dict[str, dict] = {
    # The patched server of the H200 mixed load (docs/e2e-vllm.md, runs 8-9), for --workload serve.
    "e2e": dict(max_num_partial_prefills=4, max_long_partial_prefills=1, long_prefill_token_threshold=4096,
                prefill_order="srpf", max_step_latency_ms=4.1),
    "defaults": {},
    "srpf": SRPF,
    "partial": PARTIAL,
    "60ms": TARGET,
    "partial+srpf": PARTIAL | SRPF,
    "partial+srpf+60ms": PARTIAL | SRPF | TARGET,
}


@dataclasses.dataclass
class Arrival:
    name: str
    at_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str  # "background", "doc" or "chat"


def doc_workload(doc_tokens: int, num_chats: int, num_background: int) -> list[Arrival]:
    """Background chats decoding from 0 s; at 0.5 s the document and, right behind it, a burst of
    4 chats; the other chats every 0.5 s from 1 s."""
    arrivals = [Arrival(f"bg{i}", 0.0, 256, 100_000, "background") for i in range(num_background)]
    arrivals.append(Arrival("doc", 0.5, doc_tokens, 16, "doc"))
    burst = min(4, num_chats)
    arrivals += [Arrival(f"chat{i}", 0.5 + 1e-6 * (i + 1), 300, 32, "chat") for i in range(burst)]
    arrivals += [Arrival(f"chat{i}", 1.0 + 0.5 * (i - burst), 300, 32, "chat")
                 for i in range(burst, num_chats)]
    return arrivals


def serve_workload(doc_tokens: int, rate: float, seconds: float, seed: int = 3) -> list[Arrival]:
    """The H200 mixed load: chats of 200-800 prompt tokens (plus ~30 of chat template) and 48 output
    tokens arriving as a Poisson stream of `rate` per second for `seconds`; the document (if any) at 1 s."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < seconds:
        arrivals.append(Arrival(f"chat{len(arrivals)}", t, rng.randint(230, 830), 48, "chat"))
        t += rng.expovariate(rate)
    if doc_tokens:
        arrivals.append(Arrival("doc", 1.0, doc_tokens, 4, "doc"))
    return arrivals


def attention_pairs(computed: int, new: int) -> int:
    return new * computed + new * (new + 1) // 2


class SimClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class V1Engine:
    """vLLM 0.26.0's V1 `Scheduler`, fed requests and model outputs as the engine core does."""

    def __init__(self, max_num_batched_tokens: int, options: dict, clock: SimClock, model_dir: str):
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                   max_model_len=MODEL_CONFIG["max_position_embeddings"])
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=256,
            max_model_len=model_config.max_model_len, is_encoder_decoder=False,
            enable_chunked_prefill=True, async_scheduling=False, **options)
        cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
        cache_config.num_gpu_blocks = NUM_BLOCKS
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config)
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        register_all_kvcache_specs(vllm_config)
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BLOCK_SIZE, log_stats=False)
        # The patched scheduler's clocks (step timing, SRPF aging) run on simulated time.
        for part in ("prefill_planner", "waiting", "skipped_waiting"):
            if hasattr(getattr(self.scheduler, part, None), "clock"):
                getattr(self.scheduler, part).clock = clock

    def add(self, a: Arrival, arrival_time: float) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.scheduler.add_request(Request(
            request_id=a.name, prompt_token_ids=[7] * a.prompt_tokens,
            sampling_params=SamplingParams(max_tokens=a.output_tokens, ignore_eos=True),
            pooling_params=None, arrival_time=arrival_time))

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def decoding(self) -> set[str]:
        return {r.request_id for r in self.scheduler.running
                if not r.is_prefill_chunk and r.num_output_tokens > 0}

    def schedule(self) -> dict[str, tuple[int, int]]:
        """{request: (tokens this step, context before them)}."""
        self._output = self.scheduler.schedule()
        return {r: (n, self.scheduler.requests[r].num_computed_tokens - n)
                for r, n in self._output.num_scheduled_tokens.items()}

    def complete(self) -> list[str]:
        """Feed back the step's output; the requests that produced a token."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(self._output.num_scheduled_tokens)
        done = [not self.scheduler.requests[r].is_prefill_chunk for r in req_ids]
        self.scheduler.update_from_output(self._output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[1] if d else [] for d in done], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=[]))
        return [r for r, d in zip(req_ids, done) if d]


class V0Engine:
    """vLLM 0.6.3's V0 `Scheduler`, fed requests and sampled tokens as `LLMEngine.step` does."""

    def __init__(self, max_num_batched_tokens: int, options: dict, clock: SimClock, model_dir: str):
        from vllm.config import CacheConfig, SchedulerConfig
        from vllm.core.scheduler import Scheduler

        scheduler_config = SchedulerConfig(max_num_batched_tokens, 256,
                                           MODEL_CONFIG["max_position_embeddings"],
                                           enable_chunked_prefill=True, **options)
        cache_config = CacheConfig(BLOCK_SIZE, 1.0, 1, "auto")
        cache_config.num_gpu_blocks = NUM_BLOCKS
        cache_config.num_cpu_blocks = 1024
        self.scheduler = Scheduler(scheduler_config, cache_config, None)
        if hasattr(self.scheduler, "prefill_planner"):
            self.scheduler.prefill_planner.clock = clock
        try:  # SRPF aging in the patched tree reads this clock
            import vllm.core.srpf_order as srpf_order
            srpf_order.clock = clock
        except ImportError:
            pass
        self.groups = {}
        self._next_seq_id = 0

    def add(self, a: Arrival, arrival_time: float) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import Sequence, SequenceGroup

        self._next_seq_id += 1
        seq = Sequence(self._next_seq_id, inputs={"prompt": "", "prompt_token_ids": [7] * a.prompt_tokens},
                       block_size=BLOCK_SIZE)
        group = SequenceGroup(request_id=a.name, seqs=[seq], arrival_time=arrival_time,
                              sampling_params=SamplingParams(max_tokens=a.output_tokens, ignore_eos=True))
        self.groups[a.name] = group
        self.scheduler.add_seq_group(group)

    def has_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def decoding(self) -> set[str]:
        return {g.request_id for g in self.scheduler.running
                if not g.is_prefill() and g.seqs[0].get_output_len() > 0}

    def schedule(self) -> dict[str, tuple[int, int]]:
        metas, out, _ = self.scheduler.schedule()
        self._scheduled = [(s.seq_group, m.token_chunk_size) for s, m in zip(out.scheduled_seq_groups, metas)]
        return {g.request_id: (n, g.seqs[0].data.get_num_computed_tokens()) for g, n in self._scheduled}

    def complete(self) -> list[str]:
        from vllm.sequence import Logprob, SequenceStatus

        produced = []
        for group, n in self._scheduled:
            group.update_num_computed_tokens(n)
            if group.is_prefill():
                continue
            seq = group.seqs[0]
            seq.append_token_id(1, {1: Logprob(0.0)})
            produced.append(group.request_id)
            if seq.get_output_len() >= group.sampling_params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        self.scheduler.free_finished_seq_groups()
        return produced


ENGINES = {"v1": V1Engine, "v0": V0Engine}


def simulate(engine_cls, model_dir: str, max_num_batched_tokens: int, options: dict,
             arrivals: list[Arrival], max_steps: int, costs: Costs, jitter: float = 0.0) -> dict:
    """One run; with ``jitter`` each step's duration is the cost model's times a log-normal factor
    of that sigma (median 1, seeded, so every configuration meets the same sequence of factors)."""
    noise = random.Random(11)
    clock = SimClock()
    t0 = clock.now
    engine = engine_cls(max_num_batched_tokens, options, clock, model_dir)
    pending = sorted(arrivals, key=lambda a: a.at_s)
    kinds = {a.name: a for a in arrivals}
    chats = [a.name for a in arrivals if a.kind == "chat"]
    first_scheduled: dict[str, float] = {}
    first_token: dict[str, float] = {}
    decode_steps: list[float] = []
    stalls = 0
    for _ in range(max_steps):
        # Compared on the clock's own scale: after a jump to t0 + at_s, clock.now - t0 can round below at_s.
        while pending and t0 + pending[0].at_s <= clock.now:
            a = pending.pop(0)
            engine.add(a, t0 + a.at_s)
        if not engine.has_requests():
            clock.now = t0 + pending[0].at_s
            continue
        decoding = engine.decoding()
        chunks = engine.schedule()
        duration = costs.step(chunks, decoding) * (noise.lognormvariate(0.0, jitter) if jitter else 1.0)
        clock.now += max(duration, 1e-4)
        if decoding:
            decode_steps.append(duration)
            stalls += len(decoding - set(chunks))
        for r in chunks:
            first_scheduled.setdefault(r, clock.now - duration - t0 - kinds[r].at_s)
        for r in engine.complete():
            first_token.setdefault(r, clock.now - t0 - kinds[r].at_s)
        if ("doc" in first_token or "doc" not in kinds) and all(c in first_token for c in chats):
            break

    ttfs = [first_scheduled[c] for c in chats if c in first_scheduled]
    ttft = [first_token[c] for c in chats if c in first_token]
    decode_steps.sort()
    return {
        "chat_ttfs_mean_ms": 1e3 * statistics.fmean(ttfs) if ttfs else None,
        "chat_ttfs_max_ms": 1e3 * max(ttfs) if ttfs else None,
        "chat_ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else None,
        "chat_ttft_max_ms": 1e3 * max(ttft) if ttft else None,
        "chats_done": f"{len(ttft)}/{len(chats)}",
        "decode_step_p50_ms": 1e3 * decode_steps[len(decode_steps) // 2],
        "decode_step_p99_ms": 1e3 * decode_steps[int(0.99 * (len(decode_steps) - 1))],
        "decode_step_max_ms": 1e3 * decode_steps[-1],
        "decode_stalls": stalls,
        "doc_ttft_s": first_token.get("doc"),
        "simulated_s": clock.now - t0,
    }


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    return str(v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated names from {', '.join(CONFIGS)}, or all (default: all but e2e "
                        "for the doc workload, defaults,e2e for serve)")
    parser.add_argument("--workload", choices=["doc", "serve"], default="doc",
                        help="doc: background decodes, a document, chats every 0.5 s (the tables of "
                        "docs/scheduler.md); serve: the H200 mixed load of docs/e2e-vllm.md")
    parser.add_argument("--costs", choices=sorted(COSTS), default="8b", help="step cost model")
    parser.add_argument("--doc-tokens", type=int, default=128_000, help="0: no document")
    parser.add_argument("--chats", type=int, default=20, help="doc workload: chats")
    parser.add_argument("--background", type=int, default=16, help="doc workload: chats decoding throughout")
    parser.add_argument("--rate", type=float, default=4.0, help="serve workload: chats per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="serve workload: seconds of arrivals")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="log-normal sigma of a per-step factor on the modelled step time (0: none)")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="v1",
                        help="v1: vLLM 0.26.0's scheduler (vllm.v1.core.sched); v0: vLLM 0.6.3's (vllm.core)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    if args.configs is None:
        names = [n for n in CONFIGS if n != "e2e"] if args.workload == "doc" else ["defaults", "e2e"]
    else:
        names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    import vllm

    if args.engine == "v1":
        # Nothing runs on a device; on a machine without one vLLM 0.26's platform would be "unspecified".
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform

        vllm.platforms.current_platform = CpuPlatform()
    if args.workload == "doc":
        arrivals = doc_workload(args.doc_tokens, args.chats, args.background)
        described = (f"{args.background} chats decoding throughout; one {args.doc_tokens}-token document at "
                     f"0.5 s with a burst of 4 chats right behind it, then chats every 0.5 s ({args.chats} chats "
                     "of 300 tokens in all)")
    else:
        arrivals = serve_workload(args.doc_tokens, args.rate, args.seconds)
        described = (f"chats of 230-830 tokens (48 out) at {args.rate}/s for {args.seconds} s"
                     + (f"; one {args.doc_tokens}-token document at 1 s" if args.doc_tokens else ""))
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        for name in names:
            try:
                results[name] = simulate(ENGINES[args.engine], model_dir, args.max_num_batched_tokens,
                                         CONFIGS[name], arrivals, args.max_steps, COSTS[args.costs], args.jitter)
            except (TypeError, ValueError) as e:
                if "unexpected keyword" not in str(e) and "Unexpected keyword" not in str(e):
                    raise
                results[name] = None
                print(f"{name}: this vLLM ({vllm.__file__}) lacks an option of it: {e}",
                      file=sys.stderr)

    columns = ["chat_ttfs_mean_ms", "chat_ttfs_max_ms", "chat_ttft_mean_ms", "chat_ttft_max_ms",
               "chats_done", "decode_step_p50_ms", "decode_step_p99_ms", "decode_step_max_ms",
               "decode_stalls", "doc_ttft_s"]
    print(f"workload: {described}; costs {args.costs}" + (f" x log-normal jitter {args.jitter}" if args.jitter else "")
          + f"; max_num_batched_tokens={args.max_num_batched_tokens}; "
          f"{args.engine} scheduler of vllm {vllm.__version__} from {vllm.__file__}\n")
    print("| config | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, r in results.items():
        cells = [fmt(r[c]) for c in columns] if r else ["n/a"] * len(columns)
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
