from pathlib import Path

import pytest

from gateway.errors import BadRequest, ModelNotFound, UnknownTask
from gateway.routing.table import TableError, load_table, parse_table

ROOT = Path(__file__).resolve().parents[2]

MINIMAL = """
defaults: {max_tokens: 4096, timeouts: {connect: 3}}
presets:
  dense:
    served_model: big
    aliases: [coder]
    replicas: [{name: d0, url: "http://127.0.0.1:1", engine: vllm}]
  vision:
    served_model: vl
    vision: true
    timeouts: {read: 60}
    replicas: [{name: v0, url: "http://127.0.0.1:2", engine: llamacpp}]
tasks: {code: dense, look: vision}
routing: {default: dense, images: vision}
"""


def test_shipped_routes_yaml_loads_and_has_the_example_fleet() -> None:
    table = load_table(ROOT / "routes.yaml")
    assert {"dense", "moe", "vision", "small", "swift"} <= set(table.presets)
    engines = {r.engine for p in table.presets.values() for r in p.replicas}
    assert engines == {"vllm", "llamacpp"}
    assert max(len(p.replicas) for p in table.presets.values()) >= 2
    assert table.presets["swift"].timeouts.read == 7200
    assert table.presets["swift"].timeouts.connect == 5  # inherited key by key


def test_defaults_are_inherited_and_overridden_key_by_key() -> None:
    table = parse_table(MINIMAL)
    dense, vision = table.presets["dense"], table.presets["vision"]
    assert dense.max_tokens == 4096 and dense.min_max_tokens == 1024 and dense.thinking is False
    assert dense.timeouts.connect == 3 and dense.timeouts.read == 1800
    assert vision.timeouts.connect == 3 and vision.timeouts.read == 60


@pytest.mark.parametrize(
    ("model", "task", "images", "preset", "reason"),
    [
        ("dense", None, False, "dense", "model"),
        ("coder", None, False, "dense", "alias"),
        ("CODER", None, False, "dense", "alias"),
        ("big", None, False, "dense", "alias"),  # the served name works when unambiguous
        (None, None, False, "dense", "default"),
        ("auto", None, False, "dense", "default"),
        (None, "look", False, "vision", "task"),
        ("auto", "code", False, "dense", "task"),
        ("coder", "look", False, "dense", "alias"),  # an explicit model wins over the task
        (None, None, True, "vision", "images"),
        ("vision", None, True, "vision", "model"),
    ],
)
def test_resolution_order(
    model: str | None, task: str | None, images: bool, preset: str, reason: str
) -> None:
    route = parse_table(MINIMAL).resolve(model, task, images)
    assert (route.preset.name, route.reason) == (preset, reason)


def test_unknown_model_is_404_naming_the_valid_ones() -> None:
    with pytest.raises(ModelNotFound) as caught:
        parse_table(MINIMAL).resolve("gpt-9", None, False)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    assert "coder" in caught.value.message and "dense" in caught.value.message


def test_unknown_task_is_400() -> None:
    with pytest.raises(UnknownTask) as caught:
        parse_table(MINIMAL).resolve(None, "poetry", False)
    assert caught.value.status == 400 and "code" in caught.value.message


def test_images_without_a_vision_preset_are_400() -> None:
    text = MINIMAL.replace("routing: {default: dense, images: vision}", "routing: {default: dense}")
    with pytest.raises(BadRequest) as caught:
        parse_table(text).resolve(None, None, True)
    assert caught.value.code == "images_not_supported"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("served_model: big", "served_model: big\n    colour: red"), "presets.dense.colour: unknown key"),
        (("engine: vllm", "engine: vlm"), "presets.dense.replicas[0].engine"),
        (("code: dense", "code: nope"), "tasks.code: 'nope' is not a preset"),
        (("default: dense", "default: ghost"), "routing.default: 'ghost' is not a preset"),
        (("aliases: [coder]", "aliases: [coder, vision]"), "'vision' is already used by preset 'vision'"),
        (("name: v0", "name: d0"), "'d0' is already a different replica of preset 'dense'"),
        (('"http://127.0.0.1:1"', '"ftp://x"'), "must be an http:// or https:// URL"),
        (('"http://127.0.0.1:1"', '"http://127.0.0.1:1/v1"'), "without a path"),
        (("vision: true", "vision: false"), "routing.images: preset 'vision' needs `vision: true`"),
        (("timeouts: {connect: 3}", "timeouts: {conect: 3}"), "defaults.timeouts.conect: unknown key"),
        (("max_tokens: 4096", "max_tokens: -1"), "defaults.max_tokens"),
        (("defaults: {max_tokens: 4096", "defaults: {policy: fastest, max_tokens: 4096"), "defaults.policy"),
    ],
)
def test_invalid_tables_name_the_file_the_key_and_the_fix(change: tuple[str, str], expected: str) -> None:
    old, new = change
    assert old in MINIMAL
    text = MINIMAL.replace(old, new, 1)
    with pytest.raises(TableError) as caught:
        parse_table(text, "fleet.yaml")
    assert str(caught.value).startswith("fleet.yaml: ")
    assert expected in str(caught.value)


def test_a_preset_needs_replicas_or_discovery() -> None:
    text = MINIMAL.replace(
        'replicas: [{name: v0, url: "http://127.0.0.1:2", engine: llamacpp}]', "replicas: []"
    )
    with pytest.raises(TableError, match=r"presets\.vision: list `replicas` or set `discover`"):
        parse_table(text)


@pytest.mark.parametrize("text", ["", "- a list", "presets: [", "presets: {}\nrouting: {default: x}"])
def test_unusable_files_fail_clearly(text: str) -> None:
    with pytest.raises(TableError):
        parse_table(text, "bad.yaml")


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(TableError, match=r"nothing\.yaml: cannot read"):
        load_table(tmp_path / "nothing.yaml")


def test_one_server_may_serve_several_presets_under_one_name() -> None:
    text = MINIMAL.replace(
        "tasks: {code: dense, look: vision}",
        """  dense-think:
    served_model: big
    thinking: true
    replicas: [{name: d0, url: "http://127.0.0.1:1", engine: vllm}]
tasks: {code: dense, look: vision}""",
    )
    table = parse_table(text)
    assert table.presets["dense-think"].replicas == table.presets["dense"].replicas


def test_a_bare_yaml_off_means_off() -> None:
    text = MINIMAL.replace("defaults: {", "defaults: {prefix: {volatile: off}, ")
    assert parse_table(text).presets["dense"].prefix.volatile == "off"


def test_params_must_be_json_values() -> None:
    text = MINIMAL.replace("served_model: big", "served_model: big\n    params: {seed: 18446744073709551616}")
    with pytest.raises(TableError, match=r"presets\.dense\.params: Value error, must hold JSON values only"):
        parse_table(text)


# --- launched replicas ----------------------------------------------------------------------------

LAUNCHED = """
devices: {gpu0: 48}
preload: [a]
presets:
  a:
    served_model: a
    replicas:
      - {name: a0, url: "http://127.0.0.1:9001", engine: vllm, launch: {cmd: [vllm, serve, x]}, uses: {gpu0: 30}}
routing: {default: a}
"""


def test_launch_keys_load_with_their_defaults() -> None:
    table = parse_table(LAUNCHED)
    spec = table.presets["a"].replicas[0]
    assert spec.launch is not None and spec.launch.cmd == ["vllm", "serve", "x"]
    assert (spec.launch.grace, spec.launch.load_timeout, spec.idle_unload, spec.keep) == (30, 900, 0, False)
    assert table.devices == {"gpu0": 48} and table.preload == ("a",)
    assert table.presets["a"].timeouts.load == 600
    assert table.restarts.max_failures == 5 and table.restarts.window == 600


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("uses: {gpu0: 30}", "uses: {gpu9: 30}", "uses.gpu9: not a device in `devices` (gpu0)"),
        ("uses: {gpu0: 30}", "uses: {gpu0: 60}", "60 GiB is more than the device offers (48)"),
        ("preload: [a]", "preload: [zz]", "preload[0]: 'zz' is not a preset"),
        ("127.0.0.1:9001", "10.0.0.5:9001", "a launched replica listens on this machine"),
        ("launch: {cmd: [vllm, serve, x]}, ", "", "uses: only for a replica the gateway launches"),
        (
            "engine: vllm, launch: {cmd: [vllm, serve, x]}",
            "engine: llamacpp, launch: {cmd: [x], sleep: true}",
            "only vLLM has a sleep mode",
        ),
        ("cmd: [vllm, serve, x]", "cmd: []", "launch.cmd"),
    ],
)
def test_invalid_launch_keys_are_refused_with_the_fix(old: str, new: str, expected: str) -> None:
    with pytest.raises(TableError) as caught:
        parse_table(LAUNCHED.replace(old, new))
    assert expected in str(caught.value), str(caught.value)
