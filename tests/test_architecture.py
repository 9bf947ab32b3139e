"""The dependency rules of STYLE.md, enforced by walking every import."""

from __future__ import annotations

import ast
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)


def _workflow_modules() -> list[str]:
    """The modules of the workflows the worker registers (its registry, not a list kept here
    by hand: a new workflow is checked the day it is registered)."""
    from workflows.registry import WORKFLOWS

    return sorted({cls.__module__.removeprefix("workflows.") for cls in WORKFLOWS})


WORKFLOW_MODULES = _workflow_modules()
# Packages that run inside a GPU job image with no database (the inference engine too: train
# and eval jobs roll out through it).
JOB_PACKAGES = ["services/training", "services/environments", "services/inference"]
JOB_MODULES = [
    "services/evaluation/stats.py",
    "services/evaluation/evaluator.py",
    "services/evaluation/job.py",
    "services/evaluation/results.py",
    "services/evaluation/probes.py",
    "services/evaluation/probe_capture.py",
]
JOB_ALLOWED = {
    "torch",
    "safetensors",
    "re2",  # replay's regex references run on RE2 (linear time), in the job like the rest
    "services.chat",
    "services.training",
    "services.environments",
    "services.evaluation",
    "services.inference",
}
# The hf family's model libraries, allowed only in its own package and its engine.
HF_PACKAGES = ("services/training/hf/", "services/inference/hf.py")
HF_ALLOWED = {"transformers", "peft"}
# The MCP SDK (and its HTTP client), allowed only in the replay sandbox's client of it, which
# a job imports when its loop names an MCP tool server.
MCP_MODULES = ("services/environments/replay/mcp_client.py",)
MCP_ALLOWED = {"mcp", "httpx2"}


def imports_of(path: Path) -> list[str]:
    """Every module name a file imports, at any depth (function-level imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def python_files(*roots: str) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        base = ROOT / root
        files.extend([base] if base.is_file() else sorted(base.rglob("*.py")))
    return [path for path in files if path.exists()]


def top(name: str) -> str:
    return name.split(".")[0]


def test_services_never_import_workflows() -> None:
    # The CLI (the composition entry point) and the api (starts and signals workflows) may.
    offenders = []
    for path in python_files("services"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(("services/cli/", "services/api/")):
            continue
        offenders += [
            f"{relative}: {name}" for name in imports_of(path) if top(name) == "workflows"
        ]
    assert offenders == []


def test_api_imports_only_shared_and_workflow_classes() -> None:
    allowed = {"workflows.ids", *(f"workflows.{module}" for module in WORKFLOW_MODULES)}
    offenders = []
    for path in python_files("services/api"):
        offenders += [
            f"{path.relative_to(ROOT)}: {name}"
            for name in imports_of(path)
            if top(name) == "workflows"
            and name not in allowed
            and not name.startswith("workflows.payloads")
        ]
    assert offenders == []


@pytest.mark.parametrize("module", WORKFLOW_MODULES)
def test_workflow_modules_import_only_temporal_and_shared(module: str) -> None:
    path = ROOT / "workflows" / f"{module}.py"
    if not path.exists():
        pytest.fail(f"workflows/{module}.py is missing")
    allowed_prefixes = (
        "temporalio",
        "workflows.ids",
        "workflows.payloads",
        "workflows.activities",
        "workflows.options",
        "workflows.search_attributes",
        "workflows.cycle",
        # LoopWorkflow's trigger check and bootstrap cycle: workflow code beside workflows.cycle
        "workflows.trigger",
        "workflows.bootstrap",
        "services.temporal",
        "services.loop.states",  # StrEnums over the standard library's enum only
    )
    allowed_workflows = {f"workflows.{name}" for name in WORKFLOW_MODULES}
    offenders = [
        name
        for name in imports_of(path)
        if top(name) not in STDLIB
        and not name.startswith(allowed_prefixes)
        and name not in allowed_workflows
    ]
    assert offenders == []


def test_jobs_import_torch_and_stdlib_only() -> None:
    offenders = []
    for path in python_files(*JOB_PACKAGES, *JOB_MODULES):
        for name in imports_of(path):
            if top(name) in STDLIB or top(name) == "__future__":
                continue
            if any(name == allowed or name.startswith(allowed + ".") for allowed in JOB_ALLOWED):
                continue
            in_hf = path.relative_to(ROOT).as_posix().startswith(HF_PACKAGES)
            if in_hf and top(name) in HF_ALLOWED:
                continue
            in_mcp = path.relative_to(ROOT).as_posix() in MCP_MODULES
            if in_mcp and top(name) in MCP_ALLOWED:
                continue
            offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


def test_chat_protocol_is_stdlib_only() -> None:
    def allowed(name: str) -> bool:
        return top(name) in STDLIB or top(name) == "__future__" or name.startswith("services.chat")

    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in python_files("services/chat")
        for name in imports_of(path)
        if not allowed(name)
    ]
    assert offenders == []


def test_only_settings_reads_the_environment() -> None:
    allowed = {
        "services/settings.py",
        # Jobs read the job contract's variables (they get no settings object).
        *(p.relative_to(ROOT).as_posix() for p in python_files(*JOB_PACKAGES, *JOB_MODULES)),
    }
    offenders = []
    for path in python_files("services", "workflows"):
        relative = path.relative_to(ROOT).as_posix()
        if relative in allowed:
            continue
        source = path.read_text()
        if "os.environ[" in source or "os.getenv(" in source or "os.environ.get(" in source:
            offenders.append(relative)
    # The embedded stack hands its children an environment (it copies, never reads settings);
    # `ratchet api` with several workers sets PROMETHEUS_MULTIPROC_DIR for them (writes only).
    assert [
        o for o in offenders if o not in ("services/local/stack.py", "services/cli/stack.py")
    ] == []


def test_nothing_is_built_at_import_time() -> None:
    """Importing every module with broken settings must not fail: settings load lazily."""
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in python_files("services", "workflows")
        if path.name != "__main__.py"
    )
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    env = {
        "PATH": sysconfig.get_path("scripts"),
        "RATCHET_API_PORT": "not-a-port",
        "RATCHET_DATABASE_URL": "mysql://nope",
    }
    result = subprocess.run(
        [sys.executable, "-c", code, *modules],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]


# Activities and child workflows by reference -----------------------------------------------

# Every workflow API that starts an activity or a child workflow.
STARTERS = {
    f"{verb}_{kind}"
    for verb in ("execute", "start")
    for kind in (
        "activity",
        "activity_method",
        "activity_class",
        "local_activity",
        "local_activity_method",
        "local_activity_class",
        "child_workflow",
    )
}
RETRY_PRESETS_MODULE = "workflows/options.py"


def started_by_name(source: str) -> list[str]:
    """Calls that start an activity or child workflow by a string name, or with
    ``result_type=`` (which only a by-name call needs): ``line: call``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in STARTERS:
            continue
        by_string = bool(node.args) and isinstance(node.args[0], ast.Constant)
        typed_by_hand = any(keyword.arg == "result_type" for keyword in node.keywords)
        if by_string or typed_by_hand:
            found.append(f"{node.lineno}: {name}")
    return found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('workflow.execute_activity("gate", x, result_type=R)', True),
        ('await workflow.start_child_workflow("TrainWorkflow", x)', True),
        ("workflow.execute_activity(fn, x, result_type=R)", True),
        ('execute_local_activity("name", x)', True),
        ("workflow.execute_activity_method(LoopActivities.gate, x)", False),
        ("workflow.execute_child_workflow(TrainWorkflow.run, x, id=i)", False),
        ('workflow.patched("some-patch")', False),
    ],
)
def test_the_by_name_check_sees_string_names(source: str, flagged: bool) -> None:
    assert bool(started_by_name(source)) is flagged


def test_workflows_start_activities_and_children_by_reference() -> None:
    """So the type checker sees each call's name, input and result."""
    offenders = [
        f"{path.relative_to(ROOT)}:{found}"
        for path in python_files("workflows")
        for found in started_by_name(path.read_text())
    ]
    assert offenders == []


def test_signals_are_named_after_their_handlers() -> None:
    """The api signals a loop by handler (``LoopWorkflow.pause``) and sends its function name:
    that is the signal's name only while no ``@workflow.signal`` names itself otherwise, and
    while no signal is sent by a string."""
    named = []
    for path in python_files("workflows"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "workflow.signal":
                named.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    by_string = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in python_files("services", "workflows")
        for node in ast.walk(ast.parse(path.read_text()))
        if (
            isinstance(node, ast.keyword)
            and node.arg == "start_signal"
            and isinstance(node.value, ast.Constant)
        )
        or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "signal"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        )
    ]
    assert named == [] and by_string == []


def test_retry_presets_are_defined_in_one_module() -> None:
    """Every ``RetryPolicy`` (and every ``*_RETRY`` name) under workflows/ is a preset of
    workflows/options.py, so one kind of call retries one way everywhere."""
    offenders = []
    for path in python_files("workflows"):
        relative = path.relative_to(ROOT).as_posix()
        if relative == RETRY_PRESETS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "RetryPolicy":
                    offenders.append(f"{relative}:{node.lineno}: RetryPolicy(...)")
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                offenders += [
                    f"{relative}:{node.lineno}: {target.id}"
                    for target in targets
                    if isinstance(target, ast.Name) and target.id.endswith("_RETRY")
                ]
    assert offenders == []


# State words by enum ----------------------------------------------------------------------

# Attributes that hold one of a closed vocabulary's words (services/loop/states.py and the
# StrEnums beside their owners): compared, they name a member, never a string.
STATE_ATTRIBUTES = frozenset({"status", "outcome", "stage", "decision", "state", "finish"})
COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _is_words(node: ast.expr) -> bool:
    """A str literal, or a tuple, set or list of nothing but str literals."""
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return bool(node.elts) and all(_is_words(element) for element in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def compared_to_strings(source: str) -> list[str]:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``) of a state attribute (``run.status``,
    ``Run.status``) to a str literal or literals: ``line: comparison``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
            if not isinstance(op, COMPARISONS):
                continue
            if any(
                isinstance(one, ast.Attribute) and one.attr in STATE_ATTRIBUTES and _is_words(other)
                for one, other in ((left, right), (right, left))
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
                break
    return found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('run.status == "succeeded"', True),
        ('select(Loop).where(Loop.status != "archived")', True),
        ('"held" == promotion.status', True),
        ('probed.status not in ("succeeded", "skipped")', True),
        ('s.state in {"done", "failed"}', True),
        ('row.finish == "cancelled"', True),
        ("run.status == RunStatus.SUCCEEDED", False),
        ("select(Loop).where(Loop.status != LoopLifecycle.ARCHIVED)", False),
        ("probed.status not in (ProbeStatus.SUCCEEDED, ProbeStatus.SKIPPED)", False),
        ('run.kind == "train"', False),
        ('status == "ok"', False),
    ],
)
def test_the_state_word_check_sees_string_literals(source: str, flagged: bool) -> None:
    assert bool(compared_to_strings(source)) is flagged


def test_state_words_are_compared_as_enum_members() -> None:
    """A state word compared as a string is a typo the type checker cannot see; the enum
    member is the same string, so nothing stored or sent changes."""
    offenders = [
        f"{path.relative_to(ROOT)}:{found}"
        for path in python_files("services", "workflows")
        for found in compared_to_strings(path.read_text())
    ]
    assert offenders == []


# Model libraries the api process must never load: it verifies checkpoints, never runs them.
MODEL_LIBRARIES = ("torch", "transformers", "peft")


def test_api_never_imports_model_libraries() -> None:
    """The api, every route module and checkpoint verification load without torch."""
    fixture = ROOT / "tests" / "e2e" / "fixtures" / "toolcalc-champion"
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from services.api.app import create_app, route_modules\n"
        "from services.settings import Settings\n"
        "import services.checkpoints\n"
        "from services.training.checkpoint_manifest import verify_checkpoint\n"
        "route_modules()\n"
        "create_app(Settings())\n"
        "verify_checkpoint(Path(sys.argv[1]))\n"
        f"print(','.join(m for m in {MODEL_LIBRARIES!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(fixture)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == ""


def test_api_reaches_no_model_library_even_lazily() -> None:
    """Function-level imports count too: a request must not load torch either. Follows every
    import, at any depth, from the api's modules through services/ and workflows/."""
    paths = {module_of(path): path for path in python_files("services", "workflows")}
    reached_from: dict[str, str | None] = {m: None for m in paths if m.startswith("services.api")}
    pending = list(reached_from)
    while pending:
        module = pending.pop()
        for name in imports_of(paths[module]):
            target = name
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if top(name) in MODEL_LIBRARIES:
                target = top(name)
            if target and target not in reached_from:
                reached_from[target] = module
                if target in paths:
                    pending.append(target)
    chains = []
    for library in MODEL_LIBRARIES:
        chain = [library]
        while (importer := reached_from.get(chain[-1])) is not None:
            chain.append(importer)
        if len(chain) > 1:
            chains.append(" ← ".join(chain))
    assert chains == []


# The ways into the CLI: `python -m services`, `python -m services.modelserver` and the
# model server's command of earlier releases, `python -m services.serving`.
CLI_ENTRY_POINTS = (
    "services/__main__.py",
    "services/modelserver/__main__.py",
    "services/serving/__main__.py",
)


def test_domain_code_never_imports_the_cli() -> None:
    """Commands call the domain; the domain never reaches back into the command layer."""
    offenders = []
    for path in python_files("services", "workflows"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("services/cli/") or relative in CLI_ENTRY_POINTS:
            continue
        offenders += [
            f"{relative}: {name}"
            for name in imports_of(path)
            if name == "services.cli" or name.startswith("services.cli.")
        ]
    assert offenders == []


# Import cycles that are there on purpose, each with its reason: (module, module) edges of
# the cycle. None today; a new entry needs a reason a reviewer accepts.
ALLOWED_IMPORT_CYCLES: dict[frozenset[str], str] = {}


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(path: Path, known: set[str]) -> list[str]:
    """The modules a file imports anywhere: top-level statements and function bodies alike
    (a function-level import closes a circle as surely, only later: two modules that need
    each other are one module or a third is missing). ``TYPE_CHECKING`` blocks are skipped:
    they never run."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.append(submodule if submodule in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of services/ and workflows/ it imports (anywhere). Importing
    ``a.b.c`` loads the packages ``a`` and ``a.b`` too, except the importer's own packages
    (a submodule importing its package's ``__init__`` is how packages work, not a cycle)."""
    paths = {module_of(path): path for path in python_files("services", "workflows")}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        edges: set[str] = set()
        for name in module_imports(path, known):
            while name:
                if name in known and not f"{module}.".startswith(f"{name}."):
                    edges.add(name)
                name = name.rpartition(".")[0]
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the groups of modules that import each other."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                child = pending.pop()
                if child not in index:
                    index[child] = lowlink[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, sorted(graph[child])))
                elif child in on_stack:
                    lowlink[node] = min(lowlink[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_the_cycle_rule_sees_function_level_imports_but_not_type_checking_ones(
    tmp_path: Path,
) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.a import A\n"
        "def f():\n    from services.b import c\n    import services.d\n"
    )
    assert module_imports(source, {"services.b.c"}) == ["typing", "services.b.c", "services.d"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = []
    for group in strongly_connected(graph):
        members = set(group)
        edges = {
            frozenset((module, target)) for module in group for target in graph[module] & members
        }
        unexplained = [edge for edge in edges if edge not in ALLOWED_IMPORT_CYCLES]
        if unexplained:
            cycles.append(
                " ↔ ".join(group)
                + ": "
                + "; ".join(f"{m} → {', '.join(sorted(graph[m] & members))}" for m in group)
            )
    assert cycles == []


# Sizes -------------------------------------------------------------------------------------

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def oversized(path: Path, relative: str) -> list[str]:
    """``relative`` when the module is over :data:`MAX_MODULE_LINES` lines, and
    ``relative:name`` for each function (methods and nested ones too) over
    :data:`MAX_FUNCTION_LINES`, counted from its ``def`` line to its last line."""
    source = path.read_text()
    found = [relative] if len(source.splitlines()) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            end = node.end_lineno or node.lineno
            if end - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{relative}:{node.name}")
    return found


def test_the_size_rule_counts_module_and_function_lines(tmp_path: Path) -> None:
    def function(name: str, lines: int, indent: str = "") -> str:
        body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
        return f"{indent}def {name}():\n{body}"

    source = tmp_path / "m.py"
    source.write_text(function("short", MAX_FUNCTION_LINES))
    assert oversized(source, "m.py") == []
    long_method = function("long", MAX_FUNCTION_LINES + 1, indent="    ")
    source.write_text(function("short", MAX_FUNCTION_LINES) + "class C:\n" + long_method)
    assert oversized(source, "m.py") == ["m.py:long"]
    source.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(source, "m.py") == ["m.py"]


def test_modules_and_functions_stay_short() -> None:
    """No module in services/ or workflows/ over 600 lines, no function over 80: a file or a
    function that outgrows them has a second job (STYLE.md, "Files that grow a second job")."""
    found = [
        item
        for path in python_files("services", "workflows")
        for item in oversized(path, path.relative_to(ROOT).as_posix())
    ]
    assert found == []
