"""A kernel variant's name: everything that changes its generated code, never sizes."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

ARCHES = ("sm_90a", "sm_100a")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant: family, target arch and the parameters that change its code
    (dtypes, majorness, flags, tile config). Sizes never enter a spec: every family compiles
    with symbolic shapes, so one variant serves any batch, sequence length or M/N/K."""

    family: str
    arch: str
    params: tuple[tuple[str, Any], ...]

    @staticmethod
    def make(family: str, arch: str, **params: Any) -> "KernelSpec":
        if arch not in ARCHES:
            raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
        return KernelSpec(family, arch, tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(name)

    def get(self, name: str, default: Any = None) -> Any:
        """A parameter that only some variants carry (absent: ``default``)."""
        for key, value in self.params:
            if key == name:
                return value
        return default

    @property
    def name(self) -> str:
        """A readable, file-name-safe name: ``gemm_sm90_sm90a_a_major=k_..._tile=128x256``."""
        parts = [self.family, self.arch.replace("_", "")]
        for key, value in self.params:
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, (tuple, list)):
                value = "x".join(str(v) for v in value)
            parts.append(f"{key}={value}")
        return re.sub(r"[^A-Za-z0-9_.=x-]", "-", "_".join(parts))

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    @property
    def symbol(self) -> str:
        """The exported C symbol of this variant in a shared library."""
        return f"tco_{self.digest}"
