"""tools/mutate.py: every planted bug of its list still applies to the tree and names tests that
exist (the run itself, each mutant against its tests, is by hand: bench/RESULTS.md records it)."""

import importlib.util
import sys

from conftest import ROOT


def load_mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies_once_and_names_existing_tests(tmp_path):
    mutate = load_mutate()
    assert len(mutate.MUTANTS) >= 8 and len({m.name for m in mutate.MUTANTS}) == len(mutate.MUTANTS)
    assert [p for m in mutate.MUTANTS for p in mutate.problems(m)] == []
    assert mutate.main(["--check"]) == 0
    # a mutant whose text is gone is reported, not silently skipped
    (tmp_path / "accel_train" / "training").mkdir(parents=True)
    (tmp_path / "accel_train" / "training" / "loop.py").write_text("nothing to mutate here\n")
    gone = mutate.problems(mutate.MUTANTS[1], tmp_path)
    assert any("occurs 0 times" in p for p in gone) and any("no test" in p for p in gone), gone
