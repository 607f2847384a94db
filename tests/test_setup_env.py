"""scripts/setup_env.sh decides when to install, run on a copy of the repository's requirements with a stand-in
interpreter (PYTHON): `-m venv DIR` makes DIR/bin/python (the stand-in again), and every call is logged, so
what pip would have been asked to do is seen without installing anything.

- After `--test`, a plain set-up (what scripts/demo.sh runs after scripts/test.sh) runs no pip: the test set
  includes requirements.txt. A change to requirements.txt is still installed.
- A set-up stopped by SIGTERM while pip installs leaves no stamp calling the venv complete, even where an
  earlier set-up's stamp was there before it started: the next set-up installs again.
"""
import os
import shutil
import signal
import subprocess
import time

from conftest import ROOT

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$SETUP_LOG"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "${@: -1}/bin" && cp "$0" "${@: -1}/bin/python"; exit 0; fi
if [ "$1 $2 $3" = "-m pip install" ] && [ -n "${HANG_ON:-}" ] && [[ "$*" == *"$HANG_ON"* ]]; then
    touch "$SETUP_LOG.hanging"; sleep 600
fi
exit 0
"""


def _repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "setup_env.sh"), repo / "scripts")
    for name in ("requirements.txt", "requirements-test.txt", "requirements-demo.txt", "setup.py"):
        shutil.copy(os.path.join(ROOT, name), repo)
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    return repo, {**os.environ, "PYTHON": str(python), "SETUP_LOG": str(tmp_path / "calls.log")}


def _setup(repo, env, *args, **popen):
    cmd = ["bash", str(repo / "scripts" / "setup_env.sh"), *args]
    if popen:
        return subprocess.Popen(cmd, env=env, **popen)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run


def _pip_installs(env):
    with open(env["SETUP_LOG"]) as f:
        return [line.split("--disable-pip-version-check ")[-1].strip() for line in f if line.startswith("-m pip install")]


def test_a_plain_set_up_after_the_test_set_up_installs_nothing(tmp_path):
    repo, env = _repo(tmp_path)
    _setup(repo, env, "--test")
    assert _pip_installs(env) == ["-r requirements-test.txt", "--no-build-isolation --no-deps -e ."]
    _setup(repo, env)  # scripts/demo.sh after scripts/test.sh
    _setup(repo, env, "--test")
    assert len(_pip_installs(env)) == 2
    with open(repo / "requirements.txt", "a") as f:
        f.write("einops\n")
    _setup(repo, env)
    assert _pip_installs(env)[2:] == ["-r requirements.txt", "--no-build-isolation --no-deps -e ."]


def test_a_set_up_stopped_by_sigterm_leaves_no_stamp_calling_the_venv_complete(tmp_path):
    repo, env = _repo(tmp_path)
    _setup(repo, env)
    assert len(_pip_installs(env)) == 2
    job = _setup(repo, {**env, "HANG_ON": "requirements-test.txt"}, "--test", start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(env["SETUP_LOG"] + ".hanging"):  # pip is changing the venv
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGTERM)
        assert job.wait(timeout=60) != 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert not [n for n in os.listdir(repo / ".venv") if n.startswith(".megatron_zero_installed")]
    _setup(repo, env)  # the plain set-up's stamp was there before: it must not vouch for the venv now
    assert _pip_installs(env)[3:] == ["-r requirements.txt", "--no-build-isolation --no-deps -e ."]


def test_the_demo_set_up_installs_matplotlib_and_the_test_set_up_covers_it(tmp_path):
    """scripts/demo.sh's set-up installs what its loss curve needs, so the first run draws it."""
    with open(os.path.join(ROOT, "scripts", "demo.sh")) as f:
        assert "scripts/setup_env.sh --demo" in f.read()
    with open(os.path.join(ROOT, "requirements-demo.txt")) as f:
        assert any(line.startswith("matplotlib==") for line in f)
    repo, env = _repo(tmp_path)
    _setup(repo, env, "--demo")
    assert _pip_installs(env) == ["-r requirements-demo.txt", "--no-build-isolation --no-deps -e ."]
    repo, env = _repo(tmp_path / "after_test")
    _setup(repo, env, "--test")
    _setup(repo, env, "--demo")  # scripts/demo.sh after scripts/test.sh: nothing to install
    assert len(_pip_installs(env)) == 2
