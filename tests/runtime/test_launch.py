"""Launching the fork server the ranks start from: a Ctrl-C in the moment it takes is neither lost by the
controller nor printed as a traceback by the fork server (which is still importing the runtime)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.signal_state import as_a_terminal_starts_it

# Ctrl-C to the whole process group (as a terminal sends it) just after the fork server is launched, before
# start_fork_server returns: the fork server is then importing torch, the controller still launching.
CTRL_C_WHILE_LAUNCHING = textwrap.dedent(
    """
    import os, signal, sys
    from multiprocessing import forkserver
    from specdoctor.runtime import launch
    from tests.helpers.signal_state import signal_state

    at_start = signal_state(os.getpid())  # what this process inherited, for a Ctrl-C that goes unanswered

    launch_fork_server = forkserver.ensure_running

    def launched_then_interrupted():
        launch_fork_server()
        os.killpg(0, signal.SIGINT)

    forkserver.ensure_running = launched_then_interrupted
    try:
        launch.rank_context()
    except KeyboardInterrupt:
        # Its last client gone (the "alive" pipe closed), a fork server that outlived the Ctrl-C exits with 0
        # once it has imported the runtime; one that did not was killed by it.
        os.close(forkserver._forkserver._forkserver_alive_fd)
        _, status = os.waitpid(forkserver._forkserver._forkserver_pid, 0)
        print("interrupted; the fork server exited with", os.waitstatus_to_exitcode(status), flush=True)
        sys.exit(130)
    print("the Ctrl-C was lost", flush=True)
    print(f"at start:\\n{at_start}\\nnow:\\n{signal_state(os.getpid())}", file=sys.stderr)
    """
)


def test_a_ctrl_c_while_the_fork_server_launches_stops_the_controller_and_nothing_prints_a_traceback():
    # A session of its own, so the Ctrl-C reaches this controller and its fork server only.
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_LAUNCHING],
        capture_output=True,
        text=True,
        start_new_session=True,
        preexec_fn=as_a_terminal_starts_it,
        timeout=120,
    )
    assert (done.returncode, done.stdout.strip()) == (130, "interrupted; the fork server exited with 0"), (
        done.stdout + done.stderr
    )
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
