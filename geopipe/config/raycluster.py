"""The YAML's ``ray`` section: which Ray cluster a run uses and how its actors take devices."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from geopipe.config.fields import Spec

__all__ = ["RaySpec"]


class RaySpec(Spec):
    address: str = Field("local", description="'local' (embedded), 'auto' or host:port")
    dashboard: bool = True
    dashboard_port: int = Field(8265, ge=1, le=65535)
    emulate_links: bool | None = Field(
        None, description="emulate WAN links in user space (default: on for address 'local')"
    )
    auth: Literal["token", "disabled"] = "token"
    namespace: str = "geopipe"
    gpus_per_actor: float | None = Field(
        None,
        gt=0.0,
        le=8.0,
        description="GPUs each stage actor takes (a fraction shares one GPU between "
        "actors); default: 1 when the cluster has a GPU per actor, else none (CPU)",
    )

    @property
    def links_emulated(self) -> bool:
        return self.address == "local" if self.emulate_links is None else self.emulate_links
