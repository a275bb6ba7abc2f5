"""tokenmill's C++ CPU kernels, compiled on first use and cached (torch.utils.cpp_extension).

The build needs a C++ compiler (g++ or clang) and takes about a minute on two cores; the result
lives in torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), keyed
by the sources (every file of csrc/) and this CPU's instruction-set flags, so later starts load it in well under a
second. `make install` builds it ahead of time (`python -m tokenmill.model.layers.cpu_kernels`).
When the build fails the engine logs why and falls back to the portable torch kernels.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

logger = logging.getLogger("tokenmill")

# One translation unit per operation family (decode attention, prefill attention, elementwise ops, block
# linear, int8 dot products, the fused decoder stack) and the bindings, sharing common.h and ops.h.
_SOURCE_DIR = Path(__file__).parent / "csrc"


def _sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_error: Optional[str] = None


def _cpu_flags() -> str:
    """The instruction-set flags the kernels are compiled for (-march=native)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo lists them (empty where it does not)."""
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") else set()


def _extension_name(variant: str = "") -> str:
    files = sorted(_SOURCE_DIR.glob("*.cpp")) + sorted(_SOURCE_DIR.glob("*.h"))
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)
                            + _cpu_flags().encode()).hexdigest()[:12]
    return f"tokenmill_cpu_kernels_{variant + '_' if variant else ''}{digest}"


# Narrower builds of the same source on a wider CPU, so tests run every SIMD path the kernels have.
VARIANT_DEFINES = {"avx2": ["-DTOKENMILL_NO_AVX512"], "portable": ["-DTOKENMILL_PORTABLE"]}


def _put_venv_scripts_on_path() -> None:
    """torch looks for `ninja` on PATH; the pip-installed one sits next to this interpreter."""
    import sysconfig

    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if scripts and scripts not in path.split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + path if path else scripts


def load(verbose: bool = False) -> Optional[ModuleType]:
    """The compiled module, or None when it cannot be built here (the reason is in `build_error()`)."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
            _error = "disabled by TOKENMILL_DISABLE_CPU_KERNELS"
            return None
        try:
            _module = _build("", verbose)
        except Exception as exc:  # a missing compiler, headers or an unsupported platform
            _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            logger.warning("CPU kernels unavailable (%s); using the torch attention backend", _error)
        return _module


def _build(variant: str, verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load as load_extension

    _put_venv_scripts_on_path()
    return load_extension(
        name=_extension_name(variant),
        sources=[str(path) for path in _sources()],
        # -ffp-contract=off: no implicit multiply-add fusion, so fp32 results round as torch's do.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *VARIANT_DEFINES.get(variant, [])],
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


def load_variant(variant: str) -> ModuleType:
    """A build limited to one SIMD path ("avx2", "portable") for tests; raises if it cannot be built."""
    if variant not in VARIANT_DEFINES:
        raise ValueError(f"unknown kernel variant {variant!r} (known: {', '.join(VARIANT_DEFINES)})")
    global _variants_compiled
    with _lock:
        if not _variants_compiled:
            _variants_compiled = True
            _compile_side_by_side(list(VARIANT_DEFINES))
        return _build(variant)


_variants_compiled = False


def _compile_side_by_side(variants: list[str]) -> None:
    """Builds the variants in child processes at once (each compiles its files in parallel too; ninja keeps
    the cores busy between one build's files). Each then loads from torch's extension cache; a child's failure
    is ignored here and raised by the in-process build."""
    import subprocess
    import sys

    code = "import sys; from tokenmill.model.layers import cpu_kernels; cpu_kernels._build(sys.argv[1])"
    children = [subprocess.Popen([sys.executable, "-c", code, variant], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for variant in variants]
    for child in children:
        child.wait()


def build_error() -> Optional[str]:
    return _error


# Compiled, not run, on every machine: the code paths its CPU lacks (AVX-512, VNNI, BF16 and AMX under
# Sapphire Rapids' flags; AVX2 alone under x86-64-v3), so an edit cannot break them unseen (`make test`).
COMPILE_CHECK_TARGETS = ("sapphirerapids", "x86-64-v3")


def compile_check(march: str, jobs: int = 2) -> list[str]:
    """Compiles every source for `-march=march` (object code discarded; -O0: the checks are the compiler's);
    returns one message per file that failed, with the compiler's first errors."""
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths

    flags = ["-std=c++20", "-O0", f"-march={march}", "-fopenmp", "-ffp-contract=off", "-fPIC",
             "-DTORCH_EXTENSION_NAME=tokenmill_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
             *(f"-isystem{path}" for path in (*include_paths(), sysconfig.get_paths()["include"]))]

    def compile_one(source: Path) -> Optional[str]:
        import subprocess

        result = subprocess.run([os.environ.get("CXX", "c++"), *flags, "-c", str(source), "-o", os.devnull],
                                capture_output=True, text=True)
        if result.returncode == 0:
            return None
        errors = [line for line in result.stderr.splitlines() if "error" in line][:5]
        return f"{source.name} (-march={march}): " + " | ".join(errors or result.stderr.splitlines()[-5:])

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return [message for message in pool.map(compile_one, [p for p in _sources() if p.suffix == ".cpp"])
                if message]


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    if "--compile-check" in sys.argv[1:]:
        failures = [message for march in COMPILE_CHECK_TARGETS for message in compile_check(march)]
        if failures:
            raise SystemExit("the kernels do not compile for every CPU kind:\n" + "\n".join(failures))
        print(f"compiled for {', '.join(COMPILE_CHECK_TARGETS)}")
        raise SystemExit(0)
    module = load(verbose=True)
    if module is None:
        raise SystemExit(f"could not build tokenmill's CPU kernels: {build_error()}")
    print(f"built {_extension_name()}")
    if "--test-variants" in sys.argv[1:]:
        # The narrower builds the tests run every SIMD path with (`make test` builds them before the tests).
        _compile_side_by_side(list(VARIANT_DEFINES))
        for variant in VARIANT_DEFINES:
            print(f"built {_extension_name(variant)}")
