"""mig-parted v1 configs, as specifications: what parses (YAML and JSON, every spelling the format
allows), every rejection rule with the field it names, which GPUs an entry selects, the export
-> parse -> select round trip, and that generate-config's standard configs of the real H100
table are all placeable."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest
import yaml

from agent.api.problems import problem_of
from agent.errors import InvalidRequest
from agent.gpu.sim.presets import PRESETS
from agent.gpu.types import Placement
from agent.mig.geometry import (
    Catalog,
    Desired,
    DesiredDisabled,
    DesiredInstances,
    DesiredProfiles,
    Geometry,
    Instance,
    ProfileSpec,
)
from agent.mig.parted_config import (
    NOT_MIG_CAPABLE,
    DeviceFilter,
    GpuIdentity,
    MigConfigFile,
    check_profiles,
    config_label,
    normalize_profile,
    parse_config,
    profile_name_problem,
    select,
    selection,
)
from agent.mig.parted_export import export_config, standard_configs
from agent.mig.planner import plan
from tests.mig.catalogs import A100_40GB, H100_80GB, all_layouts

H100 = 0x233010DE  # H100 SXM5 80GB, as NVML's pciDeviceId
A100 = 0x20B010DE  # A100 SXM4 40GB
H100_SUB = 0x16C110DE
A100_SUB = 0x134F10DE


def h100_node(n: int = 8) -> list[GpuIdentity]:
    return [GpuIdentity(index=i, pci_device_id=H100, pci_subsystem_id=H100_SUB)
            for i in range(n)]


# A node of 4 H100s (0-3) and 2 A100s (4, 5); GPU 3 has another subsystem id.
MIXED_NODE = [
    *(GpuIdentity(i, H100, H100_SUB) for i in range(3)),
    GpuIdentity(3, H100, 0x17A610DE),
    *(GpuIdentity(i, A100, A100_SUB) for i in (4, 5)),
]


def entry(**fields: Any) -> dict[str, Any]:
    """An entry with dashed keys from underscored keywords; ``devices: all`` and MIG enabled
    with no devices unless given."""
    out: dict[str, Any] = {"devices": "all", "mig-enabled": True, "mig-devices": {}}
    for key, value in fields.items():
        out[key.replace("_", "-")] = value
    return {k: v for k, v in out.items() if v is not ...}


def config(*entries: dict[str, Any], label: str = "x") -> dict[str, Any]:
    return {"version": "v1", "mig-configs": {label: list(entries)}}


REALISTIC = """\
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false

  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}

  all-balanced:
    # H100 SXM5 80GB
    - device-filter: "0x233010DE"
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "2g.20gb": 1
        "3g.40gb": 1
    # A100 SXM4 40GB, either subsystem
    - device-filter: ["0x20B010DE:0x134F10DE", "0x20b010de:0x145f10de"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1

  custom-per-index:
    - devices: [0, 1]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
    - devices: [2, 3]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
    - devices: [4]
      mig-enabled: false
"""


# --- parsing: what is accepted ---------------------------------------------------------------


def test_realistic_yaml_parses_with_every_label() -> None:
    """A config in the style of mig-parted's examples parses: labels in order, filters in both
    forms, per-index entries, the disabled entry without mig-devices."""
    cfg = parse_config(REALISTIC)
    assert cfg.labels == ("all-disabled", "all-enabled", "all-balanced", "custom-per-index")
    balanced = cfg.mig_configs["all-balanced"]
    assert balanced[0].device_filter == "0x233010DE"
    assert balanced[0].filters == (DeviceFilter(H100),)
    assert balanced[1].filters == (DeviceFilter(A100, A100_SUB), DeviceFilter(A100, 0x145F10DE))
    custom = cfg.mig_configs["custom-per-index"]
    assert [e.devices for e in custom] == [(0, 1), (2, 3), (4,)]
    assert custom[2].mig_enabled is False and custom[2].mig_devices is None
    assert cfg.mig_configs["all-enabled"][0].mig_devices == {}


@pytest.mark.parametrize(("name", "entry_"), [
    ("devices all", entry()),
    ("devices list", entry(devices=[0, 1, 7])),
    ("devices empty list (matches nothing)", entry(devices=[])),
    ("filter string", entry(device_filter="0x233010DE")),
    ("filter lower case", entry(device_filter="0x233010de")),
    ("filter 0X prefix", entry(device_filter="0X233010DE")),
    ("filter with subsystem", entry(device_filter="0x233010DE:0x16C110DE")),
    ("filter list", entry(device_filter=["0x233010DE", "0x20B010DE:0x134F10DE"])),
    ("filter null", entry(device_filter=None)),
    ("disabled without mig-devices", entry(mig_enabled=False, mig_devices=...)),
    ("disabled with empty mig-devices", entry(mig_enabled=False, mig_devices={})),
    ("enabled, no devices", entry(mig_devices={})),
    ("counts", entry(mig_devices={"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})),
    ("a zero count among others", entry(mig_devices={"1g.10gb": 0, "7g.80gb": 1})),
    ("media extensions", entry(mig_devices={"1g.10gb+me": 1})),
    ("compute-instance sub-profile", entry(mig_devices={"1c.3g.40gb": 3})),
    ("several attributes", entry(mig_devices={"1g.24gb+me,gfx": 1, "1g.24gb+me.all": 1})),
    ("excluded attribute", entry(mig_devices={"1g.12gb-me": 1, "4g.96gb+gfx": 1})),
])
def test_valid_entries(name: str, entry_: dict[str, Any]) -> None:
    """Every spelling the v1 format allows parses, from a JSON object and from YAML text, and
    writes back as the same config."""
    source = config(entry_)
    cfg = parse_config(source)
    assert parse_config(yaml.safe_dump(source)) == cfg
    assert parse_config(json.dumps(source)) == cfg
    assert parse_config(cfg.to_dict()) == cfg
    want = {k: v for k, v in entry_.items() if v is not None}
    assert cfg.to_dict()["mig-configs"]["x"][0] == want


def test_to_dict_writes_the_mig_parted_spelling() -> None:
    """Dashed keys, absent fields left out, lists as lists: what mig-parted reads."""
    cfg = parse_config(REALISTIC)
    out = cfg.to_dict()
    assert out["version"] == "v1"
    assert out["mig-configs"]["custom-per-index"][0] == {
        "devices": [0, 1], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}}
    assert out["mig-configs"]["all-disabled"] == [{"devices": "all", "mig-enabled": False}]
    assert parse_config(yaml.safe_dump(out)) == cfg


# --- parsing: every rejection rule -----------------------------------------------------------

E = "mig-configs.x[0]"


@pytest.mark.parametrize(("source", "field", "reason"), [
    # the document
    ("", "config", "empty"),
    ("- 1\n- 2\n", "config", "mapping"),
    ("just text", "config", "mapping"),
    ("version: v1\nmig-configs: {x: [", "config", "line 2"),
    ("version: v1\n\tmig-configs: {}\n", "config", "line 2"),
    ("version: v1\nmig-configs:\n  x: []\n  x: []\n", "config", "duplicate key 'x'"),
    # top level
    ({"mig-configs": config(entry())["mig-configs"]}, "version", "required"),
    ({**config(entry()), "version": "v2"}, "version", "only \"v1\""),
    ({**config(entry()), "version": 1}, "version", "unsupported version"),
    ({"version": "v1"}, "mig-configs", "required"),
    ({"version": "v1", "mig-configs": {}}, "mig-configs", "at least one label"),
    ({"version": "v1", "mig-configs": []}, "mig-configs", "mapping"),
    ({"version": "v1", "mig-configs": {"": [entry()]}}, "mig-configs", "label ''"),
    ({"version": "v1", "mig-configs": {1: [entry()]}}, "mig-configs", "label 1"),
    ({**config(entry()), "kind": "x"}, "kind", "unknown field"),
    ({"version": "v1", "mig-configs": {"x": []}}, "mig-configs.x", "at least one entry"),
    ({"version": "v1", "mig-configs": {"x": entry()}}, "mig-configs.x", "list"),
    (config("all"), E, "mapping"),
    # devices
    (config(entry(devices=...)), f"{E}.devices", "required"),
    (config(entry(devices=0)), f"{E}.devices", "bare number"),
    (config(entry(devices="0")), f"{E}.devices", '"all"'),
    (config(entry(devices="ALL")), f"{E}.devices", '"all"'),
    (config(entry(devices={"0": 1})), f"{E}.devices", "list of GPU indices"),
    (config(entry(devices=[-1])), f"{E}.devices", "-1 is not a GPU index"),
    (config(entry(devices=["0"])), f"{E}.devices", "'0' is not a GPU index"),
    (config(entry(devices=[True])), f"{E}.devices", "True is not a GPU index"),
    (config(entry(devices=[1.0])), f"{E}.devices", "1.0 is not a GPU index"),
    (config(entry(devices=[0, 1, 0])), f"{E}.devices", "GPU 0 listed more than once"),
    # device-filter
    (config(entry(device_filter="0x2330")), f"{E}.device-filter", "'0x2330' is not a PCI id"),
    (config(entry(device_filter="233010DE")), f"{E}.device-filter", "not a PCI id"),
    (config(entry(device_filter="0x233010DG")), f"{E}.device-filter", "not a PCI id"),
    (config(entry(device_filter="0x233010DE:")), f"{E}.device-filter", "not a PCI id"),
    (config(entry(device_filter="0x233010DE:0x16C1")), f"{E}.device-filter", "not a PCI id"),
    (config(entry(device_filter="0x233010DE:0x16C110DE:0x1")), f"{E}.device-filter",
     "not a PCI id"),
    (config(entry(device_filter=[])), f"{E}.device-filter", "at least one PCI id"),
    (config(entry(device_filter=["0x233010DE", "nope"])), f"{E}.device-filter",
     "'nope' is not a PCI id"),
    (config(entry(device_filter=[["0x233010DE"]])), f"{E}.device-filter", "not a PCI id"),
    (config(entry(device_filter={"id": "0x233010DE"})), f"{E}.device-filter", "PCI id"),
    (config(entry(device_filter=True)), f"{E}.device-filter", "PCI id"),
    ("version: v1\nmig-configs: {x: [{devices: all, device-filter: 0x233010DE, "
     "mig-enabled: false}]}", f"{E}.device-filter", 'quote the PCI id: "0x233010DE"'),
    # mig-enabled
    (config(entry(mig_enabled=...)), f"{E}.mig-enabled", "required"),
    (config(entry(mig_enabled="true")), f"{E}.mig-enabled", "true or false"),
    (config(entry(mig_enabled=1)), f"{E}.mig-enabled", "true or false"),
    # mig-devices
    (config(entry(mig_devices=...)), f"{E}.mig-devices", "required when mig-enabled is true"),
    (config(entry(mig_devices=None)), f"{E}.mig-devices", "required when mig-enabled is true"),
    (config(entry(mig_enabled=False, mig_devices={"1g.10gb": 1})), f"{E}.mig-devices",
     "must be empty or absent when mig-enabled is false"),
    (config(entry(mig_devices=["1g.10gb"])), f"{E}.mig-devices", "mapping"),
    (config(entry(mig_devices={"1g.10gb": -1})), f"{E}.mig-devices",
     "count of 1g.10gb must be a whole number ≥ 0, got -1"),
    (config(entry(mig_devices={"1g.10gb": "2"})), f"{E}.mig-devices", "got '2'"),
    (config(entry(mig_devices={"1g.10gb": True})), f"{E}.mig-devices", "got True"),
    (config(entry(mig_devices={"1g.10gb": 1.5})), f"{E}.mig-devices", "got 1.5"),
    (config(entry(mig_devices={"1g.10gb": 0, "3g.40gb": 0})), f"{E}.mig-devices",
     "all counts are 0"),
    (config(entry(mig_devices={"1g.10GB": 1})), f"{E}.mig-devices", "is not a MIG profile"),
    (config(entry(mig_devices={"10gb": 1})), f"{E}.mig-devices", "is not a MIG profile"),
    (config(entry(mig_devices={"0g.10gb": 1})), f"{E}.mig-devices", "is not a MIG profile"),
    (config(entry(mig_devices={"1g.10gb ": 1})), f"{E}.mig-devices", "is not a MIG profile"),
    (config(entry(mig_devices={"1c.1g.1c.10gb": 1})), f"{E}.mig-devices",
     "is not a MIG profile"),
    (config(entry(mig_devices={"1g.10gb+": 1})), f"{E}.mig-devices", "is not a MIG profile"),
    (config(entry(mig_devices={"1g.10gb+me,": 1})), f"{E}.mig-devices", "is not a MIG profile"),
    (config(entry(mig_devices={"1g.10gb+foo": 1})), f"{E}.mig-devices",
     "unknown attribute 'foo'"),
    (config(entry(mig_devices={"1g.10gb-foo": 1})), f"{E}.mig-devices",
     "unknown attribute 'foo'"),
    (config(entry(mig_devices={"1g.10gb+me,me": 1})), f"{E}.mig-devices",
     "repeats an attribute"),
    ("version: v1\nmig-configs: {x: [{devices: all, mig-enabled: true, "
     "mig-devices: {1: 1}}]}", f"{E}.mig-devices", "1 is not a MIG profile"),
    # unknown keys in an entry, including the underscored spelling of a known one
    (config(entry(mig_device={"1g.10gb": 1})), f"{E}.mig-device", "unknown field"),
    ({"version": "v1", "mig-configs": {"x": [{"devices": "all", "mig_enabled": False,
                                              "mig-enabled": False}]}},
     f"{E}.mig_enabled", "unknown field"),
])
def test_rejections_name_the_field(source: Any, field: str, reason: str) -> None:
    """Each rule of the v1 format is an InvalidRequest whose errors name the offending field by
    its path in the config and say why."""
    with pytest.raises(InvalidRequest) as caught:
        parse_config(source)
    errors = caught.value.errors
    assert any(e["field"] == field and reason in e["reason"] for e in errors), errors
    assert problem_of(caught.value).status == 422
    assert field in caught.value.detail


def test_every_problem_is_listed_at_once() -> None:
    """Problems in different fields and entries are reported together, one error each."""
    source = {"version": "v1", "mig-configs": {
        "a": [entry(devices=1), entry(mig_devices={"9z": 1}, colour="red")],
        "b": []}}
    with pytest.raises(InvalidRequest) as caught:
        parse_config(source)
    fields = {e["field"] for e in caught.value.errors}
    assert fields == {"mig-configs.a[0].devices", "mig-configs.a[1].mig-devices",
                      "mig-configs.a[1].colour", "mig-configs.b"}


def test_non_mapping_sources_are_invalid_requests() -> None:
    """A parsed JSON body that is no object is rejected like bad YAML, not with a TypeError."""
    bad: Any = ["version", "v1"]
    with pytest.raises(InvalidRequest, match="mapping"):
        parse_config(bad)


@pytest.mark.parametrize(("name", "problem"), [
    ("1g.10gb", None), ("7g.80gb", None), ("1c.7g.80gb", None), ("1g.10gb+me", None),
    ("1g.10gb+me.all", None), ("4g.96gb+gfx", None), ("1g.12gb-me", None),
    ("1g.24gb+gfx,me", None), ("g.10gb", "is not a MIG profile"),
    ("1g.10gb+gfx-me", "is not a MIG profile"), ("1g.10gb-me,gfx", "is not a MIG profile"),
    ("1g.10gb+me.none", "unknown attribute"),
])
def test_profile_name_format(name: str, problem: str | None) -> None:
    found = profile_name_problem(name)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_normalize_profile_drops_a_full_size_compute_instance() -> None:
    """``Gc.Gg.Xgb`` is the plain profile (mig-parted prints it that way); a smaller compute
    instance stays as written."""
    assert normalize_profile("7c.7g.80gb") == "7g.80gb"
    assert normalize_profile("1c.1g.10gb+me") == "1g.10gb+me"
    assert normalize_profile("1c.3g.40gb") == "1c.3g.40gb"
    assert normalize_profile("3g.40gb") == "3g.40gb"


# --- selection -------------------------------------------------------------------------------


def test_device_filter_selects_by_pci_id() -> None:
    """An H100 filter picks the H100s and not the A100s, exactly (device and vendor)."""
    cfg = parse_config(config(entry(device_filter="0x233010DE",
                                    mig_devices={"3g.40gb": 2})))
    got = select(cfg, "x", MIXED_NODE)
    assert list(got) == [0, 1, 2, 3]
    assert all(d == DesiredProfiles({"3g.40gb": 2}) for d in got.values())
    cfg = parse_config(config(entry(device_filter="0x20B010DE", mig_enabled=False,
                                    mig_devices=...)))
    assert select(cfg, "x", MIXED_NODE) == {4: DesiredDisabled(), 5: DesiredDisabled()}
    cfg = parse_config(config(entry(device_filter="0x233110DE")))  # H100 PCIe: none here
    assert select(cfg, "x", MIXED_NODE) == {}


@pytest.mark.parametrize(("device_filter", "selected"), [
    ("0x233010DE:0x16C110DE", [0, 1, 2]),
    ("0x233010de:0x17a610de", [3]),
    ("0x233010DE:0x134F10DE", []),  # the A100's subsystem on an H100: no match
    (["0x233010DE:0x17A610DE", "0x20B010DE"], [3, 4, 5]),
    (["0x20B010DE:0x134F10DE"], [4, 5]),
])
def test_device_filter_with_subsystem(device_filter: Any, selected: list[int]) -> None:
    """A subsystem id in the filter must match exactly too; a list matches any of its items."""
    cfg = parse_config(config(entry(device_filter=device_filter)))
    assert list(select(cfg, "x", MIXED_NODE)) == selected


def test_realistic_config_selection() -> None:
    """Per-model entries under one label and per-index entries with different layouts."""
    cfg = parse_config(REALISTIC)
    got = select(cfg, "all-balanced", MIXED_NODE)
    assert got == {
        **dict.fromkeys(range(4), DesiredProfiles({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})),
        **dict.fromkeys((4, 5), DesiredProfiles({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})),
    }
    got = select(cfg, "custom-per-index", h100_node())
    assert got == {0: DesiredProfiles({"3g.40gb": 2}), 1: DesiredProfiles({"3g.40gb": 2}),
                   2: DesiredProfiles({"1g.10gb": 7}), 3: DesiredProfiles({"1g.10gb": 7}),
                   4: DesiredDisabled()}  # 5-7: no entry, left alone
    assert select(cfg, "all-disabled", h100_node(2)) == {0: DesiredDisabled(),
                                                         1: DesiredDisabled()}
    assert select(cfg, "all-enabled", h100_node(1)) == {0: DesiredProfiles({})}


def test_devices_and_filter_both_apply() -> None:
    """An entry selects a GPU only when its index is listed and its PCI ids pass the filter."""
    cfg = parse_config(config(entry(devices=[2, 3, 4], device_filter="0x233010DE")))
    assert list(select(cfg, "x", MIXED_NODE)) == [2, 3]


def test_selection_spells_profiles_as_the_catalog() -> None:
    """``7c.7g.80gb`` selects as ``7g.80gb``; two spellings of one profile add up; zero counts
    are kept (the planner accepts them)."""
    cfg = parse_config(config(entry(mig_devices={"1c.1g.10gb": 1, "1g.10gb": 2,
                                                  "7c.7g.80gb": 0})))
    assert select(cfg, "x", h100_node(1)) == {0: DesiredProfiles({"1g.10gb": 3,
                                                                  "7g.80gb": 0})}


def test_unknown_label_lists_the_known_ones() -> None:
    cfg = parse_config(REALISTIC)
    with pytest.raises(InvalidRequest) as caught:
        select(cfg, "all-3g.40gb", h100_node())
    assert caught.value.errors[0]["field"] == "label"
    for known in cfg.labels:
        assert known in caught.value.detail


@pytest.mark.parametrize(("entries", "field", "reason"), [
    ([entry(), entry(devices=[1])], "mig-configs.x[1]", "GPU 1 is also selected by "
                                                        "mig-configs.x[0]"),
    ([entry(devices=[0, 1]), entry(devices=[1, 2])], "mig-configs.x[1]", "GPU 1"),
    ([entry(device_filter="0x233010DE"), entry(devices=[3, 4])], "mig-configs.x[1]", "GPU 3"),
])
def test_selection_rejections(entries: list[dict[str, Any]], field: str, reason: str) -> None:
    """A GPU two entries select is an InvalidRequest naming the entry."""
    cfg = parse_config(config(*entries))
    with pytest.raises(InvalidRequest) as caught:
        select(cfg, "x", MIXED_NODE)
    errors = caught.value.errors
    assert any(e["field"] == field and reason in e["reason"] for e in errors), errors


@pytest.mark.parametrize(("devices", "selected", "missing"), [
    ([0, 9], [0], (9,)),
    ([6, 7, 8], [], (6, 7, 8)),
    ([5, 4, 12], [4, 5], (12,)),
    ("all", [0, 1, 2, 3, 4, 5], ()),
])
def test_indices_the_node_lacks_are_ignored_and_reported(
        devices: Any, selected: list[int], missing: tuple[int, ...]) -> None:
    """As in mig-parted, an index the node lacks is ignored, not a refusal of the label; the
    selection lists it."""
    chosen = selection(parse_config(config(entry(devices=devices))), "x", MIXED_NODE)
    assert list(chosen.desired) == selected
    assert chosen.missing == missing
    assert chosen.skipped == {}


def test_entries_with_disjoint_filters_do_not_overlap() -> None:
    """``devices: all`` twice is fine when the filters split the node."""
    cfg = parse_config(config(entry(device_filter="0x233010DE"),
                              entry(device_filter="0x20B010DE", mig_enabled=False,
                                    mig_devices=...)))
    got = select(cfg, "x", MIXED_NODE)
    assert [type(d) for d in got.values()] == [DesiredProfiles] * 4 + [DesiredDisabled] * 2


# --- profiles against the GPU's catalog -------------------------------------------------------


def test_check_profiles_accepts_what_the_catalogs_offer() -> None:
    cfg = parse_config(REALISTIC)
    catalogs = {i: H100_80GB for i in range(4)} | {4: A100_40GB, 5: A100_40GB}
    check_profiles(select(cfg, "all-balanced", MIXED_NODE), catalogs)
    check_profiles({0: DesiredDisabled()}, {})  # MIG off fits a GPU without MIG
    with pytest.raises(InvalidRequest, match="GPU 1 cannot do MIG"):
        check_profiles({1: DesiredProfiles({})}, {})  # MIG on does not


def test_check_profiles_names_gpu_profile_and_known_ones() -> None:
    """An A100 profile asked of an H100 is rejected naming the GPU, the profile and what the
    GPU offers; a GPU without MIG cannot take profiles; sub-profiles are called out."""
    selection: dict[int, Desired] = {
        0: DesiredProfiles({"1g.5gb": 2, "3g.40gb": 1}),
        1: DesiredProfiles({"1c.3g.40gb": 3}),
        2: DesiredInstances((("2g.10gb", Placement(start=0, size=2)),)),
        3: DesiredProfiles({"1g.10gb": 1}),
    }
    with pytest.raises(InvalidRequest) as caught:
        check_profiles(selection, {0: H100_80GB, 1: H100_80GB, 2: H100_80GB})
    errors = caught.value.errors
    assert [(e["gpu"], e.get("profile")) for e in errors] == [
        (0, "1g.5gb"), (1, "1c.3g.40gb"), (2, "2g.10gb"), (3, None)]
    assert errors[0]["known"] == list(H100_80GB.names)
    assert "GPU 0 offers no MIG profile '1g.5gb'" in errors[0]["reason"]
    assert "3g.40gb" in errors[0]["reason"] and "7g.80gb" in errors[0]["reason"]
    assert "sub-profiles" in errors[1]["reason"]
    assert errors[3]["reason"] == "GPU 3 cannot do MIG"
    assert all(e["field"] == "mig-devices" for e in errors)


def test_check_profiles_of_a_gpu_with_an_empty_catalog() -> None:
    """A GPU whose catalog lists no profile (what NVML lists for a GPU without MIG) cannot do
    MIG: the error says so, never "it offers" an empty list; MIG off still fits."""
    with pytest.raises(InvalidRequest) as caught:
        check_profiles({0: DesiredProfiles({"1g.10gb": 1}), 1: DesiredProfiles({})},
                       {0: Catalog(()), 1: Catalog(())})
    assert [e["reason"] for e in caught.value.errors] == ["GPU 0 cannot do MIG",
                                                          "GPU 1 cannot do MIG"]
    assert "offers" not in caught.value.detail
    check_profiles({0: DesiredDisabled()}, {0: Catalog(())})


# --- mig-parted's rules for GPUs without MIG, over simulated nodes ---------------------------

# A config in the GPU Operator's style: cluster-wide labels, per-model entries behind device
# filters, and per-index labels.
NODE_CONFIG = """\
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}
  all-balanced:
    - device-filter: ["0x20B010DE", "0x20B510DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    - device-filter: "0x233010DE"
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
  all-3g.40gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
  first-two-off:
    - devices: [0, 1]
      mig-enabled: false
  first-two-3g:
    - devices: [0, 1]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
  zero-and-eight-off:
    - devices: [0, 8]
      mig-enabled: false
  l40s-by-filter-and-index:
    - device-filter: "0x26B910DE"
      devices: [1]
      mig-enabled: true
      mig-devices: {}
  two-and-three-on:
    - devices: [2, 3]
      mig-enabled: true
      mig-devices: {}
"""


def preset_node(name: str) -> list[GpuIdentity]:
    """The GPUs of a simulator preset as the agent identifies them."""
    preset = PRESETS[name]
    return [GpuIdentity(i, preset.gpu.pci_device_id, preset.gpu.pci_subsystem_id,
                        mig_capable=preset.gpu.mig_capable)
            for i in range(len(preset.bus_numbers))]


# GPUs 0 and 1 H100, 2 and 3 L40S (no MIG): a node the simulator has no preset for.
H100_L40S = [*(GpuIdentity(i, H100, H100_SUB) for i in (0, 1)),
             *(GpuIdentity(i, 0x26B910DE, 0x185110DE, mig_capable=False) for i in (2, 3))]
NODES = {name: preset_node(name) for name in ("l40s", "dgx-a100", "dgx-h100")}
NODES["h100+l40s"] = H100_L40S
OFF, ON = DesiredDisabled(), DesiredProfiles({})
A100_BAL = DesiredProfiles({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})
H100_BAL = DesiredProfiles({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})
TWO_3G = DesiredProfiles({"3g.40gb": 2})
EIGHT = range(8)


@pytest.mark.parametrize(("node", "label", "desired", "skipped", "missing"), [
    # The GPU Operator's default label, and every cluster-wide label, work on an L40S node.
    ("l40s", "all-disabled", {}, [0, 1, 2, 3], ()),
    ("l40s", "all-enabled", {}, [0, 1, 2, 3], ()),
    ("l40s", "all-3g.40gb", {}, [0, 1, 2, 3], ()),
    ("l40s", "all-balanced", {}, [], ()),  # no filter matches: nothing selected at all
    ("l40s", "first-two-off", {}, [0, 1], ()),
    ("l40s", "zero-and-eight-off", {}, [0], (8,)),
    ("l40s", "l40s-by-filter-and-index", {}, [1], ()),  # selected through a device-filter
    ("dgx-a100", "all-disabled", dict.fromkeys(EIGHT, OFF), [], ()),
    ("dgx-a100", "all-balanced", dict.fromkeys(EIGHT, A100_BAL), [], ()),
    ("dgx-a100", "zero-and-eight-off", {0: OFF}, [], (8,)),
    ("dgx-h100", "all-balanced", dict.fromkeys(EIGHT, H100_BAL), [], ()),
    ("dgx-h100", "first-two-3g", {0: TWO_3G, 1: TWO_3G}, [], ()),
    ("dgx-h100", "zero-and-eight-off", {0: OFF}, [], (8,)),
    ("h100+l40s", "all-enabled", {0: ON, 1: ON}, [2, 3], ()),
    ("h100+l40s", "all-balanced", {0: H100_BAL, 1: H100_BAL}, [], ()),
    ("h100+l40s", "all-disabled", {0: OFF, 1: OFF}, [2, 3], ()),
    ("h100+l40s", "first-two-3g", {0: TWO_3G, 1: TWO_3G}, [], ()),
])
def test_gpus_without_mig_are_skipped(node: str, label: str, desired: dict[int, Desired],
                                      skipped: list[int], missing: tuple[int, ...]) -> None:
    """mig-parted's rule: a GPU without MIG that a label selects through ``devices: all`` or
    a ``device-filter``, or with ``mig-enabled: false``, is skipped (listed with the reason),
    not refused."""
    chosen = selection(parse_config(NODE_CONFIG), label, NODES[node])
    assert chosen.desired == desired
    assert list(chosen.skipped) == skipped
    assert chosen.missing == missing
    assert all("no MIG" in why for why in chosen.skipped.values())


@pytest.mark.parametrize(("node", "label", "refused"), [
    ("l40s", "first-two-3g", [0, 1]),
    ("h100+l40s", "two-and-three-on", [2, 3]),
])
def test_mig_on_by_index_on_a_gpu_without_mig_is_refused(node: str, label: str,
                                                         refused: list[int]) -> None:
    """An index listed explicitly with ``mig-enabled: true`` on a GPU without MIG is an
    InvalidRequest in mig-parted's words, naming the entry's devices and each GPU."""
    with pytest.raises(InvalidRequest) as caught:
        selection(parse_config(NODE_CONFIG), label, NODES[node])
    errors = caught.value.errors
    assert [e["gpu"] for e in errors] == refused
    assert all(e["field"] == f"mig-configs.{label}[0].devices" for e in errors)
    assert all(NOT_MIG_CAPABLE in e["reason"] for e in errors)
    assert problem_of(caught.value).status == 422


@pytest.mark.parametrize("catalog", [H100_80GB, A100_40GB])
def test_every_standard_label_works_on_a_node_without_mig(catalog: Catalog) -> None:
    """generate-config's labels all use ``devices: all``: on an L40S node every one selects
    nothing to change and skips every GPU."""
    cfg = parse_config(standard_configs(catalog))
    for label in cfg.labels:
        chosen = selection(cfg, label, NODES["l40s"])
        assert (chosen.desired, list(chosen.skipped)) == ({}, [0, 1, 2, 3]), label


# --- export -> parse -> select ----------------------------------------------------------------


def built(catalog: Catalog, counts: dict[str, int] | None) -> Geometry:
    """The geometry the planner builds from nothing for ``counts`` (None: MIG disabled)."""
    if counts is None:
        return Geometry(mig_enabled=False)
    return plan(catalog, Geometry(mig_enabled=False), DesiredProfiles(counts)).target()


def expected(geometry: Geometry) -> Desired:
    return DesiredProfiles(geometry.counts()) if geometry.mig_enabled else DesiredDisabled()


def round_trip(layouts: dict[int, Geometry], *, via_yaml: bool = False) -> dict[int, Desired]:
    exported = export_config(layouts)
    source: Any = yaml.safe_dump(exported) if via_yaml else json.loads(json.dumps(exported))
    gpus = [GpuIdentity(i, H100, H100_SUB) for i in layouts]
    return select(parse_config(source), "current", gpus)


def test_export_of_one_shared_layout_is_devices_all() -> None:
    layouts = {i: built(H100_80GB, {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2})
               for i in range(8)}
    assert export_config(layouts) == {"version": "v1", "mig-configs": {"current": [
        {"devices": "all", "mig-enabled": True,
         "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}}]}}
    assert export_config({0: Geometry(mig_enabled=False)}, label="now") == {
        "version": "v1", "mig-configs": {"now": [{"devices": "all", "mig-enabled": False}]}}


def test_export_groups_gpus_with_equal_layouts() -> None:
    """GPUs with equal profile counts share an entry whatever their placements; disabled and
    enabled-but-empty GPUs are distinct entries; entries follow their first GPU."""
    a = built(H100_80GB, {"3g.40gb": 2})
    b = built(H100_80GB, {"1g.10gb": 7})
    balanced = built(H100_80GB, {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2})
    moved = next(  # the same profiles elsewhere
        g for g in (Geometry(mig_enabled=True, instances=tuple(Instance(n, p) for n, p in lay))
                    for lay in all_layouts(H100_80GB))
        if g.counts() == balanced.counts() and g.layout() != balanced.layout())
    layouts = {0: a, 1: b, 2: a, 3: Geometry(mig_enabled=False), 4: Geometry(mig_enabled=True),
               5: moved, 6: balanced, 7: Geometry(mig_enabled=False)}
    assert export_config(layouts)["mig-configs"]["current"] == [
        {"devices": [0, 2], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}},
        {"devices": [1], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}},
        {"devices": [3, 7], "mig-enabled": False},
        {"devices": [4], "mig-enabled": True, "mig-devices": {}},
        {"devices": [5, 6], "mig-enabled": True,
         "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}},
    ]
    got = round_trip(layouts, via_yaml=True)
    assert got == {i: expected(g) for i, g in layouts.items()}
    for i, g in layouts.items():  # and re-applying the export changes nothing
        assert plan(H100_80GB, g, got[i]).empty


@pytest.mark.parametrize("seed", range(6))
def test_export_round_trip_over_random_layouts(seed: int) -> None:
    """export -> parse -> select gives back every GPU's multiset of profiles (or MIG off), over
    random valid layouts of both real tables, with repeats so entries group GPUs."""
    rng = random.Random(seed)
    catalog = (H100_80GB, A100_40GB)[seed % 2]
    pool = rng.sample(all_layouts(catalog), 3)
    layouts: dict[int, Geometry] = {}
    for i in rng.sample(range(16), rng.randint(1, 8)):
        choice = rng.randrange(len(pool) + 1)
        layouts[i] = Geometry(mig_enabled=False) if choice == len(pool) else Geometry(
            mig_enabled=True, instances=tuple(Instance(n, p) for n, p in pool[choice]))
    got = round_trip(layouts)
    assert got == {i: expected(g) for i, g in sorted(layouts.items())}
    for i, g in layouts.items():
        assert plan(catalog, g, got[i]).empty
    groups = {(g.mig_enabled, tuple(g.counts().items())) for g in layouts.values()}
    assert len(export_config(layouts)["mig-configs"]["current"]) == len(groups)


def test_export_of_nothing_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        export_config({})


# --- generate-config's standard configs -------------------------------------------------------

H100_STANDARD = {
    "all-disabled", "all-enabled", "all-balanced",
    "all-1g.10gb", "all-1g.10gb.me", "all-1g.20gb", "all-2g.20gb", "all-3g.40gb",
    "all-4g.40gb", "all-7g.80gb",
}


def test_standard_configs_of_the_h100() -> None:
    """Exactly generate-config's labels; each all-<profile> at the profile's maximum count,
    the +me one at 1; all-balanced is 2 x 1g.10gb (the 1g with most instances) + 2g + 3g."""
    cfg = standard_configs(H100_80GB)
    assert set(cfg["mig-configs"]) == H100_STANDARD
    parsed = parse_config(cfg)
    assert parse_config(yaml.safe_dump(cfg)) == parsed
    one = {label: select(parsed, label, h100_node(1))[0] for label in parsed.labels}
    assert one["all-disabled"] == DesiredDisabled()
    assert one["all-enabled"] == DesiredProfiles({})
    assert one["all-balanced"] == DesiredProfiles({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})
    assert one["all-1g.10gb.me"] == DesiredProfiles({"1g.10gb+me": 1})
    for spec in H100_80GB.profiles:
        want = 1 if spec.media_extensions else spec.max_instances
        assert one[config_label(spec.name)] == DesiredProfiles({spec.name: want})
    assert one["all-1g.10gb"] == DesiredProfiles({"1g.10gb": 7})
    assert one["all-3g.40gb"] == DesiredProfiles({"3g.40gb": 2})


@pytest.mark.parametrize("catalog", [H100_80GB, A100_40GB], ids=["h100", "a100"])
def test_every_standard_config_is_placeable(catalog: Catalog) -> None:
    """Every label of the standard config places on every GPU of the node from MIG off, and
    the placed GPU has exactly the asked profiles."""
    parsed = parse_config(standard_configs(catalog))
    gpus = h100_node()
    for label in parsed.labels:
        selection = select(parsed, label, gpus)
        assert list(selection) == list(range(8))
        check_profiles(selection, dict.fromkeys(range(8), catalog))
        for desired in selection.values():
            target = plan(catalog, Geometry(mig_enabled=False), desired).target()
            assert target.is_valid(catalog)
            assert target.mig_enabled == (not isinstance(desired, DesiredDisabled))
            if isinstance(desired, DesiredProfiles):
                assert target.counts() == desired.multiset()


def test_standard_balanced_of_the_a100_and_a_4_slice_gpu() -> None:
    """The A100's balanced config uses 1g.5gb (7 instances beat 1g.10gb's 4); a 4-slice GPU
    (A30) gets 2 x 1g + 1 x 2g; a GPU lacking a needed size gets no all-balanced."""
    balanced = standard_configs(A100_40GB)["mig-configs"]["all-balanced"]
    assert balanced == [{"devices": "all", "mig-enabled": True,
                         "mig-devices": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}]

    def spec(name: str, id: int, slices: int, max_instances: int, *, starts: tuple[int, ...],
             size: int) -> ProfileSpec:
        return ProfileSpec(name=name, id=id, slices=slices, memory_mib=6016 * size,
                           multiprocessors=14 * slices, max_instances=max_instances,
                           placements=tuple(Placement(start=s, size=size) for s in starts),
                           media_extensions=name.endswith("+me"))

    a30 = Catalog(profiles=(
        spec("1g.6gb", 19, 1, 4, starts=(0, 1, 2, 3), size=1),
        spec("1g.6gb+me", 20, 1, 1, starts=(0, 1, 2, 3), size=1),
        spec("2g.12gb", 14, 2, 2, starts=(0, 2), size=2),
        spec("4g.24gb", 5, 4, 1, starts=(0,), size=4)),
        memory_slices=4)
    cfg = standard_configs(a30)
    assert set(cfg["mig-configs"]) == {"all-disabled", "all-enabled", "all-balanced",
                                       "all-1g.6gb", "all-1g.6gb.me", "all-2g.12gb",
                                       "all-4g.24gb"}
    desired = select(parse_config(cfg), "all-balanced", h100_node(1))[0]
    assert desired == DesiredProfiles({"1g.6gb": 2, "2g.12gb": 1})
    assert Counter(plan(a30, Geometry(mig_enabled=False), desired).target().counts()) == \
        Counter({"1g.6gb": 2, "2g.12gb": 1})

    no_3g = Catalog(profiles=tuple(s for s in H100_80GB.profiles if s.slices != 3))
    assert "all-balanced" not in standard_configs(no_3g)["mig-configs"]


def test_parse_gives_a_config_model() -> None:
    assert isinstance(parse_config(standard_configs(H100_80GB)), MigConfigFile)


def test_non_string_keys_are_unknown_fields() -> None:
    """A number as a key (YAML ``1: 2``) is an unknown field at its place, not a crash."""
    source: Any = {**config(entry(**{"1": ...})), 7: 1}
    source["mig-configs"]["x"][0][1] = 2
    with pytest.raises(InvalidRequest) as caught:
        parse_config(source)
    assert {(e["field"], e["reason"].split(";")[0]) for e in caught.value.errors} == {
        ("mig-configs.x[0].1", "unknown field"), ("7", "unknown field")}
