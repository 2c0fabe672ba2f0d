"""accel_config: launch.sh's check of an accelerate config with accelerate's own loader, remembered
per contents."""

import importlib.metadata

from conftest import CONFIGS

from accel_train.platform import accel_config


def test_a_config_that_loaded_is_not_read_again_and_a_changed_one_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "mine.yaml"
    config.write_text((CONFIGS / "2proc_cpu.yaml").read_text())
    checked = []
    real = accel_config.problem
    monkeypatch.setattr(accel_config, "problem", lambda path: checked.append(path) or real(path))
    # accelerate's loader took it
    assert accel_config.main([str(config)]) == 0 and len(checked) == 1
    # remembered: accelerate not imported
    assert accel_config.main([str(config)]) == 0 and len(checked) == 1
    # the same file with a typo is another file: read, refused in one line, not remembered
    config.write_text(config.read_text() + "num_proceses: 2\n")
    capsys.readouterr()
    assert accel_config.main([str(config)]) == 1 and len(checked) == 2
    assert accel_config.main([str(config)]) == 1 and len(checked) == 3
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "unknown keys" in out[0] and "num_proceses" in out[0]
    # the file that loaded, under another accelerate version: read again
    config.write_text((CONFIGS / "2proc_cpu.yaml").read_text())
    assert accel_config.main([str(config)]) == 0 and len(checked) == 3
    installed = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "99.0" if name == "accelerate" else installed(name),
    )
    assert accel_config.main([str(config)]) == 0 and len(checked) == 4


def test_a_cache_that_cannot_be_written_only_means_the_check_runs(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    checked = []
    monkeypatch.setattr(accel_config, "problem", lambda path: checked.append(path))
    for _ in range(2):
        assert accel_config.main([str(CONFIGS / "cpu.yaml")]) == 0
    assert len(checked) == 2


def test_no_home_directory_only_means_the_check_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(accel_config.Path, "home", staticmethod(no_home))
    assert accel_config.marker(str(CONFIGS / "cpu.yaml")) is None
    assert accel_config.main([str(CONFIGS / "cpu.yaml")]) == 0


def test_the_same_text_read_as_json_is_another_check(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = (CONFIGS / "cpu.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "a.json").write_text(text)
    assert accel_config.main([str(tmp_path / "a.yaml")]) == 0
    # YAML is not JSON: refused, though a.yaml passed
    assert accel_config.main([str(tmp_path / "a.json")]) == 1
