"""One offline engine (vLLM's ``LLM`` or SGLang's ``Engine``) serving commands from the end-to-end driver,
one JSON object per line.

The driver starts one worker per engine under the Python path of the side it measures (upstream or
patched), writes commands to the worker's stdin and reads one JSON reply per command from the file
descriptor given by ``--reply-fd``, so the engine's own output (stdout, stderr) can go to a log.
``--api vllm`` (default) passes ``--engine`` to ``vllm.LLM``, ``--api sglang`` to ``sglang.Engine``.

Commands:
  {"op": "generate", "prompts": [[ids], ...], "max_tokens": n, "logprobs": k}
      -> {"tokens": [[ids], ...], "top": [[[[id, logprob], ...] per token] per prompt] (k > 0), "seconds": s}
      All prompts are submitted at once (one batch as the scheduler sees it), greedy.
  {"op": "ttft", "prompt": [ids]} -> {"seconds": s}   one request, one output token: the time to first token.
  {"op": "prompt_logprobs", "prompts": [[ids], ...], "k": k}
      -> {"top": [[None | [[id, logprob], ...] per position] per prompt]}   the model's top-k at every
      prompt position given the tokens before it (teacher forcing).
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def top_logprobs(position) -> list[list[float]]:
    """[[token id, logprob], ...] of one output position, best first, whatever container vLLM returns."""
    items = [(int(token), float(getattr(lp, "logprob", lp))) for token, lp in dict(position).items()]
    return sorted(items, key=lambda item: -item[1])


def sglang_top(position) -> list[list[float]] | None:
    """The same from SGLang's ``(logprob, token id, text)`` triples of one position (None: no entry)."""
    if not position:
        return None
    return sorted(((int(token), float(lp)) for lp, token, *_ in position), key=lambda item: -item[1])


class VllmEngine:
    def __init__(self, kwargs: dict):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.params, self.prompt = SamplingParams, TokensPrompt
        self.llm = LLM(**kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int, k: int) -> tuple[list, list | None]:
        params = self.params(temperature=0.0, max_tokens=max_tokens, logprobs=k or None)
        outputs = self.llm.generate([self.prompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        tops = [[top_logprobs(p) for p in o.outputs[0].logprobs] for o in outputs] if k else None
        return tokens, tops

    def prompt_top(self, prompts: list[list[int]], k: int) -> list:
        params = self.params(temperature=0.0, max_tokens=1, prompt_logprobs=k)
        outputs = self.llm.generate([self.prompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        return [[None if p is None else top_logprobs(p) for p in o.prompt_logprobs] for o in outputs]


class SglangEngine:
    def __init__(self, kwargs: dict):
        import sglang

        self.engine = sglang.Engine(**kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int, k: int) -> tuple[list, list | None]:
        outputs = self.engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_tokens},
                                       return_logprob=bool(k), top_logprobs_num=k or None)  # fmt: skip
        tokens = [list(o["output_ids"]) for o in outputs]
        tops = [[sglang_top(p) for p in o["meta_info"]["output_top_logprobs"]] for o in outputs] if k else None
        return tokens, tops

    def prompt_top(self, prompts: list[list[int]], k: int) -> list:
        outputs = self.engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 1},
                                       return_logprob=True, logprob_start_len=0, top_logprobs_num=k)  # fmt: skip
        return [[sglang_top(p) for p in o["meta_info"]["input_top_logprobs"]] for o in outputs]


ENGINES = {"vllm": VllmEngine, "sglang": SglangEngine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="JSON object of the engine's keyword arguments")
    parser.add_argument("--api", choices=sorted(ENGINES), default="vllm")
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()

    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    started = time.perf_counter()
    engine = ENGINES[args.api](json.loads(args.engine))
    reply.write(json.dumps({"ready": True, "startup_seconds": time.perf_counter() - started}) + "\n")

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "exit":
            break
        if op == "generate":
            t0 = time.perf_counter()
            tokens, tops = engine.generate(command["prompts"], command["max_tokens"], command.get("logprobs") or 0)
            result = {"tokens": tokens, "seconds": time.perf_counter() - t0}
            if tops is not None:
                result["top"] = tops
        elif op == "ttft":
            t0 = time.perf_counter()
            engine.generate([command["prompt"]], 1, 0)
            result = {"seconds": time.perf_counter() - t0}
        elif op == "prompt_logprobs":
            result = {"top": engine.prompt_top(command["prompts"], command["k"])}
        else:
            result = {"error": f"unknown op {op!r}"}
        reply.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
