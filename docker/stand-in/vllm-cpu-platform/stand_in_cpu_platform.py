"""The stand-in base's vLLM platform plugin: the CPU platform, so that a CUDA build of vLLM parses its flags
and starts on a machine without a GPU."""


def cpu_platform() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
