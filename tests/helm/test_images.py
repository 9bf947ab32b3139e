"""The two images the chart runs, checked from their Dockerfiles and lock files.

No Docker engine runs the tests, so the images are not built here; what can be known from
the sources is checked: a non-root final user, a base pinned by digest, no CUDA in the
control plane, every pip install in hash-checking mode against locks that cover the
package's runtime dependencies at versions it accepts, and a small build context.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from services.settings import ENV_PREFIX, Settings
from tests.helm.chart import REPO_ROOT, render_ci

DOCKER_DIR = REPO_ROOT / "docker"
CONTROL_PLANE = DOCKER_DIR / "Dockerfile"
JOB = DOCKER_DIR / "Dockerfile.job"
GPU_PREFIXES = ("nvidia-", "cuda-", "triton")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def parse_dockerfile(path: Path) -> list[list[Instruction]]:
    """Instructions grouped by build stage (the first group holds ARGs before any FROM)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    stages: list[list[Instruction]] = [[]]
    for line in logical:
        keyword, _, arguments = line.partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(arguments.split()))
        if instruction.keyword == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    hashes: tuple[str, ...]


def parse_lock(path: Path) -> dict[str, Pin]:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    pins: dict[str, Pin] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, *options = line.split()
        name, _, version = spec.partition("==")
        assert version, f"{path.name}: {spec} is not pinned with =="
        hashes = tuple(opt.removeprefix("--hash=") for opt in options)
        assert all(opt.startswith("--hash=sha256:") for opt in options), line
        assert hashes, f"{path.name}: {spec} has no hash"
        pins[canonicalize_name(name)] = Pin(name, version, hashes)
    return pins


def runtime_requirements() -> list[Requirement]:
    """The package's dependencies and its ``hf`` extra's: the job image trains and the
    control-plane image serves hf checkpoints."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    texts = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["hf"],
    ]
    return [Requirement(text) for text in texts]


def final_stage(path: Path) -> list[Instruction]:
    return parse_dockerfile(path)[-1]


def arguments_of(stage: list[Instruction], keyword: str) -> list[str]:
    return [i.arguments for i in stage if i.keyword == keyword]


@pytest.mark.parametrize("dockerfile", [CONTROL_PLANE, JOB], ids=lambda p: p.name)
def test_final_image_runs_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    users = arguments_of(final_stage(dockerfile), "USER")
    assert users, f"{dockerfile.name}: the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert gid.isdigit() and int(gid) != 0, users[-1]
    # The chart's pod security context runs as this same user.
    pod = render_ci("minimal-values.yaml").named("Deployment", "api")["spec"]["template"]["spec"]
    assert int(uid) == pod["securityContext"]["runAsUser"]
    assert int(gid) == pod["securityContext"]["runAsGroup"]


@pytest.mark.parametrize("dockerfile", [CONTROL_PLANE, JOB], ids=lambda p: p.name)
def test_base_image_is_pinned_by_digest(dockerfile: Path) -> None:
    stages = parse_dockerfile(dockerfile)
    args = dict(arg.partition("=")[::2] for arg in arguments_of(stages[0], "ARG"))
    for stage in stages[1:]:
        image = stage[0].arguments.split()[0]
        resolved = args.get(image.strip("${}"), image)
        assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", resolved), resolved


@pytest.mark.parametrize("dockerfile", [CONTROL_PLANE, JOB], ids=lambda p: p.name)
def test_every_pip_install_is_hash_checked_or_offline(dockerfile: Path) -> None:
    installs = [
        cmd
        for stage in parse_dockerfile(dockerfile)
        for run in arguments_of(stage, "RUN")
        for cmd in run.split("&&")
        if "pip install" in cmd
    ]
    assert installs
    for cmd in installs:
        assert "--no-deps" in cmd, cmd
        assert "--require-hashes" in cmd or "--no-index" in cmd, cmd
    runs = [run for stage in parse_dockerfile(dockerfile) for run in arguments_of(stage, "RUN")]
    assert any("pip check" in run for run in runs), "the installed set is never checked"


def test_control_plane_has_no_cuda() -> None:
    text = CONTROL_PLANE.read_text()
    stages = parse_dockerfile(CONTROL_PLANE)
    for stage in stages[1:]:
        assert not re.search(r"cuda|nvidia", stage[0].arguments, re.IGNORECASE)
    assert "torch-cpu.lock" in text
    assert "torch-cuda.lock" not in text
    for pin in parse_lock(DOCKER_DIR / "requirements.lock").values():
        assert not canonicalize_name(pin.name).startswith(GPU_PREFIXES), pin.name
    (torch,) = parse_lock(DOCKER_DIR / "torch-cpu.lock").values()
    assert Version(torch.version).local == "cpu"


def test_job_image_has_cuda_torch() -> None:
    assert "torch-cuda.lock" in JOB.read_text()
    cuda = parse_lock(DOCKER_DIR / "torch-cuda.lock")
    assert Version(cuda["torch"].version).local is None
    assert any(name.startswith("nvidia-") for name in cuda)


def _extra_requirements(distribution: str, extra: str) -> set[str]:
    """Names of what an extra pulls in on Linux (psycopg[binary] is a package of its own;
    uvicorn[standard] is a list of packages)."""
    from importlib.metadata import requires

    names = set()
    for line in requires(distribution) or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or not marker.evaluate({"extra": extra, "sys_platform": "linux"}):
            continue
        if marker.evaluate({"extra": "", "sys_platform": "linux"}):
            continue  # a base dependency, not the extra's
        names.add(canonicalize_name(requirement.name))
    return names


def test_locks_cover_the_runtime_dependencies_at_accepted_versions() -> None:
    common = parse_lock(DOCKER_DIR / "requirements.lock")
    torch_builds = [
        parse_lock(DOCKER_DIR / "torch-cpu.lock")["torch"],
        parse_lock(DOCKER_DIR / "torch-cuda.lock")["torch"],
    ]
    for requirement in runtime_requirements():
        name = canonicalize_name(requirement.name)
        pins = torch_builds if name == "torch" else [common.get(name)]
        for pin in pins:
            assert pin is not None, f"{requirement} is missing from docker/requirements.lock"
            assert requirement.specifier.contains(pin.version, prereleases=True), (
                f"lock has {pin.name}=={pin.version}, pyproject.toml asks for {requirement}"
            )
        for extra in requirement.extras:
            missing = _extra_requirements(requirement.name, extra) - set(common)
            if f"{name}-{extra}" not in common:
                assert not missing, f"{requirement}: extra {extra} not locked: {sorted(missing)}"
    # The package is built without build isolation: its build backend must be locked.
    assert {"setuptools", "wheel"} <= set(common)
    shared = set(parse_lock(DOCKER_DIR / "torch-cuda.lock")) & set(common)
    assert shared == set(), f"locked twice: {shared}"


@pytest.mark.parametrize("dockerfile", [CONTROL_PLANE, JOB], ids=lambda p: p.name)
def test_copied_sources_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for stage in parse_dockerfile(dockerfile):
        for copy in arguments_of(stage, "COPY"):
            if copy.startswith("--from="):
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
                assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


def test_build_context_leaves_out_the_virtualenv_and_history() -> None:
    lines = [
        line
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*", "the context is an allow-list"
    assert not any(line.startswith("!") and (".venv" in line or ".git" in line) for line in lines)


def test_images_start_the_processes_the_chart_runs() -> None:
    control = final_stage(CONTROL_PLANE)
    assert arguments_of(control, "ENTRYPOINT") == ['["ratchet"]']
    exposed = {int(port) for ports in arguments_of(control, "EXPOSE") for port in ports.split()}
    defaults = Settings.model_fields
    assert exposed == {
        defaults["api_port"].default,
        defaults["worker_port"].default,
        defaults["gateway_port"].default,
    }
    rendered = render_ci("minimal-values.yaml")
    for component in ("api", "worker"):
        container = rendered.named("Deployment", component)["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert "command" not in container, "the chart relies on the image's ENTRYPOINT"
    # The job template's default command is the job image's own `ratchet job`.
    job_template = rendered.get("ConfigMap", "rel-ratchet-job-template")["data"][
        "job-template.yaml"
    ]
    assert "command:\n- ratchet\n- job\n" in job_template
    assert arguments_of(final_stage(JOB), "ENTRYPOINT") == ['["ratchet"]']


@pytest.mark.parametrize("dockerfile", [CONTROL_PLANE, JOB], ids=lambda p: p.name)
def test_ratchet_variables_baked_into_images_are_settings_fields(dockerfile: Path) -> None:
    names = set(re.findall(r"\b(RATCHET_[A-Z0-9_]+)=", dockerfile.read_text()))
    fields = set(Settings.model_fields)
    assert {n for n in names if n.removeprefix(ENV_PREFIX).lower() not in fields} == set()
