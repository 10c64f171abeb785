"""Run tests with the CUDA emulator's builds instrumented by a sanitizer:

    python tests/cuda_emulator/sanitize.py thread  [pytest arguments]   # ThreadSanitizer: data races
    python tests/cuda_emulator/sanitize.py address [pytest arguments]   # AddressSanitizer: out of bounds

(default pytest arguments: tests/test_kernels_cuda_emulated.py). A sanitizer's runtime has to be in
the process from its start, before Python loads anything, so this starts pytest anew with it preloaded
(LD_PRELOAD, the runtime g++ links: `g++ -print-file-name=libtsan.so`) and TINYVIT_EMULATOR_SANITIZE
set, which makes emulator.build instrument every kernel it compiles. The first report stops the run
(halt_on_error; pytest's output capture would swallow it, so the sanitizer writes it to a file that
this prints afterwards) with a non-zero exit status. Only the emulated kernels are instrumented
(Python and NumPy are not), so the reports are about them: a race between two emulated threads of a
block, or an access past an array or the shared memory. Tests that run deliberately broken kernels
skip under a sanitizer (they would stop the run).

Slow (measured on two cores shared with other work): ThreadSanitizer ran the emulated tests but
those of several tiles in 4 minutes, AddressSanitizer all of them in 3.5; neither reported anything.
Not part of CI, which runs tests/test_cuda_emulator_sanitizers.py instead (the defect each sanitizer
must catch, in about 20 s).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNTIMES = {"thread": "libtsan.so", "address": "libasan.so"}
OPTIONS = {
    "thread": ("TSAN_OPTIONS", "halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0"),
    # Python and NumPy keep memory until exit on purpose: no leak report
    "address": ("ASAN_OPTIONS", "halt_on_error=1:detect_leaks=0:allocator_may_return_null=1"),
}


def environment(name: str) -> dict:
    """os.environ plus what a sanitized run needs: the runtime preloaded, its options, the switch."""
    runtime = subprocess.run(["g++", f"-print-file-name={RUNTIMES[name]}"], capture_output=True, text=True,
                             check=True).stdout.strip()
    if not Path(runtime).is_file():
        raise SystemExit(f"sanitize.py: g++ has no {RUNTIMES[name]} (Debian: apt-get install libtsan2 libasan8)")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [runtime, env.get("LD_PRELOAD")]))
    key, value = OPTIONS[name]
    env[key] = ":".join(filter(None, [value, env.get(key)]))
    env["TINYVIT_EMULATOR_SANITIZE"] = name
    return env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in RUNTIMES:
        print(__doc__, file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:] or ["tests/test_kernels_cuda_emulated.py"]
    env = environment(name)
    with tempfile.TemporaryDirectory() as logs:
        key = OPTIONS[name][0]
        env[key] += f":log_path={logs}/report"          # the sanitizer writes report.<pid> there
        code = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], env=env,
                              check=False).returncode
        for report in sorted(Path(logs).iterdir()):
            print(report.read_text(), file=sys.stderr)
            code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
