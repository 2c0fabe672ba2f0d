"""The package's shape: no import cycle between its modules, modules of a readable size, train() on one screen."""

import ast
import inspect

from conftest import ROOT

PACKAGE = ROOT / "accel_train"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path) -> set[str]:
    """Every accel_train module `path` imports, at the top or inside a function (a cycle either way)."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            if not target or not target.startswith("accel_train"):
                continue
            for alias in node.names:  # `from . import x` / `from .data import info`: a submodule, if there is one
                sub = f"{target}.{alias.name}"
                found.add(sub if (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("accel_train")}
    return found - {name}


def test_no_import_cycle_between_the_packages_modules():
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    graph = {m: {t for t in targets if t in graph and t != "accel_train"} for m, targets in graph.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)


def test_only_the_entry_point_imports_the_cli():
    # the command line is the top: the loop, the commands and everything else never reach back into it
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    assert {m for m, targets in graph.items() if "accel_train.cli" in targets} == {"accel_train.__main__"}


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    a, b = tmp_path / "accel_train" / "a.py", tmp_path / "accel_train" / "b.py"
    a.parent.mkdir()
    a.write_text("from .b import x\n")
    b.write_text("def f():\n    from .a import y\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert imports_of(a) == {"accel_train.b"} and imports_of(b) == {"accel_train.a"}


MAX_LINES = 340  # a module past this likely holds two concerns: a prompt to read it, not a cut


def test_no_module_is_two_concerns_long():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, long


def test_train_reads_on_one_screen():
    from accel_train.loop import train
    assert len(inspect.getsource(train).splitlines()) <= 60


def test_no_binary_or_large_file_is_tracked():
    # issue 33 item 8: a 2.9 MB wheel sat at the repository root; nothing downloaded or generated belongs in git
    import subprocess
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [p for p in tracked.decode().split("\0") if p and (ROOT / p).is_file()]
    assert paths, "git ls-files listed nothing"
    big = [p for p in paths if (ROOT / p).stat().st_size > 1 << 20]
    archives = [p for p in paths if p.endswith((".whl", ".tar.gz", ".tgz", ".zip", ".egg", ".tar", ".so", ".pt",
                                                 ".pth", ".safetensors", ".bin"))]
    assert not big and not archives, f"binaries or files over 1 MB are tracked: {big + archives}"
