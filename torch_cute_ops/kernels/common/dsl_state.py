"""A base class for helper objects that carry DSL values through dynamic loops."""

from __future__ import annotations

import copy

import cutlass


class DslState:
    """Lets a helper object live across dynamic ``while``/``range`` loops.

    The DSL carries loop state as MLIR values; the attributes named in
    ``dynamic_fields`` (DSL scalars or register tensors) become those values, the
    others stay compile-time constants.
    """

    dynamic_fields: tuple = ()

    def __extract_mlir_values__(self):
        values, self._value_counts = [], []
        for name in self.dynamic_fields:
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            self._value_counts.append(len(field_values))
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        for name, count in zip(self.dynamic_fields, self._value_counts):
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[:count]))
            values = values[count:]
        return new
