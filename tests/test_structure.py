"""The package's shape: no import cycle between its modules, no import up its layers, train() on one
screen."""

import ast
import inspect
import re

import pytest
from conftest import ROOT

PACKAGE = ROOT / "accel_train"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path) -> set[str]:
    """Every accel_train module `path` imports, at the top or inside a function (a cycle either
    way)."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (
                (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            )
            if not target or not target.startswith("accel_train"):
                continue
            for alias in node.names:
                # `from . import x` / `from .data import info`: a submodule, if there is one
                sub = f"{target}.{alias.name}"
                found.add(
                    sub if (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() else target
                )
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("accel_train")}
    return found - {name}


def test_no_import_cycle_between_the_packages_modules():
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    graph = {
        m: {t for t in targets if t in graph and t != "accel_train"} for m, targets in graph.items()
    }
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
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
    # the command line is the top: the loop, the commands and everything else never reach back into
    # it
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    assert {m for m, targets in graph.items() if "accel_train.cli" in targets} == {
        "accel_train.__main__"
    }


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    a, b = tmp_path / "accel_train" / "a.py", tmp_path / "accel_train" / "b.py"
    a.parent.mkdir()
    a.write_text("from .b import x\n")
    b.write_text("def f():\n    from .a import y\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert imports_of(a) == {"accel_train.b"} and imports_of(b) == {"accel_train.a"}


# The package's layers, lowest first: a module imports its own layer and those below it, never one
# above (lazy imports too). A module belongs to the layer of its longest listed prefix. The root
# (__version__, the parent's pid) is the base; its lazy re-exports of TrainConfig and train are the
# public face, not a dependency.
LAYERS = [
    (
        (
            "base: exceptions, exit statuses, the parser, file names, a rank's lines, where a rank"
            " is, forks"
        ),
        [
            "accel_train",
            "accel_train.errors",
            "accel_train.parser",
            "accel_train.lines",
            "accel_train.exits",
            "accel_train.files",
            "accel_train.rank_files",
            "accel_train.forks",
            "accel_train.hang",
        ],
    ),
    ("model: timm's and your own, freeze, pretrained weights", ["accel_train.model"]),
    (
        "config: TrainConfig, flag types, automatic defaults, the recipe's flags",
        ["accel_train.config"],
    ),
    (
        (
            "platform: the Accelerator, hardware facts, cores, a backend's environment, checks"
            " across ranks"
        ),
        ["accel_train.platform"],
    ),
    ("data", ["accel_train.data"]),
    ("precision: the check, its verdict, its cache", ["accel_train.precision"]),
    (
        "checkpoint: the checkpointer, resume and what it may change, the output dir, transfer",
        ["accel_train.checkpoint"],
    ),
    (
        "resilience: stop requests and agreed checks, survivor, heartbeat, how a run's status ends",
        ["accel_train.resilience", "accel_train.status"],
    ),
    (
        "train: the loop, building a run, evaluation, optimizer, metrics, exports, divergence",
        ["accel_train.training"],
    ),
    ("commands and the API", ["accel_train.commands", "accel_train.api"]),
    (
        "the command line and the launcher",
        ["accel_train.cli", "accel_train.__main__", "accel_train.launcher"],
    ),
]
FACE = {("accel_train", "accel_train.api"), ("accel_train", "accel_train.config.train_config")}


def layer_of(module: str) -> int:
    found = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix != "accel_train" and module.startswith(prefix + "."))
    ]
    assert found, f"{module} is in no layer of tests/test_structure.py's LAYERS: give it one"
    return max(found)[1]


def upward_imports(graph) -> list[str]:
    return [
        f"{m} ({LAYERS[layer_of(m)][0].split(':')[0]}) imports {t} "
        f"({LAYERS[layer_of(t)][0].split(':')[0]})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if (m, t) not in FACE and layer_of(t) > layer_of(m)
    ]


def test_no_module_imports_a_layer_above_its_own():
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    graph = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    assert not upward_imports(graph)


def test_the_layer_check_finds_an_import_that_goes_up(tmp_path, monkeypatch):
    data = tmp_path / "accel_train" / "data"
    data.mkdir(parents=True)
    (data / "images.py").write_text("def f():\n    from ..resilience.preempt import pending_stop\n")
    (tmp_path / "accel_train" / "resilience").mkdir()
    (tmp_path / "accel_train" / "resilience" / "preempt.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = {"accel_train.data.images": imports_of(data / "images.py")}
    assert upward_imports(graph) == [
        "accel_train.data.images (data) imports accel_train.resilience.preempt (resilience)"
    ]
    with pytest.raises(AssertionError, match="accel_train.nowhere is in no layer"):
        layer_of("accel_train.nowhere")


def test_the_public_names_survive_every_module_being_imported():
    # a subpackage is set as an attribute of its parent once imported: one named `train` (or
    # `TrainConfig`) would shadow the public name `from accel_train import train` gives
    import importlib
    import pkgutil

    import accel_train

    for info in pkgutil.walk_packages(accel_train.__path__, "accel_train."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    from accel_train import TrainConfig, api, train

    assert train is api.train and callable(train) and isinstance(TrainConfig, type)
    assert TrainConfig is api.TrainConfig and accel_train.__all__ == ["TrainConfig", "train"]


def test_the_code_and_its_tests_say_why_not_their_history():
    # which issue, review or campaign seed brought a line is git's to say; a comment says why now,
    # a test what it proves
    import re

    history = re.compile(r"\b(issues? \d+|review\s?\d+\w*|(scenario|seed) \d{6,})", re.IGNORECASE)
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for folder in ("accel_train", "tests", "tools", "bench", "examples")
        for p in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert not found, found


def test_train_reads_on_one_screen():
    from accel_train.training.loop import train

    assert len(inspect.getsource(train).splitlines()) <= 40


def test_no_binary_or_large_file_is_tracked():
    # nothing downloaded or generated (a wheel, a data set) belongs in git
    import subprocess

    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    paths = [p for p in tracked.decode().split("\0") if p and (ROOT / p).is_file()]
    assert paths, "git ls-files listed nothing"
    big = [p for p in paths if (ROOT / p).stat().st_size > 1 << 20]
    archives = [
        p
        for p in paths
        if p.endswith(
            (
                ".whl",
                ".tar.gz",
                ".tgz",
                ".zip",
                ".egg",
                ".tar",
                ".so",
                ".pt",
                ".pth",
                ".safetensors",
                ".bin",
            )
        )
    ]
    assert not big and not archives, f"binaries or files over 1 MB are tracked: {big + archives}"


# What was asked is only read: a TrainConfig is written by its parser and validation alone
# (TrainConfig.__post_init__); start-up returns what it decides (config/resolved.py).
CONFIG_NAMES = {"cfg", "config", "asked"}
PARSER_AND_VALIDATION = {
    ("config/train_config.py", "TrainConfig.__post_init__"),
    ("cli.py", "parse_train_args"),
}


def config_writes(path, relative: str) -> list[str]:
    """Every assignment to a config's attribute in `path` (`x.field = ...`, `+=`, setattr,
    object.__setattr__, vars()/__dict__ writes), where x is a name a config goes by, a parameter
    annotated TrainConfig, an attribute `.cfg` / `.config`, or TrainConfig's own self."""
    found = []

    def visit(node, where: str, names: set[str]):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = child.args.posonlyargs + child.args.args + child.args.kwonlyargs
                typed = {
                    a.arg
                    for a in params
                    if a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation)
                }
                inner = f"{where}.{child.name}" if where else child.name
                visit(child, inner, names | typed)
            elif isinstance(child, ast.ClassDef):
                own = {"self"} if child.name == "TrainConfig" else set()
                visit(child, child.name, (names - {"self"}) | own)
            else:
                check(child, where, names)
                visit(child, where, names)

    def is_config(expr, names) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in names
        if isinstance(expr, ast.Attribute) and expr.attr in ("cfg", "config"):
            return True
        # vars(cfg)[...] / cfg.__dict__[...]
        if isinstance(expr, ast.Call) and getattr(expr.func, "id", None) == "vars":
            return any(is_config(a, names) for a in expr.args)
        if isinstance(expr, ast.Attribute) and expr.attr == "__dict__":
            return is_config(expr.value, names)
        return False

    def check(node, where, names):
        if (relative, where) in PARSER_AND_VALIDATION:
            return
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat = []
        for t in targets:
            flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        for t in flat:
            if isinstance(t, ast.Attribute) and is_config(t.value, names):
                found.append(f"{relative}:{t.lineno} {where}: {ast.unparse(t)}")
            if isinstance(t, ast.Subscript) and is_config(t.value, names):
                found.append(f"{relative}:{t.lineno} {where}: {ast.unparse(t)}")
        if isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func)
            if name in ("setattr", "object.__setattr__", "delattr") and is_config(
                node.args[0], names
            ):
                found.append(f"{relative}:{node.lineno} {where}: {ast.unparse(node)}")

    visit(ast.parse(path.read_text()), "", CONFIG_NAMES)
    return found


def test_no_module_writes_into_a_config_after_parsing():
    writes = [
        w
        for path in sorted(PACKAGE.rglob("*.py"))
        for w in config_writes(path, path.relative_to(PACKAGE).as_posix())
    ]
    assert not writes, "start-up returns what it decides (config/resolved.py):\n" + "\n".join(
        writes
    )


def test_the_config_write_check_finds_each_kind_of_write(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "def a(cfg):\n    cfg.batch_size = 2\n"
        "def b(c: TrainConfig):\n    c.stem, x = 'cifar', 1\n"
        "def c(run):\n    run.config.lr += 1\n"
        "def d(config):\n    setattr(config, 'seed', 1)\n"
        "def e(cfg):\n    vars(cfg)['seed'] = 1\n"
        "class TrainConfig:\n    def validate(self):\n        self.data = 'x'\n"
        "    def __post_init__(self):\n        self.data = 'x'\n"
        "def fine(cfg, other):\n    other.batch_size = 2\n    cfg = cfg\n"
    )
    assert [w.split(" ", 1)[0] for w in config_writes(source, "m.py")] == [
        "m.py:2",
        "m.py:4",
        "m.py:6",
        "m.py:8",
        "m.py:10",
        "m.py:13",
        "m.py:15",
    ]
    # TrainConfig's __post_init__ (its own file's) is the parser's: validate is checked
    allowed = config_writes(source, "config/train_config.py")
    assert allowed[-1].startswith("config/train_config.py:13 TrainConfig.validate")


def test_the_rank_launcher_files_are_spelled_in_one_module():
    """The status folder's variable, its notes' folder and lines: rank_files.py alone spells them
    (the rank writes and the launcher reads through it); docstrings may name them."""
    words = re.compile(r"ACCEL_TRAIN_STATUS_DIR|\bfaults\b|exit: python|\bbackend: |\.SIGTERM\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rank_files.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found += [
            f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and id(node) not in docs
            and isinstance(node.value, str)
            and words.search(node.value)
        ]
    assert not found, found
