"""The perf_analyzer binary of the tritonclient 2.51 wheel, and the two libraries it lacks.

    python -m perf_analyzer_configs.deps        # fetch what is missing; print the environment to use

The wheel puts `perf_analyzer` in the venv's bin/, linked against `libb64.so.0d` and
`libcudart.so.12`, which Debian 12 and a CPU machine do not have. Both are fetched into
perf_analyzer_configs/.work/deps/ (git-ignored), nothing is installed system-wide:

  libb64.so.0d     Debian's `libb64-0d` (1.2-5+b1 on Debian 12): `apt-get download`, then `dpkg -x`
  libcudart.so.12  PyPI's `nvidia-cuda-runtime-cu12` (CUDART below): `pip install --target`

`ensure()` (the runner calls it) checks the binary with `ldd` against that folder and fetches only
what is still missing, so a machine whose perf_analyzer already resolves both (the NGC image)
fetches nothing. A machine without network (the lent GPU machine) needs the folder carried over
from one that fetched it. libcudart is loaded even on a CPU: perf_analyzer links it for CUDA
shared memory, which these runs do not use.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEPS = Path(__file__).resolve().parent / ".work" / "deps"
LIBB64_PACKAGE = "libb64-0d"  # its soname libb64.so.0d is what the binary wants, whatever the Debian release
CUDART = "nvidia-cuda-runtime-cu12==12.9.79"
LIBRARY_DIRS = {  # library -> the folder it lands in once fetched
    "libb64.so.0d": DEPS / "libb64" / "usr" / "lib" / "x86_64-linux-gnu",
    "libcudart.so.12": DEPS / "cudart" / "nvidia" / "cuda_runtime" / "lib",
}


def binary() -> Path:
    """perf_analyzer where the tritonclient wheel put it: the venv's bin/ (beside this interpreter),
    or TARGET/bin for a `pip install --target TARGET` (how the GPU machine gets its wheels); else PATH."""
    import tritonclient

    site = Path(tritonclient.__file__).resolve().parents[1]
    for candidate in (Path(sys.executable).parent / "perf_analyzer", site / "bin" / "perf_analyzer"):
        if candidate.is_file():
            return candidate
    if found := shutil.which("perf_analyzer"):
        return Path(found)
    raise FileNotFoundError("no perf_analyzer: it comes with the tritonclient wheel "
                            "(pip install 'tritonclient[grpc]==2.51.0', pinned in pyproject.toml)")


def environment() -> dict[str, str]:
    """os.environ with the fetched libraries' folders first on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    dirs = [str(d) for d in LIBRARY_DIRS.values()] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs)
    return env


def missing_libraries(path: Path, env: dict[str, str]) -> list[str]:
    """The shared libraries ldd cannot resolve for the binary under env."""
    out = subprocess.run(["ldd", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def fetch_libb64() -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError(f"libb64.so.0d: no apt-get/dpkg here; put the library from Debian's {LIBB64_PACKAGE} "
                           f"package in {LIBRARY_DIRS['libb64.so.0d']}")
    with tempfile.TemporaryDirectory() as tmp:
        download = ["apt-get", "download", LIBB64_PACKAGE]
        got = subprocess.run(download, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if got.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
            subprocess.run(["apt-get", "update", "-qq"], check=False)  # a fresh image may have no package lists
            got = subprocess.run(download, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if got.returncode != 0:
            raise RuntimeError(f"apt-get download {LIBB64_PACKAGE} failed (try apt-get update):\n{got.stdout}")
        (deb,) = Path(tmp).glob("*.deb")
        (DEPS / "libb64").mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg", "-x", str(deb), str(DEPS / "libb64")], check=True)


def fetch_cudart() -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                    "--target", str(DEPS / "cudart"), CUDART], check=True)


FETCH = {"libb64.so.0d": fetch_libb64, "libcudart.so.12": fetch_cudart}


def ensure() -> tuple[Path, dict[str, str]]:
    """(perf_analyzer, the environment it runs in), fetching the missing libraries first."""
    path, env = binary(), environment()
    missing = missing_libraries(path, env)
    for library in missing:
        if library not in FETCH:
            raise RuntimeError(f"perf_analyzer needs {library}, which this script does not know how to fetch")
        print(f"fetching {library} into {DEPS} ...", flush=True)
        FETCH[library]()
    if missing and (still := missing_libraries(path, env)):
        raise RuntimeError(f"perf_analyzer still lacks {', '.join(still)} after fetching them into {DEPS}")
    return path, env


def version(path: Path, env: dict[str, str]) -> str:
    """perf_analyzer's version string, e.g. "2.51.0"."""
    out = subprocess.run([str(path), "--version"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, check=True).stdout
    return out.split("Version", 1)[-1].split()[0] if "Version" in out else out.strip()


def main() -> int:
    path, env = ensure()
    print(f"perf_analyzer {version(path, env)}: {path}")
    print(f"export LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
