"""The refusals every surface renders at its edge: `error: field: problem; fix` on the console, JSON over HTTP."""
from __future__ import annotations


class UsageError(Exception):
    """A job that cannot run as asked; str() is `field: problem; fix`."""


class FieldError(UsageError):
    """A value that cannot be used: which field, what is wrong with it, what to do instead (empty
    where the problem says it)."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem}; {fix}" if fix else f"{field}: {problem}")

    def renamed(self, field: str) -> "FieldError":
        """The same refusal under the name one surface gives the field (model_args.seed, line 3: seed)."""
        return FieldError(field, self.problem, self.fix)

    def as_json(self) -> dict:
        return {"param": self.field, "problem": self.problem, "fix": self.fix, "message": str(self)}


class OutputWriteError(FieldError):
    """An output that could not be written after the load (disk full, a writer failing): nothing of it is left."""


def field_error(line: str) -> FieldError:
    """A `field: problem; fix` line of a lower layer (a kernel rule, a LayoutError) as a FieldError."""
    field, _, rest = line.partition(": ")
    problem, _, fix = rest.partition("; ")
    return FieldError(field, problem, fix)
