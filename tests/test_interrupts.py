"""SIGINT held over an all-gather rank's planner steps: See [Note: interrupts between collectives]."""

import os
import signal
import threading

import pytest

from dlo.hotpath.interrupts import interrupts_held


@pytest.fixture(autouse=True)
def python_sigint_handler():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_inside_is_raised_as_the_step_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("rest of the step")
    assert done == ["rest of the step"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_inside_is_raised_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the first")
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the second")
    assert done == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_inner_step_holds_for_the_outer_one():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGINT)
            done.append("the outer step went on")
    assert done == ["the outer step went on"]


def test_a_handler_of_the_programs_own_runs_as_the_step_ends():
    seen = []
    signal.signal(signal.SIGINT, lambda sig, frame: seen.append(sig))
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # no ForcedInterrupt: that is Python's own handler's rule
        assert seen == []
    assert seen == [signal.SIGINT, signal.SIGINT]


def test_an_alarm_whose_handler_raises_is_raised_as_the_step_ends():
    def alarm(sig, frame):
        raise KeyboardInterrupt("alarm")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt, match="alarm"):
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGALRM)
                done.append("rest of the step")
        assert done == ["rest of the step"]
        assert signal.getsignal(signal.SIGALRM) is alarm
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_nothing_is_installed():
    handlers = []

    def step():
        with interrupts_held():
            handlers.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    assert handlers == [signal.default_int_handler]


def test_an_error_of_the_step_goes_on_over_a_held_ctrl_c():
    with pytest.raises(ValueError, match="the step's own"):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("the step's own error")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_in_an_all_gather_step_breaks_off_the_ranks_collectives():
    """Stopped midway, the rank no longer matches its peers: its later collectives must raise,
    not pair with theirs."""
    import torch

    import dlo
    from dlo.hotpath.interrupts import ForcedInterrupt
    from dlo.models.tiny import TINY_MODELS

    model = TINY_MODELS["sd3"].build(seed=1)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True)) as handle:
        runtime = handle._runtime
        with torch.inference_mode():
            model(**TINY_MODELS["sd3"].inputs(0))
        assert runtime.gather._failed is None
        with pytest.raises(ForcedInterrupt):
            with runtime._step():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
        assert "second Ctrl-C" in runtime.gather._failed and "restart the job" in runtime.gather._failed
