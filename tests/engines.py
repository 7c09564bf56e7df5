"""The real serving engines the tests and ``benchmarks/oip_serving.py`` run against, installed outside the venv.

``python tests/engines.py install [DIR]`` (README's setup and ``.ci/run`` run it; DIR defaults to ``.engines``
at the repository root, or ``$FXL_ENGINES``):

- ``DIR/pytriton``: the ``nvidia-pytriton`` wheel, which bundles tritonserver 2.51 with its Python backend (CPU
  only) and the libraries it links; installed with ``--no-deps --target`` because it pins numpy<2, which the
  venv must not get (with numpy 2 the Python backend's numpy path returns wrong data; tensors go by DLPack).
- ``DIR/perf_analyzer``: Triton's load generator, the binary the ``tritonclient`` 2.41 wheel ships (later wheels
  have none), with links to the two libraries of the pytriton wheel it needs (libb64, libcudart).
- Chromium, from the distribution's packages (``apt-get install -y chromium``) when none is on PATH: the headless
  browser ``tests/test_progress_report.py`` opens an export's ``report.html`` in (``tests/browser.py``).

:class:`Engines` finds them for the tests: ``tritonserver`` started on loopback ports with a backend directory of
its own (the Python backend, the stub for the running Python, and the test-only stand-ins of the ONNX Runtime and
OpenVINO backends in ``tests/triton_backends``: Python-based backends that load ``model.onnx`` / ``model.xml``, so
the repository's own configs load unchanged against the real server), and ``perf_analyzer``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
PYTRITON = "nvidia-pytriton==0.7.0"  # tritonserver 2.51
PERF_CLIENT = "tritonclient==2.41.0"  # the last wheel with bin/perf_analyzer
STAND_INS = Path(__file__).resolve().parent / "triton_backends"


def engines_dir() -> Path:
    return Path(os.environ.get("FXL_ENGINES") or ROOT / ".engines")


def install_chromium() -> None:
    """Chromium from the distribution's packages when none is on PATH (a second run finds it and does nothing)."""
    if any(shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")):
        return
    apt = shutil.which("apt-get")
    if apt is None:
        sys.exit("Chromium is not installed and there is no apt-get here: install Chromium (or set $FXL_CHROMIUM)")
    if subprocess.run([apt, "install", "-y", "-q", "chromium"]).returncode != 0:  # a fresh image has no lists yet
        subprocess.run([apt, "update", "-q"], check=True)
        subprocess.run([apt, "install", "-y", "-q", "chromium"], check=True)


def install(directory: Path) -> None:
    """Both engines into ``directory`` (a second run finds them there and does nothing), and Chromium."""
    install_chromium()
    pip = [sys.executable, "-m", "pip", "-q"]
    if not (directory / "pytriton" / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        subprocess.run([*pip, "install", "--no-deps", "--target", str(directory / "pytriton"), PYTRITON], check=True)
    analyzer = directory / "perf_analyzer" / "perf_analyzer"
    if not analyzer.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([*pip, "download", "--no-deps", "-d", tmp, PERF_CLIENT], check=True)
            wheel = next(Path(tmp).glob("tritonclient-*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                member = next(n for n in archive.namelist() if n.endswith("/bin/perf_analyzer"))
                analyzer.parent.mkdir(parents=True, exist_ok=True)
                analyzer.write_bytes(archive.read(member))
        libs = directory / "pytriton" / "nvidia_pytriton.libs"
        for wanted, pattern in (("libb64.so.0d", "libb64-*.so.0d"), ("libcudart.so.12", "libcudart-*.so.12*")):
            link = analyzer.parent / wanted
            link.unlink(missing_ok=True)
            link.symlink_to(next(libs.glob(pattern)))
    for binary in [analyzer, *(directory / "pytriton" / "pytriton" / "tritonserver").glob("**/bin/*"),
                   *(directory / "pytriton" / "pytriton" / "tritonserver").glob("python_backend_stubs/*/*")]:
        binary.chmod(0o755)


@dataclass
class Engines:
    """The installed engines, or why they cannot run here (``missing``)."""

    directory: Path

    @property
    def server_root(self) -> Path:
        return self.directory / "pytriton" / "pytriton" / "tritonserver"

    @property
    def stub(self) -> Path:
        return self.server_root / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / \
            "triton_python_backend_stub"

    @property
    def perf_analyzer(self) -> Path:
        return self.directory / "perf_analyzer" / "perf_analyzer"

    def missing(self) -> Optional[str]:
        """Why the engines cannot run here, None when they can."""
        if not (self.server_root / "bin" / "tritonserver").is_file() or not self.perf_analyzer.is_file():
            return (f"the Triton engines are not installed in {self.directory}: run "
                    f"`{sys.executable} tests/engines.py install` (README's setup does)")
        if not self.stub.is_file():
            return f"the nvidia-pytriton wheel has no Python backend stub for Python {sys.version.split()[0]}"
        return None

    def backend_directory(self, into: Path) -> Path:
        """A backend directory: the Python backend with the stub for this Python, and the stand-ins."""
        python = into / "python"
        python.mkdir(parents=True, exist_ok=True)
        for item in (self.server_root / "backends" / "python").iterdir():
            if item.is_file():
                shutil.copy2(item, python / item.name)
        shutil.copy2(self.stub, python / "triton_python_backend_stub")
        for stand_in in STAND_INS.iterdir():
            if stand_in.is_dir():
                shutil.copytree(stand_in, into / stand_in.name, dirs_exist_ok=True)
        return into

    def environment(self) -> dict:
        """The server's environment: the venv's Python first on PATH (the stub's Python uses its site-packages),
        this Python's libpython and the wheel's libraries found (without them the stub fails and the server hangs
        instead of exiting)."""
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        libs = [str(self.directory / "pytriton" / "nvidia_pytriton.libs")]
        # The stub links libpython3.X.so by name: this interpreter's own first, not another build of the same minor
        # version (the system's 3.11.2 lacks symbols that this 3.11's extension modules, _ssl say, need).
        own = sysconfig.get_config_var("LIBDIR")
        libs = ([own] if own and sysconfig.get_config_var("Py_ENABLE_SHARED") else []) + libs
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        return env

    @contextlib.contextmanager
    def tritonserver(self, repository: Path, workdir: Path, ready_within_s: float = 300.0,
                     flags: Sequence[str] = ()) -> Iterator[str]:
        """tritonserver on ``repository`` (every model loaded, or it fails) on loopback ports; yields the HTTP
        address (``127.0.0.1:PORT``); stopped by SIGTERM, then killed."""
        from export_helpers import free_port

        http, grpc, metrics = free_port(), free_port(), free_port()
        backends = self.backend_directory(workdir / "backends")
        log_path = workdir / f"tritonserver-{http}.log"
        command = [str(self.server_root / "bin" / "tritonserver"), f"--model-repository={repository}",
                   f"--backend-directory={backends}", "--disable-auto-complete-config", "--exit-on-error=true",
                   "--strict-readiness=true", f"--http-port={http}", f"--grpc-port={grpc}",
                   f"--metrics-port={metrics}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", *flags]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, cwd=workdir, env=self.environment(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        url = f"127.0.0.1:{http}"
        try:
            deadline = time.monotonic() + ready_within_s
            while proc.poll() is not None or not _ready(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"tritonserver exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tritonserver not ready within {ready_within_s} s:\n"
                                       f"{log_path.read_text()[-6000:]}")
                time.sleep(0.25)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def run_perf_analyzer(self, model: str, url: str, out_csv: Path, *, concurrency: int, requests: int,
                          extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
        """perf_analyzer over HTTP at one concurrency, windows of at least ``requests`` requests each, zero-filled
        inputs (its random bytes hold NaN, which fx-lightning serve refuses); the CSV has p50-p99. Any three windows
        count as stable (a 10^5 % band, up to 10 windows): on a shared 2-core machine a window beside another
        process's compile ran over 11x the others (CI), and perf_analyzer then exits 2 with no figures at all."""
        env = dict(os.environ, LD_LIBRARY_PATH=str(self.perf_analyzer.parent))
        command = [str(self.perf_analyzer), "-m", model, "-u", url, "-i", "http", "--concurrency-range",
                   str(concurrency), "--measurement-mode", "count_windows", "--measurement-request-count",
                   str(requests), "--max-trials", "10", "--stability-percentage", "100000", "--input-data", "zero",
                   "-f", str(out_csv), *extra]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "install":
        sys.exit("usage: python tests/engines.py install [DIR]")
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else engines_dir()
    install(target.resolve())
    print(f"engines installed in {target}")
