"""The package layering of docs/architecture.md: perfmodel's imports point down, never in a cycle,
and never to JAX or the kernels (imports inside functions count as much as those at the top)."""
import ast
from collections import defaultdict
from pathlib import Path

import perfmodel

ROOT = Path(perfmodel.__file__).parent
# bottom to top; a module may import its own layer's modules (without a cycle) and lower layers
LAYERS = (("util",), ("spec",), ("graph",), ("cost",), ("engine",), ("step",),
          ("fit", "validate", "search", "serve"), ("cli",), ("__init__",))
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
FOREIGN = ("jax", "jaxlib", "perfmodel_kernels", "perfmodel_jax")
# the two places that read JAX, inside the function that needs it (installing perfmodel needs no JAX)
READS_JAX = {"perfmodel.spec.hardware": "jax tpu_info's chip figures", "perfmodel.validate.traces": "jax.profiler"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import (the package imports absolutely)"
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from perfmodel.spec import arch`
    return out


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in imports(p) if i in modules and i != m} | {i for i in imports(p) if i.split(".")[0] in FOREIGN}
            for m, p in modules.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_package_has_a_layer():
    assert {layer(m) for m in graph()} <= set(RANK), sorted({layer(m) for m in graph()} - set(RANK))


def test_imports_point_down_and_never_to_jax_or_the_kernels():
    bad = [(m, i) for m, deps in graph().items() for i in deps
           if (i.split(".")[0] == "jax" and m not in READS_JAX) or i.split(".")[0] in FOREIGN[1:]
           or (i.split(".")[0] == "perfmodel" and RANK[layer(i)] > RANK[layer(m)])]
    assert not bad, "upward or foreign imports: " + ", ".join(f"{m} -> {i}" for m, i in bad)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among perfmodel's modules (depth-first search)."""
    g = {m: {i for i in deps if i.split(".")[0] == "perfmodel" and i != "perfmodel"} for m, deps in g.items()}
    state, found = defaultdict(int), []

    def visit(m, path):
        state[m] = 1
        for i in g.get(m, ()):
            if state[i] == 1:
                found.append(path[path.index(i):] + [i])
            elif state[i] == 0:
                visit(i, path + [i])
        state[m] = 2

    for m in g:
        if state[m] == 0:
            visit(m, [m])
    return found


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_jax_is_read_only_inside_functions():
    for m in READS_JAX:
        tree = ast.parse((ROOT.parent / (m.replace(".", "/") + ".py")).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not [n for n in top if "jax" in ast.dump(n)], m


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The checks above can fail: a low module importing a high one is found."""
    (tmp_path / "perfmodel" / "util").mkdir(parents=True)
    (tmp_path / "perfmodel" / "cli").mkdir()
    (tmp_path / "perfmodel" / "__init__.py").write_text("")
    (tmp_path / "perfmodel" / "util" / "x.py").write_text("def f():\n    from perfmodel.cli import y\n")
    (tmp_path / "perfmodel" / "cli" / "y.py").write_text("import perfmodel.util.x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "perfmodel")
    g = graph()
    assert g["perfmodel.util.x"] == {"perfmodel.cli.y"}
    assert RANK[layer("perfmodel.cli.y")] > RANK[layer("perfmodel.util.x")]
    assert cycles(g) == [["perfmodel.util.x", "perfmodel.cli.y", "perfmodel.util.x"]]
