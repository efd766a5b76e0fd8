"""The ``sglang.srt.plugins`` entry point (``setup.py``: ``dspark_serve =
dspark_serve.sglang_plugin.register:register``). SGLang's ``load_plugins()`` calls
``register()`` early in every process (engine, scheduler, detokenizer); it must stay cheap and
may run more than once per process (tests, ``load_plugins`` plus an explicit call).
"""
from __future__ import annotations

from dspark_serve.sglang_plugin import ALGORITHM_NAME, DRAFTER_ARCHITECTURE


_resolution_step_registered = False


def register() -> None:
    """Register our drafter architecture in ``ModelRegistry``, ``DSPARK_SERVE`` in
    ``SpeculativeAlgorithm``, and the resolution step that gives the configured name its
    DSPARK string semantics (``algorithm_name``). Idempotent. Raises ImportError without
    sglang installed."""
    global _resolution_step_registered
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from dspark_serve.sglang_plugin.algorithm_name import (FIRST_RESOLUTION_STEP,
                                                           name_algorithm_step)
    from dspark_serve.sglang_plugin.model import model_class
    from dspark_serve.sglang_plugin.server_args import validate_server_args
    from dspark_serve.sglang_plugin.spec_algo import DSparkServeSpecAlgo

    if DRAFTER_ARCHITECTURE not in ModelRegistry.models:
        ModelRegistry.models[DRAFTER_ARCHITECTURE] = model_class()
    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(ALGORITHM_NAME, supports_overlap=True,
                                      validate_server_args=validate_server_args,
                                      spec_class=DSparkServeSpecAlgo)(_worker_factory)
    if not _resolution_step_registered:
        register_resolution_hook(FIRST_RESOLUTION_STEP)(name_algorithm_step)
        _resolution_step_registered = True


def _worker_factory(server_args):
    """The worker class for ``create_worker`` (imported on first use: ~10 s of SGLang imports)."""
    from dspark_serve.sglang_plugin.worker import DSparkServeWorker

    return DSparkServeWorker
