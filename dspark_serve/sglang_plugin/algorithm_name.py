"""The ``--speculative-algorithm`` value of ``DSPARK_SERVE`` as SGLang's string tests see it.

SGLang 0.5.23 decides some DSPARK behaviour by comparing the configured algorithm *name* with
``"DSPARK"`` (arg hooks, ``spec_utils.spec_need_hidden_states``, ``ModelConfig``, the KV pool
builder, ...; README.md lists them). Our worker runs SGLang's DSPARK machinery, so each of those
tests must take its DSPARK branch for ``DSPARK_SERVE`` too. ``AlgorithmName`` is the name string
that compares equal to both ``"DSPARK_SERVE"`` and ``"DSPARK"``; ``name_algorithm_step`` puts it
into SGLang's server-arg resolution at the first pipeline step, before any hook reads the name,
and every later copy (resolution stash, config bags, pickled records in the scheduler
processes) carries it. ``SpeculativeAlgorithm.from_string`` still resolves it to our registered
algorithm: enum and registry lookups hash, and it hashes as ``"DSPARK_SERVE"``.

No sglang import at module level (pickled records import this module in every process).
"""
from __future__ import annotations

from dspark_serve.sglang_plugin import ALGORITHM_NAME

# SGLang's builtin algorithm whose branches DSPARK_SERVE takes (SpeculativeAlgorithm.DSPARK.name).
BUILTIN_NAME = "DSPARK"
# The first ``run_hook`` step of SGLang's ``run_resolution_pipeline``: nothing reads
# ``speculative_algorithm`` before it.
FIRST_RESOLUTION_STEP = "handle_deprecated_dp_attention"


class AlgorithmName(str):
    """``"DSPARK_SERVE"``, equal to ``"DSPARK_SERVE"`` and ``"DSPARK"`` (module docstring).

    ``upper()`` and ``str()`` return the same object, because SGLang normalises the name with
    them before comparing. Hashes as ``"DSPARK_SERVE"``, so a set or dict keyed ``"DSPARK"``
    does not find it (no SGLang 0.5.23 site keys DSPARK that way; the site test checks).
    ``copy.deepcopy`` gives the plain string: SGLang's reporting surfaces (``/server_info``
    through ``ServerArgs.resolved_dict``) deep-copy values before msgspec encodes them, and
    msgspec refuses str subclasses.
    """

    def __new__(cls) -> AlgorithmName:
        return super().__new__(cls, ALGORITHM_NAME)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and (str.__eq__(other, ALGORITHM_NAME)
                                           or str.__eq__(other, BUILTIN_NAME))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__

    def upper(self) -> AlgorithmName:
        return self

    def __str__(self) -> AlgorithmName:
        return self

    def __reduce__(self):
        return (AlgorithmName, ())

    def __deepcopy__(self, memo) -> str:
        return ALGORITHM_NAME


ALGORITHM = AlgorithmName()


def name_algorithm_step(server_args, previous) -> None:
    """SGLang resolution-hook wrapper for ``FIRST_RESOLUTION_STEP``: declares
    ``speculative_algorithm = ALGORITHM`` when the operator asked for DSPARK_SERVE (any case),
    then runs the wrapped step."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    value = resolving_view(server_args).speculative_algorithm
    if (isinstance(value, str) and not isinstance(value, AlgorithmName)
            and value.upper() == ALGORITHM_NAME):
        declare_resolution(server_args, __name__, speculative_algorithm=ALGORITHM)
    previous(server_args)
