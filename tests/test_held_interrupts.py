"""held_interrupts: a first Ctrl-C inside the block is noted and the block runs on; a second raises; the
handler is Python's again after it; off the main thread nothing changes."""

import os
import signal
import threading

import pytest

from strata_ray.held_interrupts import held_interrupts


def test_a_first_ctrl_c_is_noted_and_the_block_finishes():
    done = False
    with held_interrupts() as held:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
        done = True
    assert done and held.interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with held_interrupts() as quiet:
        pass
    assert not quiet.interrupted


def test_a_second_ctrl_c_raises_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt), held_interrupts() as held:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        reached.append(1)
    assert held.interrupted and reached == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_off_the_main_thread_it_changes_nothing():
    seen = []

    def body():
        with held_interrupts() as held:
            seen.append(signal.getsignal(signal.SIGINT))
        seen.append(held.interrupted)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler, False]
