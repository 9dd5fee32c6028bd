"""The images built for real (-m image): per target, the stand-in base and then docker/Dockerfile.<engine>
FROM it, with buildah, and each image run as a user runs it.

Too heavy for CI (minutes and gigabytes per target; docs/deployment.md has the measured figures):
run as root where buildah and debootstrap are installed,
    python -m pytest -m image tests/tooling/test_images.py
The images live in a containers-storage of the test's own under pytest's temporary directory (storage
driver $STORAGE_DRIVER, default vfs, which works wherever buildah does), removed after each target.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefill_accel.engine.startup import KERNELS_NEED_TRITON
from prefill_accel.flags import SUFFIXES, flag
from prefill_accel.tooling import standin

from listening import listening_sockets

from .conftest import ROOT, TARGET_NAMES
from .dockerfile import resolve

pytestmark = pytest.mark.image

# How each engine's entrypoint lists every flag: vLLM 0.26's plain --help shows only the groups.
HELP_ARGS = {
    "vllm-0.26.0": ["--help=all"],
    "vllm-0.6.3.post1": ["--help"],
    "sglang-0.5.16": ["python3", "-m", "sglang.launch_server", "--help"],
}
# The scheduler flags each series adds or makes effective (docs/scheduler.md, docs/sglang-0.5.md).
SCHEDULER_FLAGS = {
    "vllm-0.26.0": ["--max-num-partial-prefills", "--max-long-partial-prefills", "--long-prefill-token-threshold",
                    "--prefill-order", "--prefill-aging-s", "--max-step-latency-ms"],
    "vllm-0.6.3.post1": ["--max-num-partial-prefills", "--max-long-partial-prefills",
                         "--long-prefill-token-threshold", "--prefill-order", "--prefill-aging-s",
                         "--max-step-latency-ms"],
    "sglang-0.5.16": ["--max-consecutive-prefill-batches", "--schedule-policy", "--max-step-latency-ms"],
}
# On the stand-in, what takes the place of the GPU the documented run line expects: the engine's own CPU
# device flag (vLLM 0.26.0 needs none: the stand-in's platform plugin resolves its CPU platform).
STAND_IN_ARGS = {"vllm-0.6.3.post1": ["--device", "cpu"], "sglang-0.5.16": ["--device", "cpu"]}
# A model directory holding only a config.json (Qwen1.5-7B's architecture, a 128K context so that every
# target's documented --max-model-len is accepted): the engines read it before they need weights.
MODEL_CONFIG = ROOT / "ci" / "upstream-tests" / "hf-configs" / "Qwen" / "Qwen1.5-7B" / "config.json"
STARTUP_TIMEOUT_S = 600
KERNELS_CHECK = """
import prefill_accel
from prefill_accel.engine.startup import KERNELS_NEED_TRITON
try:
    import triton
    found = f"triton {triton.__version__}"
except ImportError:
    found = "no triton"
try:
    import prefill_accel.ops.attention, prefill_accel.ops.search, prefill_accel.ops.staging
    state = "met"
except ImportError as error:
    state = f"not met ({error})"
print(f"prefill-accel {prefill_accel.__version__}: kernels need triton >= {KERNELS_NEED_TRITON}, {found}: {state}")
"""


@dataclass
class Built:
    name: str
    image: str
    base: str
    model: Path


def buildah(*args: str, check: bool = True, timeout: float | None = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"buildah {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def image_config(image: str) -> dict:
    return json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]


@contextmanager
def container(image: str):
    name = buildah("from", "--pull-never", image).stdout.strip().splitlines()[-1]
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


def run_command(ctr: str, argv: list[str], model: Path | None = None, env: tuple[str, ...] = ()) -> list[str]:
    """`buildah run` of argv in the container: its image's environment plus `env` (NAME=VALUE), offline."""
    options = ["-v", f"{model}:/model:ro"] if model else []
    for assignment in ("HF_HUB_OFFLINE=1", *env):
        options += ["-e", assignment]
    return ["buildah", "run", "--isolation", "chroot", *options, ctr, "--", *argv]


def documented_run(target) -> tuple[list[str], list[str]]:
    """The arguments after the image in the target's run_example (MODEL -> /model) and its -e NAME=VALUE."""
    before, after = target.run_example.split("{image}", 1)
    options = shlex.split(before)
    env = [options[i + 1] for i, option in enumerate(options) if option == "-e" and "=" in options[i + 1]]
    return shlex.split(after.replace("MODEL", "/model")), env


def image_size(image: str) -> str:
    """The size `buildah images` reports (the image's layers, uncompressed)."""
    return json.loads(buildah("images", "--json", image).stdout)[0]["size"]


def step_times(progress: str) -> list[str]:
    """'STEP: N s' for each `==> STEP` ... `done (N s)` pair of a prefill-accel progress output."""
    open_steps, times = [], []
    for line in progress.splitlines():
        if line.startswith("==> "):
            open_steps.append(line[4:])
        elif (done := re.match(r"^    done \((\S+) s\)$", line)) and open_steps:
            times.append(f"{open_steps.pop()}: {done[1]} s")
    return times


@pytest.fixture(scope="module", params=TARGET_NAMES)
def built(request, targets, tmp_path_factory) -> Built:
    """scripts/build.sh TARGET --builder buildah --stand-in-base in a storage of its own; the time and the
    sizes are reported on the terminal."""
    assert shutil.which("buildah") and shutil.which("debootstrap"), \
        "the image test needs buildah and debootstrap (apt-get install buildah debootstrap) and root"
    target = targets.resolve(request.param)
    work = tmp_path_factory.mktemp(f"image-{target.name}")
    store = work / "store"
    conf = work / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "{os.environ.get("STORAGE_DRIVER", "vfs")}"\n'
                    f'graphroot = "{store / "graph"}"\nrunroot = "{store / "run"}"\n')
    previous = os.environ.get("CONTAINERS_STORAGE_CONF")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(conf)
    model = work / "model"
    model.mkdir()
    config = json.loads(MODEL_CONFIG.read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    try:
        start = time.monotonic()
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "build.sh"), target.name, "--builder", "buildah",
                               "--stand-in-base"], capture_output=True, text=True)
        seconds = time.monotonic() - start
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        result = Built(target.name, standin.image_tag(target), standin.stand_in_tag(target), model)
        du = subprocess.run(["du", "-sb", str(store / "graph")], capture_output=True, text=True).stdout.split()[0]
        lines = [f"[image] {target.name}: build.sh --stand-in-base took {seconds:.0f} s; {result.base} "
                 f"{image_size(result.base)}, {result.image} {image_size(result.image)}; storage "
                 f"({os.environ.get('STORAGE_DRIVER', 'vfs')}) {int(du) / 1e9:.2f} GB",
                 *(f"[image]   {step}" for step in step_times(proc.stderr))]
        plugins = request.config.pluginmanager
        with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
            for line in lines:
                plugins.get_plugin("terminalreporter").write_line(line)
        yield result
    finally:
        buildah("rm", "--all", check=False)
        buildah("rmi", "--all", "--force", check=False)
        shutil.rmtree(store, ignore_errors=True)
        if previous is None:
            os.environ.pop("CONTAINERS_STORAGE_CONF", None)
        else:
            os.environ["CONTAINERS_STORAGE_CONF"] = previous


def test_image_keeps_the_base_entrypoint_and_working_directory(built):
    """An image FROM the stand-in keeps its ENTRYPOINT, CMD and WORKDIR, which are upstream's (the stand-in's
    stage says so and test_docker checks the vLLM stages against upstream's Dockerfiles)."""
    base, image = image_config(built.base), image_config(built.image)
    entrypoint, workdir = resolve(standin.dockerfile(ROOT).read_text(), built.name)
    assert (base.get("Entrypoint"), base.get("WorkingDir")) == (entrypoint, workdir)
    assert (image.get("Entrypoint"), image.get("Cmd"), image.get("WorkingDir")) == \
        (base.get("Entrypoint"), base.get("Cmd"), base.get("WorkingDir"))
    with container(built.image) as ctr:
        proc = subprocess.run(run_command(ctr, ["pwd"]), capture_output=True, text=True)
    assert proc.stdout.strip() == workdir


def test_entrypoint_help_shows_the_sparse_prefill_and_scheduler_flags(built):
    with container(built.image) as ctr:
        entrypoint = image_config(built.image)["Entrypoint"]
        proc = subprocess.run(run_command(ctr, [*entrypoint, *HELP_ARGS[built.name]]), capture_output=True,
                              text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    shown = set(re.findall(r"--[a-z][a-z0-9-]*", proc.stdout))
    expected = [flag(suffix) for suffix in SUFFIXES] + SCHEDULER_FLAGS[built.name]
    assert [f for f in expected if f not in shown] == []


def test_runtime_imports_and_reports_the_kernels_triton_requirement(built, targets):
    """Met where the target's CPU dependency set pins a Triton the kernels run with (vLLM 0.6.3's pins
    3.0, the one torch 2.4 brings), not met elsewhere."""
    requirements = (ROOT / targets.resolve(built.name).venv_requirements).read_text()
    pinned = re.search(r"^triton==(\d+)\.(\d+)", requirements, re.MULTILINE)
    with container(built.image) as ctr:
        proc = subprocess.run(run_command(ctr, ["python3", "-c", KERNELS_CHECK]), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"prefill-accel 0.1.0: kernels need triton >= {KERNELS_NEED_TRITON}")
    need = tuple(int(part) for part in KERNELS_NEED_TRITON.split("."))
    assert line.endswith(": met") == (pinned is not None and (int(pinned[1]), int(pinned[2])) >= need), line


def test_engine_starts_far_enough_to_log_the_series_banner_on_loopback_only(built, targets):
    """The documented run line (run_example in patches/targets.toml, MODEL a config-only model directory,
    STAND_IN_ARGS for the GPU) started in the image: the engine logs the banner naming the series; every
    TCP socket its processes listen on meanwhile is a loopback one; and when the banner appears, its API
    port is taken on loopback (vLLM binds it before it starts the engine) but free on this machine's own
    address. buildah's chroot isolation shares this machine's network, as `docker run --network host` does.
    Upstream vLLM 0.6.3.post1 bound its API port on every interface whatever --host said, and SGLang's
    torch.distributed store listened on every interface; the series binds both to loopback (vLLM 0.6.3
    patch 0007, SGLang patch 0006)."""
    target = targets.resolve(built.name)
    args, env = documented_run(target)
    args += STAND_IN_ARGS.get(target.name, [])
    port = int(args[args.index("--port") + 1])
    external = own_address()
    with container(built.image) as ctr:
        series_hash, patches = built_series(ctr, built.image, target)
        banner = f"patch series {series_hash} applied ({target.name}, {patches} patch(es))"
        entrypoint = image_config(built.image)["Entrypoint"]
        output, listening, taken = run_until(run_command(ctr, [*entrypoint, *args], built.model, tuple(env)), banner,
                                             lambda: {a: port_taken(a, port) for a in ("127.0.0.1", external)})
    assert banner in output, output[-6000:]
    public = sorted(address for address in listening if not _is_loopback(address[0]))
    assert public == [], f"listening beyond loopback: {public} (all: {sorted(listening)})"
    if target.engine == "vllm":
        assert taken["127.0.0.1"], f"port {port} is not held on loopback when the engine starts"
    assert not taken[external], f"port {port} is taken on {external}, beyond loopback"


def built_series(ctr: str, image: str, target) -> tuple[str, int]:
    """The series hash (the image's label) and patch count (its copy of the checkout) the image was built
    with: the checkout may have moved on while it built."""
    series = target.patch_dir(Path("/opt/prefill-accel")) / "series"
    proc = subprocess.run(run_command(ctr, ["cat", str(series)]), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return image_config(image)["Labels"]["io.prefill-accel.series-hash"], len(proc.stdout.split())


def run_until(cmd: list[str], banner: str, at_banner):
    """Run cmd until it exits, or until 10 s after `banner` appears in its output, calling at_banner() once
    when it does; returns the output, every (address, port) its processes listened on meanwhile (TCP) and
    what at_banner returned (None when the banner never came)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    listening: set[tuple[str, int]] = set()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen_at, at_banner_result = None, None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            listening |= listening_sockets(process_tree(proc.pid))
            if seen_at is None and any(banner in line for line in lines):
                seen_at, at_banner_result = time.monotonic(), at_banner()
            if seen_at is not None and time.monotonic() > seen_at + 10:
                break
            time.sleep(0.2)
    finally:
        for pid in process_tree(proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
        reader.join(timeout=60)
    return "".join(lines), listening, at_banner_result


def own_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    assert not ipaddress.ip_address(address).is_loopback, "the test needs an address beyond loopback"
    return address


def port_taken(address: str, port: int) -> bool:
    """Whether binding address:port fails because a socket holds it (bound or listening, on that address or
    on every address). Without SO_REUSEADDR, so a holder that set it still conflicts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def process_tree(root_pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)
