"""The CDI spec (up to 1.1.0) as pydantic models, serialised with the JSON keys runtimes parse.

Runtimes parse strictly (unknown fields are errors), so unset fields are left out rather than
written as null, and the spec declares the minimum ``cdiVersion`` its content needs
(:func:`cdi.version.minimum_version`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class DeviceNode(_Model):
    path: str = Field(min_length=1)
    host_path: str | None = Field(default=None, alias="hostPath")
    type: Literal["b", "c", "u", "p"] | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = Field(default=None, alias="fileMode")
    permissions: str | None = None
    uid: int | None = Field(default=None, ge=0, lt=2**32)
    gid: int | None = Field(default=None, ge=0, lt=2**32)


class Mount(_Model):
    host_path: str = Field(alias="hostPath", min_length=1)
    container_path: str = Field(alias="containerPath", min_length=1)
    options: tuple[str, ...] | None = None
    type: str | None = None


class Hook(_Model):
    hook_name: Literal["prestart", "createRuntime", "createContainer", "startContainer",
                       "poststart", "poststop"] = Field(alias="hookName")
    path: str = Field(pattern=r"^/")
    args: tuple[str, ...] | None = None
    env: tuple[str, ...] | None = None
    timeout: int | None = Field(default=None, gt=0, lt=2**32)


class IntelRdt(_Model):
    clos_id: str | None = Field(default=None, alias="closID")
    l3_cache_schema: str | None = Field(default=None, alias="l3CacheSchema")
    mem_bw_schema: str | None = Field(default=None, alias="memBwSchema")
    schemata: tuple[str, ...] | None = None
    enable_monitoring: bool | None = Field(default=None, alias="enableMonitoring")


class NetDevice(_Model):
    host_interface_name: str = Field(alias="hostInterfaceName", min_length=1)
    name: str = Field(min_length=1)


class ContainerEdits(_Model):
    env: tuple[str, ...] | None = None
    device_nodes: tuple[DeviceNode, ...] | None = Field(default=None, alias="deviceNodes")
    hooks: tuple[Hook, ...] | None = None
    mounts: tuple[Mount, ...] | None = None
    intel_rdt: IntelRdt | None = Field(default=None, alias="intelRdt")
    additional_gids: tuple[int, ...] | None = Field(default=None, alias="additionalGids")
    net_devices: tuple[NetDevice, ...] | None = Field(default=None, alias="netDevices")

    @property
    def empty(self) -> bool:
        return not any(getattr(self, name) for name in type(self).model_fields)


def _sorted(annotations: dict[str, str] | None) -> dict[str, str] | None:
    return None if annotations is None else dict(sorted(annotations.items()))


class Device(_Model):
    name: str
    annotations: dict[str, str] | None = None
    container_edits: ContainerEdits = Field(alias="containerEdits")

    _sorted_annotations = field_validator("annotations")(_sorted)


class Spec(_Model):
    cdi_version: str = Field(alias="cdiVersion")
    kind: str
    annotations: dict[str, str] | None = None
    devices: tuple[Device, ...] = Field(min_length=1)
    container_edits: ContainerEdits | None = Field(default=None, alias="containerEdits")

    _sorted_annotations = field_validator("annotations")(_sorted)

    def to_json(self) -> bytes:
        """Canonical bytes: JSON keys as the spec names them, in the models' field order
        (``cdiVersion`` first), unset fields left out, annotations sorted, so the same content
        always gives the same file. (pydantic's serialiser: a tenth of ``json.dumps`` with an
        indent, which falls back to pure Python, and this runs on every prepare.)"""
        return self.model_dump_json(by_alias=True, exclude_none=True, indent=2).encode() + b"\n"
