"""Every place installed SGLang decides on "DSPARK" takes the DSPARK branch for DSPARK_SERVE.

The site test reads SGLang's own source: it finds each comparison against "DSPARK" (or a tuple
holding it, or SpeculativeAlgorithm.DSPARK) in ``sglang/srt``, evaluates that very expression
with our name / algorithm object in place of the configured one, and requires the result the
builtin DSPARK gets. A new or rewritten site in a future SGLang is evaluated the same way, and
an expression the test cannot evaluate fails it.
"""
import ast
import copy
import inspect
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

sglang = pytest.importorskip("sglang", reason="sglang not installed (pip install 'dspark-serve[sglang]')")

import msgspec  # noqa: E402  (an sglang dependency)

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_registry import CustomSpecAlgo  # noqa: E402

from dspark_serve.sglang_plugin import ALGORITHM_NAME  # noqa: E402
from dspark_serve.sglang_plugin.algorithm_name import (ALGORITHM, BUILTIN_NAME,  # noqa: E402
                                                       FIRST_RESOLUTION_STEP, name_algorithm_step)
from dspark_serve.sglang_plugin.register import register  # noqa: E402

SRT = Path(sglang.__file__).parent / "srt"
# The enum's own predicate definitions (``self == SpeculativeAlgorithm.DSPARK``): our spec
# class overrides every one of them (test_predicates_answer_like_builtin_dspark).
SKIP = {SRT / "speculative" / "spec_info.py"}
NAME_ATTRS = {"speculative_algorithm"}      # the configured name (str)
OBJECT_ATTRS = {"spec_algorithm"}           # the algorithm object


@pytest.fixture(scope="module")
def ours():
    register()
    return SpeculativeAlgorithm.from_string(ALGORITHM_NAME)


def _mentions_dspark(node, bindings, depth=0) -> bool:
    if isinstance(node, ast.Constant):
        return node.value == BUILTIN_NAME
    if isinstance(node, ast.Attribute):
        return node.attr == BUILTIN_NAME
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_mentions_dspark(e, bindings, depth) for e in node.elts)
    if isinstance(node, ast.Name) and node.id in bindings and depth < 3:
        return _mentions_dspark(bindings[node.id], bindings, depth + 1)
    return False


class _Subject(ast.NodeTransformer):
    """Replace the configured name / object by placeholders; inline local bindings."""

    def __init__(self, bindings):
        self.bindings = bindings
        self.inlining: set[str] = set()

    def visit_Attribute(self, node):
        if node.attr in NAME_ATTRS:
            return ast.Name("__name__value", ast.Load())
        if node.attr in OBJECT_ATTRS:
            return ast.Name("__algo__value", ast.Load())
        return self.generic_visit(node)

    def visit_Name(self, node):
        if node.id not in self.bindings or node.id in self.inlining:
            return node
        self.inlining.add(node.id)
        value = self.visit(copy.deepcopy(self.bindings[node.id]))
        self.inlining.discard(node.id)
        return value


def _bindings_before(scope, line, module_bindings):
    found = dict(module_bindings)
    for node in ast.walk(scope):
        if (isinstance(node, ast.Assign) and node.lineno < line and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            prev = found.get(node.targets[0].id)
            if prev is None or getattr(prev, "lineno", 0) <= node.lineno:
                found[node.targets[0].id] = node.value
    return found


def _sites():
    """(file:line, compiled expression) of every comparison deciding on DSPARK."""
    sites = {}
    for path in sorted(SRT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path in SKIP or "DSPARK" not in text:
            continue
        tree = ast.parse(text)
        module_bindings = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                           for t in n.targets if isinstance(t, ast.Name)}
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in [tree, *scopes]:
            body_nodes = scope.body if scope is tree else [scope]
            for top in body_nodes:
                if scope is tree and isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.ClassDef)):
                    continue        # functions are their own scopes; classes hold methods
                for node in ast.walk(top):
                    if not isinstance(node, ast.Compare):
                        continue
                    bindings = (module_bindings if scope is tree else
                                _bindings_before(scope, node.lineno, module_bindings))
                    operands = [node.left, *node.comparators]
                    if not any(_mentions_dspark(o, bindings) for o in operands):
                        continue
                    expr = ast.Expression(_Subject(bindings).visit(copy.deepcopy(node)))
                    ast.fix_missing_locations(expr)
                    where = f"{path.relative_to(SRT)}:{node.lineno}"
                    sites.setdefault(where, compile(expr, where, "eval"))
    return sorted(sites.items())


def _eval(code, name, algo):
    return eval(code, {"SpeculativeAlgorithm": SpeculativeAlgorithm, "str": str},
                {"__name__value": name, "__algo__value": algo})


def test_every_dspark_site_takes_the_dspark_branch(ours):
    sites = _sites()
    # 0.5.23 has 29 such comparisons in 16 files; fewer means the scan went blind.
    assert len(sites) >= 29, [w for w, _ in sites]
    plain = CustomSpecAlgo(ALGORITHM_NAME, factory=None)
    wrong, errors, needed = [], [], []
    for where, code in sites:
        try:
            builtin = _eval(code, BUILTIN_NAME, SpeculativeAlgorithm.DSPARK)
            got = _eval(code, ALGORITHM, ours)
            without = _eval(code, ALGORITHM_NAME, plain)
        except Exception as exc:   # an expression shape this test does not model
            errors.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        if got != builtin:
            wrong.append(f"{where}: {got!r} != DSPARK's {builtin!r}")
        if without != builtin:
            needed.append(where)
    assert not errors and not wrong, errors + wrong
    # The plain name / CustomSpecAlgo takes the other branch at every 0.5.23 site.
    assert len(needed) == len(sites), sorted({w for w, _ in sites} - set(needed))


def test_predicates_answer_like_builtin_dspark(ours):
    dspark = SpeculativeAlgorithm.DSPARK
    names = sorted(n for n in vars(SpeculativeAlgorithm) if n.startswith(("is_", "supports_"))
                   or n in ("need_topk", "has_draft_kv", "carries_draft_hidden_states"))
    assert len(names) >= 20
    assert {n: getattr(ours, n)() for n in names} == {n: getattr(dspark, n)() for n in names}
    for is_draft in (True, False):
        assert (ours.get_num_tokens_per_req_for_target_verify(8, is_draft)
                == dspark.get_num_tokens_per_req_for_target_verify(8, is_draft))
    assert ours == dspark and dspark == ours and ours != SpeculativeAlgorithm.DFLASH
    assert ours in (SpeculativeAlgorithm.EAGLE, SpeculativeAlgorithm.DSPARK)


def test_name_semantics():
    assert BUILTIN_NAME == SpeculativeAlgorithm.DSPARK.name
    assert ALGORITHM == "DSPARK" and "DSPARK" == ALGORITHM and ALGORITHM == "DSPARK_SERVE"
    assert ALGORITHM != "DFLASH" and not (ALGORITHM != "DSPARK") and ALGORITHM != "dspark"
    assert ALGORITHM.upper() is ALGORITHM and str(ALGORITHM) is ALGORITHM
    assert hash(ALGORITHM) == hash("DSPARK_SERVE") and ALGORITHM not in {"DSPARK"}
    assert type(pickle.loads(pickle.dumps(ALGORITHM))) is type(ALGORITHM)
    plain = copy.deepcopy(ALGORITHM)
    assert type(plain) is str and plain == "DSPARK_SERVE"
    assert msgspec.json.encode({"a": plain}) == b'{"a":"DSPARK_SERVE"}'


def test_name_resolves_to_our_algorithm(ours):
    from sglang.srt.arg_groups.speculative_hook import _resolve_speculative_algorithm_alias
    assert SpeculativeAlgorithm.from_string(ALGORITHM) is ours
    assert SpeculativeAlgorithm.from_string("DSPARK") is SpeculativeAlgorithm.DSPARK
    # handle_speculative_decoding's normalisation keeps the object.
    assert _resolve_speculative_algorithm_alias(ALGORITHM.upper(), None) is ALGORITHM


def test_resolution_step_declares_the_name_first():
    from sglang.srt.arg_groups import pipeline, resolution_hooks
    from sglang.srt.arg_groups.overrides import resolving_view, resolution_result
    register()
    register()
    assert resolution_hooks._HOOKS[FIRST_RESOLUTION_STEP].count(name_algorithm_step) == 1
    # The step is the pipeline's first run_hook call, and nothing before it reads the name.
    fn = ast.parse(inspect.getsource(pipeline.run_resolution_pipeline)).body[0]
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "run_hook"]
    first = min(calls, key=lambda c: c.lineno)
    assert first.args[0].id == FIRST_RESOLUTION_STEP
    assert not [n for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                and n.attr == "speculative_algorithm" and n.lineno < first.lineno]

    ran = []
    args = SimpleNamespace(speculative_algorithm="dspark_serve")
    name_algorithm_step(args, ran.append)
    assert ran == [args]
    assert resolving_view(args).speculative_algorithm is ALGORITHM
    assert resolution_result(args, "speculative_algorithm") is ALGORITHM
    other = SimpleNamespace(speculative_algorithm="DSPARK")
    name_algorithm_step(other, ran.append)
    assert resolving_view(other).speculative_algorithm == "DSPARK"
    assert type(resolving_view(other).speculative_algorithm) is str


def test_runtime_site_spec_need_hidden_states(monkeypatch):
    """The FutureMap asks this (get_spec() bag) whether to relay hidden states: not for DSPARK."""
    from sglang.srt.speculative import spec_utils
    monkeypatch.setattr(spec_utils, "get_spec", lambda: SimpleNamespace(
        speculative_algorithm=ALGORITHM, enable_multi_layer_eagle=False))
    assert spec_utils.spec_need_hidden_states() is False
    monkeypatch.setattr(spec_utils, "get_spec", lambda: SimpleNamespace(
        speculative_algorithm=ALGORITHM_NAME, enable_multi_layer_eagle=False))
    assert spec_utils.spec_need_hidden_states() is True
