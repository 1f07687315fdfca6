"""How the suite runs: in a random order, its seed printed, and each test under a time limit.

The order: pytest-randomly shuffles the modules, then the tests inside each module (a module's tests stay together,
so a module-scoped fixture is set up once, as in file order). It prints `Using --randomly-seed=N` in pytest's header,
which -q (make test) leaves out: the hooks here print it under -q too, and again at the end, under the failures an
order may explain. `-p randomly --randomly-seed=N` replays an order; `-p no:randomly` keeps file order.

The time limit: pyproject.toml's `timeout` (pytest-timeout), so a test that hangs fails instead of stalling CI until
its 90-minute limit. pytest-timeout's two methods, and why the suite uses both:
- `signal` (its default on POSIX): a SIGALRM at the timeout raises in the test's main thread, which fails that test
  (stacks printed) and the run goes on; `subprocess.run` kills its child on the way out. But an alarm only acts when
  the main thread runs Python again: not while it is blocked in C code that retries on EINTR. And code under test may
  take SIGALRM for itself: math-verify's parser, which TRL's `accuracy_reward` calls in the main thread, arms
  `signal.alarm(n)` and ends with `signal.alarm(0)`, which cancels pytest-timeout's alarm too.
- `thread`: a timer thread that, at the timeout, prints every thread's stack and ends the whole run (`os._exit(1)`):
  it always works, but the tests after it do not run and nothing is torn down.
So the alarm comes first and a timer thread stands behind it, at BACKSTOP_FACTOR times the timeout, for the hangs the
alarm cannot reach. tests/test_suite.py checks all of it on generated test files.
"""

from __future__ import annotations

import signal
import sys
import threading

import pytest

BACKSTOP_FACTOR = 1.25


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's hook: the `signal` method with a `thread` backstop (see the module doc). Anything else (the
    `thread` method asked for, a test run off the main thread) is left to pytest-timeout."""
    import pytest_timeout

    on_alarm_fail, on_backstop_exit = (getattr(pytest_timeout, n, None) for n in ("timeout_sigalrm", "timeout_timer"))
    main_thread = threading.current_thread() is threading.main_thread()
    if settings.method != "signal" or not main_thread or on_alarm_fail is None or on_backstop_exit is None:
        return None

    def on_alarm(signum, frame):
        __tracebackhide__ = True
        on_alarm_fail(item, settings)

    def backstop() -> None:
        sys.stderr.write(
            f"\n{item.nodeid} still runs {BACKSTOP_FACTOR * settings.timeout:g} s after it started: its "
            f"{settings.timeout:g} s alarm did not stop it (blocked in C code, or its alarm was taken). Ending the run.\n"
        )
        on_backstop_exit(item, settings)

    timer = threading.Timer(BACKSTOP_FACTOR * settings.timeout, backstop)
    timer.name = f"timeout backstop {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # what pytest-timeout's pytest_timeout_cancel_timer calls
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    timer.start()
    return True


# ---- the order's seed ------------------------------------------------------------------------------------------------


def randomly_seed(config) -> int | None:
    """The seed of this run's order (pytest-randomly), or None where it is not shuffling (`-p no:randomly`)."""
    if not config.pluginmanager.hasplugin("randomly") or not config.getoption("randomly_reorganize", False):
        return None
    return config.getoption("randomly_seed")


def pytest_report_collectionfinish(config) -> str | None:
    """The order's seed, also under -q (make test), where pytest-randomly's header line is not printed."""
    seed = randomly_seed(config)
    if seed is not None and config.get_verbosity() < 0:
        return f"Using --randomly-seed={seed}"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """How to run the same order again, under the failures it may explain."""
    seed = randomly_seed(config)
    if seed is not None:
        terminalreporter.write_line(f"Test order: -p randomly --randomly-seed={seed} runs this order again.")
