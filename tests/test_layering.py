"""caldrix's imports follow its layers (docs/architecture.md, "Module map"), with no circles.

Every `import` in the package is read with ast, function-level ones included (a lazy import is
still an arrow), those under `if TYPE_CHECKING:` excepted (they never run). Then:
- no circle among caldrix's modules;
- no arrow against the order front -> routes -> sched -> engine -> models -> kernels -> weights
  (each module's layer is LAYERS' longest matching prefix);
- model, kernel and weights code imports nothing above the engine (no server code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import caldrix

ROOT = Path(caldrix.__file__).parent

# Higher may import lower or equal, never higher. A module not named here (a package another
# issue adds) is checked for circles only, until it is given its layer.
LAYERS = {
    "caldrix.cli": 9, "caldrix.__main__": 9,
    "caldrix.server": 8, "caldrix.run": 8, "caldrix.replay": 8,
    "caldrix.app": 7,
    "caldrix.faults": 8,
    "caldrix.routes": 6, "caldrix.runtime": 6, "caldrix.systemone": 6, "caldrix.decider": 6, "caldrix.vision": 6, "caldrix.lanes": 6,
    "caldrix.generate": 5, "caldrix.request_queue": 5, "caldrix.text": 5, "caldrix.tokenizer": 5, "caldrix.telemetry": 5, "caldrix.metrics": 5,
    "caldrix.sched": 4,
    "caldrix.engine": 3, "caldrix.host_engine": 3, "caldrix.batch": 3, "caldrix.sampler": 3,
    "caldrix.device_pick": 3, "caldrix.weight_budget": 3, "caldrix.draft": 3, "caldrix.engine_probes": 3,
    "caldrix.models": 2,
    "caldrix.kernels": 1,
    "caldrix.weights": 0, "caldrix.protocol": 0, "caldrix.config": 0, "caldrix.memory": 0,
}
ENGINE = LAYERS["caldrix.engine"]
MODEL_CODE = ("caldrix.models", "caldrix.kernels", "caldrix.weights")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The caldrix modules `name` imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "caldrix")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "caldrix":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer(name: str) -> int | None:
    if name == "caldrix":
        return 0  # the package's own __init__ (its version)
    best = None
    for prefix, rank in LAYERS.items():
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return None if best is None else best[1]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_arrow_against_the_layers():
    bad = []
    for name, deps in graph().items():
        a = layer(name)
        for dep in deps:
            b = layer(dep)
            if a is not None and b is not None and b > a:
                bad.append(f"{name} (layer {a}) imports {dep} (layer {b})")
    assert not bad, "\n".join(sorted(bad))


def test_model_code_imports_no_server_code():
    bad = [f"{name} imports {dep}" for name, deps in graph().items() if name.startswith(MODEL_CODE)
           for dep in deps if (layer(dep) or 0) >= ENGINE]
    assert not bad, "\n".join(sorted(bad))


def test_the_checks_see_what_they_check():
    """The walk finds function-level imports, relative ones and a planted circle and wrong arrow."""
    g = graph()
    assert "caldrix.kernels.native" in g["caldrix.kernels.q4"]
    assert "caldrix.weights.gguf" in g["caldrix.kernels.build"]  # a function-level import
    assert "caldrix.runtime" in g["caldrix.server"]  # likewise
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert layer("caldrix.routes.completions") == 6 and layer("caldrix.models.llama") == 2
    assert layer("caldrix.engine") == 3 and layer("caldrix.newthing") is None
