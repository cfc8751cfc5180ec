"""Registry: lazy entries, entry points, did-you-mean, parameters from signatures."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from oled import registry as reg
from oled.registry import ComponentImportError, Registry, UnknownComponentError

MODULE = '''
class Widget:
    """A widget for tests.

    More text.
    """

    def __init__(self, *, size: int = 3, name: str = "w", ratio: float | None = None) -> None:
        self.size = size
'''


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir on sys.path holding the module `oled_test_widgets`."""
    (tmp_path / "oled_test_widgets.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("oled_test_widgets", None)


def test_lazy_entry_imported_on_first_use(module_dir: Path) -> None:
    widgets: Registry[type] = Registry("widget")
    widgets.register("plain", "oled_test_widgets:Widget")
    assert "oled_test_widgets" not in sys.modules
    assert widgets.target("plain") == "oled_test_widgets:Widget"
    assert "plain" in widgets and not widgets.is_loaded("plain")
    assert "oled_test_widgets" not in sys.modules
    cls = widgets.get("plain")
    assert cls.__name__ == "Widget" and widgets.is_loaded("plain")
    assert widgets.build("plain", size=5).size == 5


def test_params_from_signature(module_dir: Path) -> None:
    widgets: Registry[type] = Registry("widget")
    widgets.register("plain", "oled_test_widgets:Widget")
    params = {p.name: p for p in widgets.params("plain")}
    assert list(params) == ["size", "name", "ratio"]
    assert params["size"].annotation is int and params["size"].default == 3
    assert params["ratio"].annotation == float | None and not params["ratio"].required
    info = widgets.info("plain")
    assert info.summary == "A widget for tests." and info.target == "oled_test_widgets:Widget"


def test_required_param() -> None:
    def factory(*, rate: float, seed: int = 0) -> None:
        """Makes nothing."""

    widgets: Registry[object] = Registry("widget")
    widgets.register("f", factory)
    rate, seed = widgets.params("f")
    assert rate.required and not seed.required
    assert widgets.target("f").endswith(":test_required_param.<locals>.factory")


def test_did_you_mean() -> None:
    with pytest.raises(
        UnknownComponentError, match=r"unknown retention 'lur' \(did you mean 'lru'\?\)"
    ):
        reg.registry("retention").get("lur")
    with pytest.raises(UnknownComponentError, match=r"did you mean 'retention'"):
        reg.registry("retension")
    with pytest.raises(UnknownComponentError) as info:
        reg.registry("compensation").target("zzzzzz")
    assert str(info.value) == "unknown compensation 'zzzzzz'"


def test_broken_target_is_a_clear_error() -> None:
    widgets: Registry[object] = Registry("widget")
    widgets.register("gone", "oled_no_such_module:Thing")
    assert widgets.names() == ["gone"]
    with pytest.raises(ComponentImportError, match="cannot import oled_no_such_module:Thing"):
        widgets.get("gone")


def test_builtin_names_are_lazy() -> None:
    retention = reg.registry("retention")
    for name in ("lru", "lfu", "score_ema", "confidence"):
        assert retention.target(name).startswith("oled.policies.retention:")
    assert set(reg.registry("allocation").names()) >= {"uniform", "adaptive"}
    compensation = {"transfer_only", "cpu_only", "batch_threshold", "makespan", "cooperative"}
    compensation |= {"interval_refresh", "static_hot"}
    assert set(reg.registry("compensation").names()) >= compensation
    assert "tiny" in reg.registry("model") and "short" in reg.registry("workload")


def test_builtins_are_registered_where_defined() -> None:
    from oled.experiment.workload import short_prompts
    from oled.policies.retention import LRURetention

    assert reg.get("retention", "lru") is LRURetention
    assert reg.get("workload", "short") is short_prompts


def test_component_checks_the_kind() -> None:
    with pytest.raises(
        TypeError, match=r"retention 'not_a_policy': .*NotAPolicy is not RetentionPolicy"
    ):

        @reg.component("retention", "not_a_policy")
        class NotAPolicy:
            pass

    assert "not_a_policy" not in reg.registry("retention")
    with pytest.raises(TypeError, match="workload 'nothing': .* is not a callable"):
        reg.component("workload", "nothing")(42)


def test_register_module_function(components: dict) -> None:
    assert reg.get("retention", "keep_recent") is components["retention"]["keep_recent"]
    reg.register("retention", "keep_again", "tests.conftest:KeepRecent")
    try:
        assert [p.name for p in reg.params("retention", "keep_again")] == [
            "threshold",
            "window",
            "name",
        ]
    finally:
        reg.registry("retention").unregister("keep_again")


def test_entry_point_plugin(tmp_path: Path, module_dir: Path, monkeypatch) -> None:
    dist = tmp_path / "oled_test_widgets-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: oled-test-widgets\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[oled.retention]\nwidget_keep = oled_test_widgets:Widget\n"
    )
    retention = reg.registry("retention")
    try:
        assert "widget_keep" in retention.names()
        assert "oled_test_widgets" not in sys.modules
        assert retention.get("widget_keep").__name__ == "Widget"
        with pytest.raises(UnknownComponentError, match="did you mean 'widget_keep'"):
            retention.get("widget_kep")
    finally:
        retention.unregister("widget_keep")
        retention._scanned.discard("widget_keep")


def test_importing_oled_is_light() -> None:
    import subprocess

    code = "import sys, oled, oled.recipe, oled.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
