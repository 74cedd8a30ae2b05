import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.core import project as projmod
from workbench.core.errors import ProjectFileError
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, Assignment, Placement
from workbench.core.project import (
    SCHEMA_VERSION,
    Project,
    backup_path,
    load_project,
    open_project_model,
    relink,
    save_project,
)
from workbench.core.readers import open_model
from workbench.core.stats import ExpertStats
from workbench.core.units import UnitKey

from .profiles import desktop_profile
from .synth_inventory import synth_inventory


def _project(inv, seed=0):
    rng = np.random.default_rng(seed)
    p = Placement(stream_slots=int(rng.integers(0, 4)))
    for key in inv.expert_keys():
        r = rng.random()
        if r < 0.3:
            p.set(key, CPU_COMPUTE)
        elif r < 0.4:
            p.set(key, CPU_STREAM)
        elif r < 0.45:
            p.set(key, Assignment("gpu:1"))
    stats = ExpertStats.for_spec(inv.spec)
    stats.add(rng.integers(0, 100, size=stats.shape).astype(float))
    return Project.for_model(inv, p, desktop_profile(), stats, {"chat": {"system": "be brief", "temperature": 0.7},
                                                                "ctx": 8192})


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 12))
def test_save_load_identical(tmp_path, seed, n_layers, n_experts):
    inv = synth_inventory(n_layers, n_experts, top_k=1)
    proj = _project(inv, seed)
    path = tmp_path / f"p{seed}-{n_layers}-{n_experts}.json"
    proj.save(path)
    back = load_project(path)
    assert back.placement == proj.placement
    assert back.placement.stream_slots == proj.placement.stream_slots
    assert back.stats == proj.stats
    assert back.hardware == proj.hardware
    assert back.settings == proj.settings
    assert back.fingerprint == proj.fingerprint and back.model_path == proj.model_path
    assert back.model_info == proj.model_info
    first = json.loads(path.read_text())
    back.save(path)  # a second save writes the same document (but the time)
    second = json.loads(path.read_text())
    first.pop("saved_at"), second.pop("saved_at")
    assert first == second


def test_atomic_save_keeps_one_backup(tmp_path):
    inv = synth_inventory(2, 4)
    path = tmp_path / "p.json"
    a = _project(inv, 1)
    a.save(path)
    assert not backup_path(path).exists()
    b = _project(inv, 2)
    b.save(path)
    assert load_project(backup_path(path)).placement == a.placement
    assert load_project(path).placement == b.placement
    c = _project(inv, 3)
    c.save(path)
    assert load_project(backup_path(path)).placement == b.placement  # one backup: the previous file
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.json", "p.json.bak"]  # no temp files left


def test_corrupt_file_is_a_clear_error_and_the_backup_survives(tmp_path):
    inv = synth_inventory(2, 4)
    path = tmp_path / "p.json"
    _project(inv, 1).save(path)
    _project(inv, 2).save(path)
    good_backup = backup_path(path).read_bytes()
    path.write_text('{"schema_version": 1, "model": {"pa')  # truncated by a crash elsewhere
    with pytest.raises(ProjectFileError, match=r"corrupt .*backup .* is intact"):
        load_project(path)
    assert backup_path(path).read_bytes() == good_backup
    _project(inv, 3).save(path)  # saving over the corrupt file does not rotate it into the backup
    assert backup_path(path).read_bytes() == good_backup
    assert load_project(backup_path(path)).placement == _project(inv, 1).placement


def test_unknown_and_old_versions(tmp_path, monkeypatch):
    inv = synth_inventory(2, 4)
    path = tmp_path / "p.json"
    doc = _project(inv).to_json(path)
    doc["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(doc))
    with pytest.raises(ProjectFileError, match="newer workbench"):
        load_project(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ProjectFileError, match="not a workbench project"):
        load_project(path)
    path.write_text("[1, 2]")
    with pytest.raises(ProjectFileError, match="not a workbench project"):
        load_project(path)
    # an older schema goes through the registered migrations, in order
    old = _project(inv).to_json(path)
    old["schema_version"] = SCHEMA_VERSION - 1
    old["layout"] = old.pop("placement")  # what the previous schema is pretended to call it
    path.write_text(json.dumps(old))
    with pytest.raises(ProjectFileError, match="cannot upgrade"):
        load_project(path)
    monkeypatch.setitem(projmod.MIGRATIONS, SCHEMA_VERSION - 1,
                        lambda d: {**{k: v for k, v in d.items() if k != "layout"}, "placement": d["layout"]})
    assert load_project(path).placement == _project(inv).placement
    doc = _project(inv).to_json(path)
    del doc["model"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ProjectFileError, match="malformed"):
        load_project(path)
    with pytest.raises(ProjectFileError, match="no project file"):
        load_project(tmp_path / "missing.json")


def test_model_moved_changed_and_relinked(tmp_path, tiny_gguf):
    src = tiny_gguf("qwen3_moe")
    models = tmp_path / "models"
    models.mkdir()
    model = models / "m.gguf"
    shutil.copy(src, model)
    inv = open_model(model)
    proj_dir = tmp_path / "work"
    proj_dir.mkdir()
    p = Placement()
    p.set(inv.expert_keys()[0], CPU_COMPUTE)
    saved = save_project(proj_dir / "p.json", inv, p, settings={"chat": {}})
    assert open_project_model(load_project(proj_dir / "p.json")).fingerprint == inv.fingerprint

    # moved together with the project: found through the relative path
    moved_root = tmp_path / "elsewhere"
    moved_root.mkdir()
    shutil.move(str(tmp_path / "models"), moved_root / "models")
    shutil.move(str(proj_dir), moved_root / "work")
    proj = load_project(moved_root / "work" / "p.json")
    assert open_project_model(proj).fingerprint == saved.fingerprint
    assert proj.model_path == (moved_root / "models" / "m.gguf").resolve()

    # moved alone: a clear error, then relink
    lone = tmp_path / "lone.gguf"
    shutil.move(str(moved_root / "models" / "m.gguf"), lone)
    proj = load_project(moved_root / "work" / "p.json")
    with pytest.raises(ProjectFileError, match="moved or deleted; relink"):
        open_project_model(proj)
    relink(proj, lone)
    proj.save(moved_root / "work" / "p.json")
    assert open_project_model(load_project(moved_root / "work" / "p.json")).path.resolve() == lone.resolve()

    # a different model at the same place: refused until accepted, placement checked against it
    other = tiny_gguf("qwen3_moe", num_experts=4)
    shutil.copy(other, lone)
    proj = load_project(moved_root / "work" / "p.json")
    with pytest.raises(ProjectFileError, match="changed since the project was saved"):
        open_project_model(proj)
    with pytest.raises(ProjectFileError, match="not the model this project was made for"):
        relink(proj, lone)
    proj.placement.set(UnitKey(0, "expert", 7), CPU_COMPUTE)  # expert 7 does not exist in a 4-expert model
    with pytest.raises(ProjectFileError, match="does not fit"):
        relink(proj, lone, accept_changed=True)
    proj.placement = Placement()
    new = relink(proj, lone, accept_changed=True)
    assert proj.fingerprint == new.fingerprint


def test_save_into_missing_folder_is_a_clear_error(tmp_path):
    inv = synth_inventory(2, 4)
    with pytest.raises(ProjectFileError, match="does not exist"):
        _project(inv).save(tmp_path / "nope" / "p.json")
