"""The harness's patches of sglang 0.5.23, one function each; ``install_all`` applies them.

File references are to ``site-packages/sglang/`` of sglang 0.5.23. None of them is needed on a
GPU; all run in the test's server processes only.
"""
from __future__ import annotations

import functools

import torch

from .patching import checked_target, replace


class _OnCuda:
    """Read-through view of a config object whose ``device`` reads "cuda"."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return "cuda" if name == "device" else getattr(self._inner, name)


def let_dspark_run_on_cpu() -> None:
    """``srt/arg_groups/speculative_hook.py`` ``_handle_dspark`` refuses any device but
    CUDA/NPU/XPU before anything device-specific happens; run it with a view whose device
    reads "cuda" (the rest of the handler resolves the same on CPU)."""
    from sglang.srt.arg_groups import speculative_hook

    checked_target(speculative_hook, "resolving_view")

    def make(original):
        @functools.wraps(original)
        def handle_dspark(server_args):
            real_view = speculative_hook.resolving_view
            speculative_hook.resolving_view = lambda args: _OnCuda(real_view(args))
            try:
                return original(server_args)
            finally:
                speculative_hook.resolving_view = real_view
        return handle_dspark

    replace(speculative_hook, "_handle_dspark", make,
            anchors=("cfg = resolving_view(server_args)",
                     'if not cfg.device.startswith(("cuda", "npu", "xpu")):'))


def let_dspark_serve_run_on_cpu() -> None:
    """Our ``DSPARK_SERVE`` validator (``dspark_serve.sglang_plugin.server_args``) refuses
    without a CUDA GPU; give it a CUDA view of the server args. Registers our plugin first
    (idempotent), so the order in which sglang loads the two plugins does not matter."""
    from sglang.srt.speculative.spec_registry import get_spec

    from dspark_serve.sglang_plugin import ALGORITHM_NAME
    from dspark_serve.sglang_plugin.register import register

    register()
    spec = get_spec(ALGORITHM_NAME)

    def make(original):
        @functools.wraps(original)
        def validate(server_args):
            return original(_OnCuda(server_args), cuda_available=True)
        return validate

    replace(spec, "validate_server_args", make)


def allow_torch_native_drafts() -> None:
    """The draft worker falls back to flashinfer for a backend outside
    ``DRAFT_ATTENTION_BACKEND_CHOICES`` (``srt/speculative/draft_worker_common.py``); add
    torch_native through sglang's public extension point (``srt/arg_groups/choices.py``)."""
    from sglang.srt.arg_groups.choices import (DRAFT_ATTENTION_BACKEND_CHOICES,
                                               add_draft_attention_backend_choices)

    if "torch_native" not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices(["torch_native"])


def ignore_record_stream_on_cpu() -> None:
    """``DSparkWorkerV2._forward_decode`` calls ``batch.seq_lens.record_stream(...)``
    (``srt/speculative/dspark_components/dspark_worker_v2.py``), which raises for CPU tensors;
    a CPU tensor has no stream to record, so make it a no-op there."""
    from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2

    checked_target(DSparkWorkerV2, "_forward_decode",
                   anchors=("batch.seq_lens.record_stream(",))

    def make(original):
        @functools.wraps(original)
        def record_stream(tensor, stream):
            if tensor.device.type == "cpu":
                return None
            return original(tensor, stream)
        return record_stream

    replace(torch.Tensor, "record_stream", make)


def add_torch_native_target_verify() -> None:
    """``TorchNativeAttnBackend.forward_extend`` has no TARGET_VERIFY mode
    (``srt/layers/attention/torch_native_backend.py``); route verify batches to
    ``target_verify.forward_target_verify``."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from .target_verify import forward_target_verify

    def make(original):
        @functools.wraps(original)
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if forward_batch.forward_mode.is_target_verify():
                return forward_target_verify(self, q, k, v, layer, forward_batch,
                                             save_kv_cache)
            return original(self, q, k, v, layer, forward_batch, save_kv_cache)
        return forward_extend

    replace(TorchNativeAttnBackend, "forward_extend", make,
            anchors=("forward_batch.extend_prefix_lens", "self._run_sdpa_forward_extend("))


def use_torch_chain_sampling() -> None:
    """DSPARK's sampling accept calls the Triton ``chain_speculative_sampling_triton`` even on
    its torch path (``kernels/ops/speculative/dspark/dspark_accept.py``,
    ``_accept_sampling_core``); bind the module's name to ``chain_sampling``'s torch port."""
    from sglang.kernels.ops.speculative.dspark import dspark_accept

    from .chain_sampling import chain_speculative_sampling

    checked_target(dspark_accept, "_accept_sampling_core",
                   anchors=("sampling_fn = chain_speculative_sampling_triton",))
    replace(dspark_accept, "chain_speculative_sampling_triton",
            lambda original: functools.wraps(original)(chain_speculative_sampling))


PATCHES = (let_dspark_run_on_cpu, let_dspark_serve_run_on_cpu, allow_torch_native_drafts,
           ignore_record_stream_on_cpu, add_torch_native_target_verify, use_torch_chain_sampling)


def install_all() -> None:
    """Apply every patch (idempotent)."""
    for patch in PATCHES:
        patch()
