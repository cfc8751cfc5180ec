"""`oled tune` workers sharing one study on a real PostgreSQL server (a throwaway cluster from
Debian's `postgresql` package): a worker killed in a trial loses no finished trial, and its
trial ends FAIL through Optuna's heartbeat."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from tests.experiment.conftest import tune_recipe_file, tune_tracking

ROOT = Path(__file__).resolve().parents[2]
PORT = 5432  # names the socket file only: the server listens on no TCP address
WORKER = """
import sys
sys.path.insert(0, {root!r})
from tests.experiment.tune_objective import register
from oled.cli import app
register()
app(sys.argv[1:], prog_name="oled")
"""


def postgres_bin() -> Path | None:
    """The folder of the newest installed PostgreSQL's initdb and pg_ctl, if any."""
    folders = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name))
    found = [f for f in folders if (f / "initdb").exists() and (f / "pg_ctl").exists()]
    if found:
        return found[-1]
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    return Path(pg_ctl).parent if initdb and pg_ctl else None


def as_server_user() -> list[str]:
    """The command prefix that runs the server's commands: PostgreSQL refuses to run as root,
    so root runs them as the `postgres` user."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root and there is no 'postgres' user to run the server")
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.skip("running as root and runuser is missing to run the server as 'postgres'")
    return [runuser, "-u", "postgres", "--"]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL cluster in a temporary folder, reached by a unix socket there."""
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed (dev extra)")
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("no initdb/pg_ctl: install Debian's postgresql package (apt-get install)")
    prefix = as_server_user()
    folder = Path(tempfile.mkdtemp(prefix="oled-pg-"))  # short: a socket path has a limit
    if prefix:
        shutil.chown(folder, "postgres", "postgres")
    data = folder / "data"

    def server(*args: str) -> None:
        subprocess.run([*prefix, *args], cwd=folder, check=True, capture_output=True, timeout=60)

    try:
        server(
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-A",
            "trust",
            "-U",
            "oled",
            "--no-sync",
            "--no-locale",
            "-E",
            "UTF8",
        )
        options = f"-k {folder} -p {PORT} -c listen_addresses='' -c fsync=off"
        server(
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(folder / "log"),
            "-w",
            "-o",
            options,
            "start",
        )
        yield f"postgresql+psycopg://oled@/postgres?host={folder}&port={PORT}"
    finally:
        if data.exists():
            subprocess.run(
                [*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                cwd=folder,
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for(path: Path, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, f"{path} did not appear in {seconds} s"
        time.sleep(0.05)


def test_killed_worker_loses_no_trial(tmp_path: Path, postgres_url: str) -> None:
    """Two `oled tune` workers on one study; one is killed in a trial. The finished trials
    stay, the survivor completes the study, and the killed trial ends FAIL by heartbeat."""
    path = tune_recipe_file(tmp_path, postgres_url, 12, tune_tracking(tmp_path, None), "slow_bowl")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT)))
    hang, killed = tmp_path / "hang", tmp_path / "killed"
    args = [
        sys.executable,
        str(script),
        "tune",
        str(path),
        "--heartbeat-interval",
        "1",
        "--grace-period",
        "2",
    ]
    env = os.environ | {"BOWL_SECONDS": "0.4"}

    def worker(**extra: str) -> subprocess.Popen:
        return subprocess.Popen(args, env=env | extra, stderr=subprocess.PIPE)

    survivor = worker(BOWL_WAIT_FILE=str(killed))  # its first trial waits for the kill
    victim = worker(BOWL_HANG_AT="2", BOWL_HANG_FILE=str(hang))  # finishes one, hangs in one
    try:
        _wait_for(hang, victim, 60)
        study = optuna.load_study(study_name="bowl", storage=postgres_url)
        done = {t.number: t.value for t in study.trials if t.state.is_finished()}
        victim_id = f"{socket.gethostname()}:{victim.pid}"
        (hung,) = [
            t
            for t in study.trials
            if t.user_attrs.get("worker") == victim_id
            and t.state == optuna.trial.TrialState.RUNNING
        ]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        killed.touch()
        _, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err.decode()[-2000:]
    finally:
        for process in (victim, survivor):
            process.kill()
            process.wait()
    trials = optuna.load_study(study_name="bowl", storage=postgres_url).trials
    assert len(done) == 1 and {n: trials[n].value for n in done} == done  # none lost
    assert trials[hung.number].state == optuna.trial.TrialState.FAIL  # by the heartbeat
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 12 and len({t.number for t in trials}) == len(trials)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
