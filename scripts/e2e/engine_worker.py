"""One vLLM engine (offline ``LLM``) serving commands from the end-to-end driver, one JSON object per line.

The driver starts one worker per engine under the Python path of the side it measures (upstream or
patched vLLM), writes commands to the worker's stdin and reads one JSON reply per command from the
file descriptor given by ``--reply-fd``, so vLLM's own output (stdout, stderr) can go to a log.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="JSON object of vllm.LLM keyword arguments")
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    started = time.perf_counter()
    llm = LLM(**json.loads(args.engine))
    reply.write(json.dumps({"ready": True, "startup_seconds": time.perf_counter() - started}) + "\n")

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "exit":
            break
        if op == "generate":
            params = SamplingParams(
                temperature=0.0, max_tokens=command["max_tokens"], logprobs=command.get("logprobs") or None
            )
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds}
            if command.get("logprobs"):
                result["top"] = [[top_logprobs(p) for p in o.outputs[0].logprobs] for o in outputs]
        elif op == "ttft":
            params = SamplingParams(temperature=0.0, max_tokens=1)
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=command["prompt"])], params, use_tqdm=False)
            result = {"seconds": time.perf_counter() - t0}
        elif op == "prompt_logprobs":
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=command["k"])
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result = {"top": [[None if p is None else top_logprobs(p) for p in o.prompt_logprobs] for o in outputs]}
        else:
            result = {"error": f"unknown op {op!r}"}
        reply.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
