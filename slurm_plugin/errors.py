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


class JobNotFoundError(LookupError):
    """A job id that Slurm does not know (or no longer lists).

    Attributes:
        job_id: the job asked for.
    """

    def __init__(self, job_id: int, detail: str = ""):
        self.job_id = job_id
        super().__init__(f"job {job_id}: not found" + (f" ({detail})" if detail else ""))


class ResizeError(ValueError):
    """A resize that cannot be done, such as more nodes than the job has or dropping its batch host.

    Attributes:
        job_id: the job being resized.
        reason: what is wrong with the request.
    """

    def __init__(self, job_id: int, reason: str):
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"job {job_id}: cannot resize: {reason}")


class TestbedError(RuntimeError):
    """A testbed daemon failed to start or stop, or the cluster did not become ready.

    Attributes:
        daemon: the daemon's name (e.g. "slurmctld", "slurmd-node3", "mariadbd").
        reason: what went wrong.
        log_tail: the last lines of that daemon's log, if any.
    """

    __test__ = False

    def __init__(self, daemon: str, reason: str, log_tail: str = ""):
        self.daemon = daemon
        self.reason = reason
        self.log_tail = log_tail
        tail = f"\n--- last lines of the {daemon} log ---\n{log_tail}" if log_tail else ""
        super().__init__(f"{daemon}: {reason}{tail}")


class ValidationError(ValueError):
    """Bad input: names the field (JSON path such as `tensors[3].numel`) and what is wrong with it."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
