"""Exceptions of the predictor package; converted to JSON errors at the API boundary."""

from slurm_plugin.errors import ValidationError  # noqa: F401 - defined with the contracts that raise it


class NotFoundError(LookupError):
    """A named thing (profile, decision) does not exist; `hint` says what to do instead."""

    def __init__(self, what: str, name: str, hint: str = ""):
        self.what = what
        self.name = name
        self.hint = hint
        super().__init__(f"{what} {name!r} not found" + (f"; {hint}" if hint else ""))


class Conflict(Exception):
    """A request that contradicts one stored before under the same name (409); `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class TooLarge(ValidationError):
    """Input within the body cap that asks for more work or storage than a named limit allows (413)."""
