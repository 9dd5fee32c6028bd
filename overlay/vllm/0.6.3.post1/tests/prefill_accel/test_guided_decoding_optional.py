"""prefill-accel: an OpenAI-server request that asks for no guide carries no guided decoding (patch 0008).

Upstream built guided-decoding params for every completion and chat request, so each one built a processor
and imported the default backend (outlines) first: where outlines cannot be imported, every request failed
after its 200 header. A backend that cannot be imported is stood in for by sys.modules["outlines"] = None.
"""

import asyncio
import sys

import pytest

from vllm.engine.async_llm_engine import build_guided_decoding_logits_processor_async
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

BACKEND_MODULE = "vllm.model_executor.guided_decoding.outlines_decoding"


def completion(**fields):
    return CompletionRequest(model="m", prompt="def f(x):", max_tokens=3, stream=True, **fields).to_sampling_params(16)


def chat(**fields):
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest(model="m", messages=messages, max_tokens=3, **fields).to_sampling_params(16)


def built(params):
    return asyncio.run(build_guided_decoding_logits_processor_async(params, None, default_guided_backend="outlines"))


@pytest.fixture
def no_outlines(monkeypatch):
    monkeypatch.setitem(sys.modules, "outlines", None)
    monkeypatch.delitem(sys.modules, BACKEND_MODULE, raising=False)


def test_plain_completion_and_chat_requests_carry_no_guided_decoding():
    assert completion().guided_decoding is None
    assert chat().guided_decoding is None


def test_a_plain_request_imports_no_guided_decoding_backend(no_outlines):
    params = built(completion())
    assert params.guided_decoding is None and not params.logits_processors
    assert BACKEND_MODULE not in sys.modules


def test_guided_requests_keep_their_guide():
    regex = completion(guided_regex="[0-9]+", guided_decoding_backend="lm-format-enforcer").guided_decoding
    assert (regex.regex, regex.backend) == ("[0-9]+", "lm-format-enforcer")
    assert completion(guided_choice=["yes", "no"]).guided_decoding.choice == ["yes", "no"]
    assert chat(response_format={"type": "json_object"}).guided_decoding.json_object is True


def test_a_guided_request_still_goes_to_its_backend(no_outlines):
    with pytest.raises(ImportError):
        built(completion(guided_regex="[0-9]+"))
