"""Serving tools: `prefill-accel bench` (TTFT against OpenAI-compatible servers) and `prefill-accel batch`
(long documents through a server), with the streaming client they share.

Standard library only, except the plots of `bench` (matplotlib) and its optional `--tokenizer`
(transformers), which are imported when used: `pip install 'prefill-accel[serving]'`.
"""
