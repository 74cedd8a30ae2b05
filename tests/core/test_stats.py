import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.core.errors import WorkbenchError
from workbench.core.stats import ExpertStats


def _skewed(n_layers=3, n_experts=8, top_k=2, tokens=1000, seed=0):
    rng = np.random.default_rng(seed)
    s = ExpertStats(n_layers, n_experts, top_k)
    sel = np.empty((tokens, n_layers, top_k), dtype=np.int64)
    for layer in range(n_layers):
        p = rng.dirichlet(np.full(n_experts, 0.3))
        for t in range(tokens):
            sel[t, layer] = rng.choice(n_experts, size=top_k, replace=False, p=p)
    s.add_selections(sel)
    return s, sel


def test_add_selections_counts_per_layer_exactly():
    s, sel = _skewed()
    for layer in range(3):
        expect = np.bincount(sel[:, layer].ravel(), minlength=8)
        assert np.array_equal(s.counts[layer], expect)
    assert s.tokens == 1000
    assert np.allclose(s.frequencies().sum(axis=1), 1.0)
    assert np.allclose(s.selection_probs().sum(axis=1), 2.0)


def test_frequencies_are_per_layer_not_pooled():
    s = ExpertStats(2, 4, 1)
    s.add(np.array([[100, 0, 0, 0], [0, 0, 0, 1]]))
    f = s.frequencies()
    assert f[0, 0] == 1.0 and f[1, 3] == 1.0  # layer 1's single pick weighs as much as layer 0's 100


def test_uniform_without_counts_and_dense_rows():
    s = ExpertStats(3, 4, 2)
    s.add(np.array([[1, 1, 2, 0], [0, 0, 0, 0], [3, 0, 0, 1]]))
    assert np.allclose(s.frequencies()[1], 0.25)
    assert not s.has_counts(1) and s.has_counts(0)


def test_recent_view_decays_by_half_life():
    s = ExpertStats(1, 2, 1, half_life=10)
    s.add(np.array([[10.0, 0.0]]))
    s.add(np.array([[0.0, 10.0]]))
    assert s.recent[0, 0] == pytest.approx(5.0)  # one half-life later
    assert s.recent[0, 1] == pytest.approx(10.0)
    assert np.array_equal(s.counts, [[10, 10]])
    assert s.frequencies(recent=True)[0, 1] > 0.6


def test_coverage_entropy_gini():
    s = ExpertStats(2, 4, 1)
    s.add(np.array([[5, 3, 1, 1], [1, 1, 1, 1]]))
    assert np.allclose(s.coverage(0), [0.5, 0.8, 0.9, 1.0])
    assert np.allclose(s.coverage_curves(), [s.coverage(0), s.coverage(1)])
    assert s.experts_for_coverage(0, 0.5) == 1
    assert s.experts_for_coverage(0, 0.75) == 2
    assert s.experts_for_coverage(1, 0.5) == 2
    assert list(s.hottest(0)[:2]) == [0, 1]
    h = s.entropy()
    assert h[1] == pytest.approx(1.0) and 0 < h[0] < 1
    g = s.gini()
    assert g[1] == pytest.approx(0.0) and g[0] > 0.2
    one = ExpertStats(1, 4, 1)
    one.add(np.array([[0, 7, 0, 0]]))
    assert one.entropy()[0] == pytest.approx(0.0)
    assert one.gini()[0] == pytest.approx(0.75)  # (n-1)/n for full concentration


def test_merge_adds_and_checks_shape():
    a, _ = _skewed(seed=1)
    b, _ = _skewed(seed=2)
    m = a.merge(b)
    assert np.array_equal(m.counts, a.counts + b.counts)
    assert m.tokens == 2000
    with pytest.raises(ValueError):
        a.merge(ExpertStats(2, 8, 2))


def test_bad_input_is_refused():
    s = ExpertStats(2, 3, 1)
    with pytest.raises(ValueError):
        s.add(np.zeros((3, 3)))
    with pytest.raises(ValueError):
        s.add(np.array([[1, -1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError):
        s.add_selections(np.array([[[5], [0]]]))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 3), st.data())
def test_json_roundtrip(n_layers, n_experts, top_k, data):
    s = ExpertStats(n_layers, n_experts, top_k, half_life=7.5)
    for _ in range(data.draw(st.integers(0, 3))):
        rows = data.draw(st.lists(st.lists(st.integers(0, 50) | st.floats(0, 1e6), min_size=n_experts,
                                           max_size=n_experts), min_size=n_layers, max_size=n_layers))
        s.add(np.array(rows, dtype=np.float64))
    back = ExpertStats.from_json(json.loads(json.dumps(s.to_json())))
    assert back == s
    assert back.half_life == 7.5


def test_load_errors_are_clear(tmp_path):
    p = tmp_path / "s.json"
    with pytest.raises(WorkbenchError, match="no expert stats"):
        ExpertStats.load(p)
    p.write_text("{not json")
    with pytest.raises(WorkbenchError, match="cannot read"):
        ExpertStats.load(p)
    p.write_text(json.dumps({"n_layers": 2, "n_experts": 2, "counts": [[1, 2]]}))
    with pytest.raises(WorkbenchError, match="shape"):
        ExpertStats.load(p)
    s, _ = _skewed()
    s.save(p)
    assert ExpertStats.load(p) == s
