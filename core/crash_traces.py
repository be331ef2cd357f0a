"""Native crash traces for every long-running process.

A crash inside a compiled extension (the worker once died of a segfault in one, seconds after
start, and took the whole stack with it) kills the interpreter before any Python handler runs,
so without this the process log ends mid-line with nothing to go on. `faulthandler` writes the
Python stack of every thread to stderr on SIGSEGV, SIGFPE, SIGABRT, SIGBUS and SIGILL; bin/stack
and the service managers send each process's stderr to its log.
"""

from __future__ import annotations

import faulthandler
import sys


def enable_crash_traces() -> None:
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
