"""The catalogue of bad inputs (tests/bad_inputs.py), each run in a process of
its own (forked from a server that has imported torch and mha_ext), so a crash
or a hang fails its case instead of the whole run. Each must raise a clear
error (type and message as catalogued) or do what torch does."""
import multiprocessing as mp
import re

import pytest

import bad_inputs

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "mha_ext", "bad_inputs"])
    return c


def test_catalogue_is_large_enough():
    assert len(bad_inputs.CASES) >= 40


@pytest.mark.parametrize("name", list(bad_inputs.CASES))
def test_bad_input(ctx, name):
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=bad_inputs.run_case, args=(name, child))
    proc.start()
    child.close()
    got = None
    if parent.poll(TIMEOUT_S):
        try:
            got = parent.recv()
        except EOFError:  # the process died before answering
            pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert got is not None, f"{name}: no answer in {TIMEOUT_S} s (hang) or the process died (exit code {proc.exitcode})"
    assert proc.exitcode == 0, f"{name}: the process ended with {proc.exitcode}"
    _, expect = bad_inputs.CASES[name]
    if expect is None or expect[0] == "passes":
        assert got == ("ok",), f"{name}: {got[1]}: {got[2]}\n{got[3]}"
        return
    _, exc, pattern = expect
    assert got[0] == "raised", f"{name}: expected {exc}, it returned"
    assert got[1] == exc and re.search(pattern, got[2]), f"{name}: expected {exc} /{pattern}/, got {got[1]}: {got[2]}"
