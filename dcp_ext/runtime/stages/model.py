"""Build megatron-core's GPTModel for one pipeline stage of one layout.

The only choice made here is which kernels back the layers: transformer-engine's when it
imports and CUDA is present (THD, CP and sequence parallel handled by TE), otherwise the
local megatron-core spec with two substitutions that make it complete on the CPU: our
document-masked, CP-aware core attention and a torch norm that marks its parameters for
sequence parallelism (so finalize_model_grads sums their gradients over TP). The torch
norm also does megatron-core's zero-centred gamma (`layernorm_zero_centered_gamma`,
`--apply-layernorm-1p`: weight stored as gamma - 1, initialised to 0), and `--qk-layernorm`
gets the same norm over each head's dims.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch


def transformer_engine_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm scaling by (1 + weight); the weight starts at 0 (megatron-core's zero-centred gamma)."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm scaling by (1 + weight); the weight starts at 0, the bias at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


_NORMS = {("RMSNorm", False): torch.nn.RMSNorm, ("RMSNorm", True): ZeroCenteredRMSNorm,
          ("LayerNorm", False): torch.nn.LayerNorm, ("LayerNorm", True): ZeroCenteredLayerNorm}


def _torch_norm(config, hidden_size: int, eps: float):
    # on a GPU without transformer-engine the rest of the model is built on the device
    device = None if config.use_cpu_initialization else torch.cuda.current_device()
    kind = _NORMS.get((config.normalization, bool(config.layernorm_zero_centered_gamma)))
    if kind is None:
        raise ValueError(f"unsupported --normalization {config.normalization!r}: use LayerNorm or RMSNorm")
    return kind(hidden_size, eps=eps, dtype=config.params_dtype, device=device)


class TorchNorm:
    """LayerNorm/RMSNorm from torch whose parameters carry the `sequence_parallel` flag."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = _torch_norm(config, hidden_size, eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class QKNorm:
    """The norm of --qk-layernorm, over one head's dims. Each TP rank normalises its own heads,
    so its weight's gradient is a partial sum over TP: marked like a sequence-parallel norm
    (the static path sums q/k norm gradients over TP by name; the --dcp runtime pushes every
    TP rank's share of marked parameters)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = _torch_norm(config, hidden_size, eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def layer_spec(config, use_te: Optional[bool] = None, cpu_attention: str = "math"):
    """The transformer-layer spec for `config`: TE on GPUs with TE, the completed local spec
    otherwise, its document attention running `cpu_attention` ("math" or "flash",
    `--dcp-cpu-attention`)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = transformer_engine_usable()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=bool(config.qk_layernorm))
    from dcp_ext.runtime.stages.attention import DocumentCausalAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(specs.get_gpt_layer_local_spec(normalization=config.normalization,
                                                         qk_layernorm=bool(config.qk_layernorm)))
    sub = spec.submodules
    sub.input_layernorm = TorchNorm
    sub.pre_mlp_layernorm = TorchNorm
    sub.self_attention.submodules.core_attention = ModuleSpec(module=DocumentCausalAttention,
                                                              params={"kernel": cpu_attention})
    if config.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = QKNorm
        sub.self_attention.submodules.k_layernorm = QKNorm
    return spec


def block_spec(config, pp_rank: int, use_te: Optional[bool] = None, cpu_attention: str = "math"):
    """A block spec for pipeline stage `pp_rank`, so the final norm is ours too on the CPU
    (the local default norm refuses sequence parallel)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_te is None:
        use_te = transformer_engine_usable()
    spec = layer_spec(config, use_te, cpu_attention)
    if use_te:
        return spec
    num_layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TorchNorm)


def build_gpt_model(
    config,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool,
    post_process: bool,
    pg_collection=None,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = True,
    rotary_base: int = 10000,
    use_te: Optional[bool] = None,
    rotary_percent: float = 1.0,
    cpu_attention: str = "math",
    rope_scaling: bool = False,
    rope_scaling_factor: float = 8.0,
):
    from megatron.core.models.gpt import GPTModel

    if pg_collection is not None:
        pp_rank = pg_collection.pp.rank()
    else:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, pp_rank, use_te, cpu_attention),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        pg_collection=pg_collection,
    )
