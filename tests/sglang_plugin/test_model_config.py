"""The plugin's drafter contract on a config dict (no sglang import needed)."""
import pytest

from dspark_serve.sglang_plugin.model import check_drafter_config
from tests.drafter.conftest import deepspec_dict


def test_full_vocabulary_drafter_accepted():
    assert check_drafter_config(deepspec_dict(architectures=["X"])).draft_vocab_size is None


def test_pruned_draft_vocabulary_refused_with_reason():
    with pytest.raises(ValueError, match="no pruned draft vocabulary"):
        check_drafter_config(deepspec_dict(draft_vocab_size=16))


def test_anchor_context_drafter_refused_with_reason():
    with pytest.raises(ValueError, match="anchor_context"):
        check_drafter_config(deepspec_dict(anchor_context=True))
