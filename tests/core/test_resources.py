from workbench.core.resources import resource, resources_dir


def test_resources_beside_the_package_hold_the_demo_model_and_presets():
    assert (resource("demo") / "config.json").is_file()
    assert resource("hardware", "presets.json").is_file()
    assert resource("prompts", "calibration.json").is_file()


def test_resources_folder_can_be_moved(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_RESOURCES", str(tmp_path))
    assert resources_dir() == tmp_path
    assert resource("demo") == tmp_path / "demo"
