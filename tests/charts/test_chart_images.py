"""The Dockerfiles behind the chart's default images agree with the chart and the operator.

No container engine runs here, so the images cannot be built; what can be checked is checked:
the files each Dockerfile copies exist and survive its .dockerignore, the core and the image's part
build from exactly those files into wheels that hold every module the image runs, no other part is
installed, and users, ports and entrypoints match what the chart and the operator expect.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from slotserve.operator.builders import ENGINE_PORT, RUN_AS_USER
from tests.charts.chart_support import CHART, ROOT, load_yaml

DOCKER = ROOT / "docker"
# image -> (part folder installed beside the core, uid the pods run as, port the container serves)
IMAGES = {
    "engine": ("engine", RUN_AS_USER, ENGINE_PORT),
    "gateway": ("gateway", None, None),
    "operator": ("operator", None, None),
}


def dockerfile(image: str) -> str:
    return (DOCKER / f"{image}.Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copy_sources(image: str) -> list[str]:
    sources = []
    for word, args in instructions(dockerfile(image)):
        if word == "COPY":
            *srcs, _dest = args.split()
            sources += [s.rstrip("/") for s in srcs if not s.startswith("--")]
    return sources


def test_chart_defaults_point_at_these_images():
    values = load_yaml(CHART / "values.yaml")
    repos = {
        "engine": values["engine"]["image"]["repository"],
        "gateway": values["gateway"]["image"]["repository"],
        "operator": values["operator"]["image"]["repository"],
    }
    app_version = load_yaml(CHART / "Chart.yaml")["appVersion"]
    for image, repo in repos.items():
        assert repo == f"ghcr.io/slotserve/{image}"
        # The build command in the Dockerfile's header produces exactly that tag.
        assert f"-t {repo}:{app_version} ." in dockerfile(image)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_runs_slotserve_as_a_numeric_non_root_user(image):
    steps = instructions(dockerfile(image))
    (user,) = [args for word, args in steps if word == "USER"]
    uid = int(user.split(":")[0])
    assert uid > 0
    expected_uid = (
        IMAGES[image][1] or load_yaml(CHART / "values.yaml")["podSecurityContext"]["runAsUser"]
    )
    assert uid == expected_uid
    assert [args for word, args in steps if word == "ENTRYPOINT"] == ['["slotserve"]']
    assert steps[-1][0] in {"CMD", "ENTRYPOINT"}
    # The process must not be root after the last USER line.
    last_user = max(i for i, (word, _) in enumerate(steps) if word == "USER")
    assert not any(word == "RUN" for word, _ in steps[last_user:])


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_the_core_and_only_its_own_part(image):
    part = IMAGES[image][0]
    runs = " ".join(args for word, args in instructions(dockerfile(image)) if word == "RUN")
    installs = re.findall(r"pip install -c \S+ ([^&]*?) *(?:\\|&&|$)", runs)
    assert [i.split() for i in installs] == [[".", f"./{part}"]]
    assert sorted(copy_sources(image)) == sorted(
        ["pyproject.toml", "constraints.txt", "README.md", "slotserve", part]
    )
    dependencies = part_project(part)["dependencies"]
    if image == "engine":
        assert "torch==2.13.0" in dependencies
        assert re.search(r"ARG TORCH_VERSION=2\.13\.0\b", dockerfile(image))
        port = IMAGES[image][2]
        assert f"EXPOSE {port}" in dockerfile(image)
    else:
        assert not any(d.startswith("torch") for d in dependencies)


def part_project(part: str) -> dict:
    return tomllib.loads((ROOT / part / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copied_files_exist_and_pass_the_dockerignore(image):
    ignore = (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
    for source in copy_sources(image):
        assert (ROOT / source).exists(), f"{image}.Dockerfile copies missing {source}"
        allowed = {f"!{source}", f"!{source}/**"}
        assert allowed & set(ignore), f"{source} is excluded from the {image} build context"


def build_wheel(source: Path, out: Path) -> Path:
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip_wheel, "-q", "--no-index", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob(f"{'slotserve' if source.name == 'context' else 'slotserve_*'}-*.whl")
    return wheel


@pytest.fixture(scope="module", params=sorted(IMAGES))
def image_wheels(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(image, core wheel, part wheel), built the way the image's `pip install . ./part` does:
    from the copied files only."""
    image = request.param
    context = tmp_path_factory.mktemp(f"{image}-image") / "context"
    context.mkdir()
    for source in copy_sources(image):
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(
                src, context / source, ignore=shutil.ignore_patterns("__pycache__", "build")
            )
        else:
            shutil.copy2(src, context / source)
    core = build_wheel(context, context.parent / "core")
    part = build_wheel(context / IMAGES[image][0], context.parent / "part")
    return image, core, part


def test_core_wheel_holds_the_dispatcher_and_no_part(image_wheels):
    _, core, _ = image_wheels
    with zipfile.ZipFile(core) as wheel:
        names = set(wheel.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = wheel.read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert "slotserve/cli.py" in names
    assert "slotserve/__init__.py" not in names  # a namespace: each part adds to it
    for part in ("engine", "gateway", "operator"):
        assert not any(n.startswith(f"slotserve/{part}/") for n in names), part
    assert "slotserve = slotserve.cli:main" in entry_points


# What each image runs: the `slotserve` dispatcher and its part's CLI (plus, in the engine image,
# `slotserve model pull`, which bakes the demo model in at build time).
IMAGE_ENTRY_MODULES = {
    "engine": ["slotserve.cli", "slotserve.engine.cli", "slotserve.models.cli"],
    "gateway": ["slotserve.cli", "slotserve.gateway.cli"],
    "operator": ["slotserve.cli", "slotserve.operator.cli"],
}
PART_DIRS = {
    "slotserve": ROOT / "slotserve",
    "slotserve.engine": ROOT / "engine" / "slotserve" / "engine",
    "slotserve.gateway": ROOT / "gateway" / "slotserve" / "gateway",
    "slotserve.operator": ROOT / "operator" / "slotserve" / "operator",
}


def module_file(name: str) -> Path | None:
    for prefix in sorted(PART_DIRS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix) :].lstrip(".").split(".") if name != prefix else []
            base = PART_DIRS[prefix].joinpath(*rest)
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def third_party_imports(entry_modules: list[str]) -> set[str]:
    """Top-level third-party modules imported anywhere (lazy imports too) from the entries."""
    return import_closure(entry_modules)[1]


def import_closure(entry_modules: list[str]) -> tuple[set[Path], set[str]]:
    """(slotserve source files reached, top-level third-party modules) from the entries."""
    files: set[Path] = set()
    seen: set[str] = set()
    found: set[str] = set()
    todo = list(entry_modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            continue
        files.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for imported in names:
                top = imported.split(".")[0]
                if top == "slotserve":
                    todo.append(imported)
                elif top not in sys.stdlib_module_names:
                    found.add(top)
    return files, found


def wheel_path(source: Path) -> str:
    """Where a source file of the checkout lands inside its wheel."""
    relative = source.relative_to(ROOT)
    if relative.parts[0] == "slotserve":
        return relative.as_posix()
    return Path(*relative.parts[1:]).as_posix()  # engine/slotserve/engine/x.py -> slotserve/...


def test_wheels_hold_every_module_the_image_runs(image_wheels):
    """A module outside the packages found would be an ImportError in the image."""
    image, core, part = image_wheels
    files, _ = import_closure(IMAGE_ENTRY_MODULES[image])
    names: set[str] = set()
    for built in (core, part):
        with zipfile.ZipFile(built) as wheel:
            names |= set(wheel.namelist())
    missing = sorted(wheel_path(f) for f in files if wheel_path(f) not in names)
    assert not missing, f"the {image} image would miss: {missing}"


def requirement_name(requirement: str) -> str:
    return re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_every_package_its_code_imports(image):
    """`pip install . ./part` must bring everything the image's commands import."""
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {
        requirement_name(r)
        for r in core["dependencies"] + part_project(IMAGES[image][0])["dependencies"]
    }
    distributions = packages_distributions()
    missing = {}
    for module in third_party_imports(IMAGE_ENTRY_MODULES[image]):
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not names & installed:
            missing[module] = sorted(names)
    assert not missing, f"the {image} image lacks these imports: {missing}"
