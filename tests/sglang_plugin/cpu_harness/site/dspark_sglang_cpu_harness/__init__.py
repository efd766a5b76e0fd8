"""SGLang CPU test harness for the dspark-serve plugin (tests only; never installed).

sglang 0.5.23 discovers it through its ``sglang.srt.plugins`` entry point (the ``.dist-info``
beside this package) only when this ``site`` directory is on ``PYTHONPATH``, which only the
end-to-end tests' server processes have. It lets stock SGLang serve DSPARK and DSPARK_SERVE on
a CPU (``patches``); the ``sgl_kernel`` stand-in in the same directory supplies the CPU ops.
"""
import logging

from .patching import SGLANG_VERSION, TargetMoved, check_sglang_version

logger = logging.getLogger(__name__)


def register() -> None:
    """The entry point: check the sglang version, apply every patch. A moved target stops the
    process (SystemExit, which sglang's plugin loader does not swallow) instead of serving
    with half the patches."""
    from .patches import install_all

    try:
        check_sglang_version()
        install_all()
    except TargetMoved as moved:
        logger.critical("dspark CPU harness: %s", moved)
        raise SystemExit(f"dspark CPU harness cannot patch this sglang: {moved}") from moved
    logger.info("dspark CPU harness: patches for sglang %s applied", SGLANG_VERSION)
