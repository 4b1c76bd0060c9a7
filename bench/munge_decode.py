"""Cost of decoding one munge credential: libmunge in this process (predictor.auth.LibMunge) against an `unmunge`
run (#24.4), against a private munged. Prints ms a credential, wall and CPU, for both.

    python bench/munge_decode.py [--n 200]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from predictor.auth import Unmunger  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="credentials per way")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        key, sock = Path(d, "key"), Path(d, "sock")
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        daemon = subprocess.Popen(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                                   f"--pid-file={d}/pid", f"--log-file={d}/log", f"--seed-file={d}/seed"],
                                  stderr=subprocess.DEVNULL)
        try:
            while subprocess.run(["munge", f"--socket={sock}", "-n"], capture_output=True).returncode:
                time.sleep(0.05)
            print("| way | credentials | wall ms each | CPU ms each (this process) |\n|---|---|---|---|")
            for name, u in (("libmunge in process", Unmunger(str(sock))),
                            ("unmunge run", Unmunger(str(sock), in_process=False))):
                creds = [subprocess.run(["munge", f"--socket={sock}", "-s", "x"], capture_output=True, text=True,
                                        check=True).stdout.strip() for _ in range(args.n)]
                t, c = time.perf_counter(), time.process_time()
                for cred in creds:
                    u.decode(cred)
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                print(f"| {name} | {args.n} | {wall / args.n * 1e3:.3f} | {cpu / args.n * 1e3:.3f} |")
        finally:
            daemon.terminate()
            daemon.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
