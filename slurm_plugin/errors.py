"""Exceptions of the slurm_plugin package; each names the bad thing and where it is."""


class DirectiveError(ValueError):
    """A malformed `#ELASTIC` line.

    Attributes:
        line_no: 1-based line number in the batch script.
        line: the offending line, verbatim.
        reason: what is wrong with it.
    """

    def __init__(self, line_no: int, line: str, reason: str):
        self.line_no = line_no
        self.line = line
        self.reason = reason
        super().__init__(f"line {line_no}: {reason}: {line!r}")


class SlurmError(RuntimeError):
    """A Slurm command failed or returned something we cannot use.

    Attributes:
        argv: the command that ran.
        rc: its exit status (None when it did not run or timed out).
        stderr: what it printed on stderr.
    """

    def __init__(self, argv, rc, stderr: str, message: str = ""):
        self.argv = list(argv)
        self.rc = rc
        self.stderr = stderr
        detail = message or (stderr.strip().splitlines() or [""])[-1]
        super().__init__(f"{' '.join(self.argv)} (rc={rc}): {detail}")
