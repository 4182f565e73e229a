"""The op schemas: Python registration, the documented contract and the C++ stub agree."""

import re
from pathlib import Path

import torch

import torch_cute_ops  # noqa: F401
from torch_cute_ops.ops.schemas import SCHEMAS

CPP = Path(__file__).resolve().parents[1] / "csrc_stubs" / "cute_ops.cpp"


def _cpp_schemas():
    return re.findall(r'm\.def\("([^"]+)"\)', CPP.read_text())


def test_cpp_stub_declares_exactly_the_python_schemas():
    cpp = {str(torch._C.parse_schema(f"cute::{s}")) for s in _cpp_schemas()}
    py = {str(torch._C.parse_schema(f"cute::{s}")) for s in SCHEMAS.values()}
    assert cpp == py


def test_registered_ops_carry_the_contract_schemas():
    for name, schema in SCHEMAS.items():
        op = getattr(torch.ops.cute, name).default
        assert str(op._schema) == str(torch._C.parse_schema(f"cute::{schema}"))


def test_gemm_schema_defaults_match_the_contract():
    args = {a.name: a for a in torch.ops.cute.gemm.default._schema.arguments}
    assert list(args) == ["a", "b", "bias", "activation", "out_dtype", "alpha"]
    assert args["bias"].default_value is None and args["activation"].default_value is None
    assert args["alpha"].default_value == 1.0
