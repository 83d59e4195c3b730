"""Hugging Face model families as megatron-core's GPTModel: a config.json as Megatron flags,
its tensors as ours, and back.

Why a module of its own: tools/checkpoint_hf.py moves files, vocabularies and checkpoints;
the facts of each family live here, one place per family: which config field means which
flag, which Hugging Face tensor is which of ours, and what the GPT model here cannot express,
refused in one `error:` line naming it (an `HFError`).

    llama    q/k/v/o + gate/up/down; attention_bias and mlp_bias together: every linear's
             bias (no --disable-bias-linear); Llama 3.1's RoPE scaling (--use-rope-scaling)
    mistral  as llama, no biases; sliding_window only where it covers max_position_embeddings
    qwen2    a bias on q/k/v only (--add-qkv-bias)
    qwen3    RMSNorm over each head's dims on queries and keys, before RoPE (--qk-layernorm)
    phi3     one qkv_proj (all queries, then keys, then values) and one gate_up_proj,
             split here; partial_rotary_factor as --rotary-percent
    refused  gemma / gemma2 / gemma3_text (no embedding scale, no GELU-gated MLP, ...),
             active sliding windows, RoPE scalings other than Llama 3.1's with its fixed
             constants, a Llama output-projection bias without MLP biases (or the reverse),
             Qwen3's attention_bias (q/k/v/o without the MLP), weights of other sizes

Layouts (megatron-core's GPTModel, TP1 names): fused `linear_qkv` is, per query group,
[that group's query heads, its key head, its value head]; `linear_fc1` is [gate; up];
zero rows pad the vocabulary as Megatron pads it.
"""
from __future__ import annotations

from dataclasses import dataclass


class HFError(RuntimeError):
    """A model or request this tool cannot handle; the message is one line."""


# ---------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """What one Hugging Face family's layers hold beyond Llama's."""
    architecture: str
    fused: bool = False  # one qkv_proj and one gate_up_proj per layer (Phi-3)
    qk_norm: bool = False  # q_norm / k_norm over each head's dims, always there (Qwen3)
    qkv_bias: bool = False  # a bias on q/k/v only, always there (Qwen2)
    bias_fields: tuple = ()  # config flags that add biases: ("attention_bias", "mlp_bias") = Llama's
    partial_rotary: bool = False  # its attention rotates the first partial_rotary_factor of each head (Phi-3)
    window_switch: str | None = None  # the flag that turns sliding_window on (Qwen's), else it is on when set
    head_dim: int | None = None  # transformers' default where config.json has none (else hidden / heads)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", bias_fields=("attention_bias", "mlp_bias")),
    "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, window_switch="use_sliding_window"),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, bias_fields=("attention_bias",),
                    window_switch="use_sliding_window", head_dim=128),
    "phi3": Family("Phi3ForCausalLM", fused=True, partial_rotary=True),
}
SUPPORTED = tuple(FAMILIES)
GEMMA_LIKE = ("gemma", "gemma2", "gemma3_text")


@dataclass
class Shape:
    """What the GPT model needs to know of a model of one of FAMILIES."""
    model_type: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int  # the Hugging Face vocabulary (rows of its embedding)
    eps: float
    rope_base: int
    max_positions: int
    tied: bool
    qkv_bias: bool  # a bias on q/k/v only (--add-qkv-bias)
    rope_scaling: float | None = None  # Llama 3.1's frequency scaling factor, if any
    qk_norm: bool = False  # --qk-layernorm
    linear_bias: bool = False  # a bias on every linear (no --disable-bias-linear)
    rotary_percent: float = 1.0  # the rotated fraction of each head (--rotary-percent)

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]


# megatron-core 0.16.1's RotaryEmbedding calls its Llama 3.1 scaling with these built in;
# only the factor is a flag (--rope-scaling-factor)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ------------------------------------------------------------ config.json -> Shape
def _rope(cfg: dict) -> tuple[float, str, dict]:
    """(rope_theta, rope type, its parameters): transformers 5's `rope_parameters` or the older
    top-level `rope_theta` and `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default"
    return float(theta), kind, dict(params, **scaling)


def _rope_scaling(kind: str, params: dict, where: str) -> float | None:
    """The --rope-scaling-factor of a llama3-scaled RoPE (None: unscaled); other kinds refused."""
    if kind == "default":
        return None
    if kind != "llama3":
        extra = " (Phi-3's long-context per-dimension factors)" if kind in ("longrope", "su") else ""
        raise HFError(f"{where}: RoPE scaling {kind!r}{extra} is not supported by this fork's GPT model "
                      "(megatron-core 0.16.1 has Llama 3.1's 'llama3' only, --use-rope-scaling); convert a model "
                      "without it")
    fixed = {k: params.get(k) for k in LLAMA3_FIXED}
    differ = {k: v for k, v in fixed.items() if v is None or float(v) != float(LLAMA3_FIXED[k])}
    if differ:
        raise HFError(f"{where}: llama3 RoPE scaling with {differ}: megatron-core 0.16.1's --use-rope-scaling has "
                      f"{LLAMA3_FIXED} built in (only --rope-scaling-factor is a flag); no fix but a model with "
                      "those values")
    return float(params.get("factor", 8.0))


def _partial_rotary(cfg: dict, params: dict) -> float:
    for value in (cfg.get("partial_rotary_factor"), params.get("partial_rotary_factor")):
        if value is not None:
            return float(value)
    return 1.0


def _refuse_gemma(cfg: dict, kind: str, where: str) -> None:
    """Gemma's model is Llama's plus what megatron-core's GPTModel here cannot express; name it all."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    lacks = ["an embedding scale (Gemma multiplies the embeddings by sqrt(hidden_size); megatron-core's GPTModel "
             "has none, and the output layer tied to the embeddings keeps it out of the weights)",
             f"a GELU-gated MLP ({act}; --swiglu gates with SiLU only)"]
    if kind != "gemma":
        lacks.append("norms after attention and after the MLP (post_attention/post_feedforward_layernorm; "
                     "megatron-core's layer normalises before them only)")
    caps = [f for f in ("attn_logit_softcapping", "final_logit_softcapping") if cfg.get(f) is not None]
    if caps:
        lacks.append(f"logit softcapping ({', '.join(caps)}; megatron-core 0.16.1 has none)")
    if kind != "gemma" and cfg.get("sliding_window") is not None:
        lacks.append("sliding-window attention on some layers (not wired into this fork's attention)")
    raise HFError(f"{where}: model_type {kind!r} cannot be expressed by this fork's GPT model (the (1 + weight) "
                  f"RMSNorm and head_dim would be: --apply-layernorm-1p, --kv-channels); it lacks "
                  f"{'; '.join(lacks)}; no fix but another model")


def shape_from_config(cfg: dict, where: str) -> Shape:
    """The model's Shape, or one line naming what GPTModel here cannot express and the fix."""
    try:
        return _shape(cfg, where)
    except (KeyError, TypeError, ValueError) as e:
        what = f"no field {e.args[0]!r}" if isinstance(e, KeyError) else f"a field of the wrong type ({e})"
        raise HFError(f"{where}: {what}") from None


def _shape(cfg: dict, where: str) -> Shape:
    kind = cfg.get("model_type")
    if kind in GEMMA_LIKE:
        _refuse_gemma(cfg, kind, where)
    if kind not in FAMILIES:
        raise HFError(f"{where}: model_type {kind!r} is not supported; this tool converts {', '.join(SUPPORTED)}")
    family = FAMILIES[kind]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{where}: hidden_act {act!r}: the GPT model here has SwiGLU (silu) only; no fix but another "
                      "model")
    theta, rope_kind, rope_params = _rope(cfg)
    rope_scaling = _rope_scaling(rope_kind, rope_params, where)
    if theta != int(theta):
        raise HFError(f"{where}: rope_theta {theta} is not an integer (--rotary-base takes one)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or family.head_dim or hidden // heads)
    rotary = _partial_rotary(cfg, rope_params)
    if rotary != 1.0:
        if not family.partial_rotary:
            raise HFError(f"{where}: partial_rotary_factor {rotary}: the Hugging Face {kind!r} model rotates every "
                          "dim of a head; partial RoPE is read for phi3 only (its --rotary-percent)")
        if not 0.0 < rotary < 1.0 or int(head_dim * rotary) % 2:
            raise HFError(f"{where}: partial_rotary_factor {rotary} of head_dim {head_dim}: the rotated dims must "
                          "be an even number above 0")
    _refuse_sliding_window(cfg, family, where)
    linear_bias = _biases(cfg, family, kind, where)
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise HFError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    return Shape(model_type=kind, layers=int(cfg["num_hidden_layers"]), hidden=hidden,
                 ffn=int(cfg["intermediate_size"]), heads=heads, groups=groups, head_dim=head_dim,
                 vocab=int(cfg["vocab_size"]), eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_base=int(theta),
                 max_positions=int(cfg.get("max_position_embeddings", 4096)),
                 tied=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=family.qkv_bias,
                 rope_scaling=rope_scaling, qk_norm=family.qk_norm, linear_bias=linear_bias, rotary_percent=rotary)


def _biases(cfg: dict, family: Family, kind: str, where: str) -> bool:
    """True where every linear has a bias (Llama with attention_bias and mlp_bias); a bias
    Megatron cannot place alone is refused."""
    on = [f for f in family.bias_fields if cfg.get(f)]
    if not on:
        return False
    if on == ["attention_bias", "mlp_bias"]:
        return True
    why = ("Megatron puts biases on q/k/v only (--add-qkv-bias) or on every linear (q/k/v, the output projection "
           "and the MLP: no --disable-bias-linear)")
    if on == ["mlp_bias"]:
        raise HFError(f"{where}: mlp_bias is true and attention_bias false: {why}; MLP biases alone are neither")
    mlp = "mlp_bias false" if "mlp_bias" in family.bias_fields else f"no MLP bias in {kind!r}"
    raise HFError(f"{where}: attention_bias is true with {mlp}: its q/k/v/o biases without MLP biases cannot be "
                  f"expressed: {why}")


def _refuse_sliding_window(cfg: dict, family: Family, where: str) -> None:
    window = cfg.get("sliding_window")
    sliding_layers = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    positions = int(cfg.get("max_position_embeddings", 0) or 0)
    if family.window_switch:
        active = bool(cfg.get(family.window_switch)) or bool(sliding_layers)
    else:
        active = window is not None and int(window) < positions or bool(sliding_layers)
    if active:
        raise HFError(f"{where}: sliding-window attention is active (sliding_window {window}, "
                      f"max_position_embeddings {positions}): this fork's attention has no window (upstream's "
                      "--window-size is not wired into its GPT model, nor into the CPU document attention of "
                      "either path), so tokens past the window would see further back than in Hugging Face; "
                      "convert a model with full attention (sliding_window null or >= max_position_embeddings)")


def megatron_flags(shape: Shape) -> list[str]:
    """The model-shaping Megatron flags of `shape` (tokenizer and vocabulary flags apart)."""
    flags = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
             "--ffn-hidden-size", str(shape.ffn), "--num-attention-heads", str(shape.heads)]
    if shape.groups != shape.heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.groups)]
    if shape.head_dim * shape.heads != shape.hidden:
        flags += ["--kv-channels", str(shape.head_dim)]
    flags += ["--max-position-embeddings", str(shape.max_positions), "--position-embedding-type", "rope",
              "--rotary-base", str(shape.rope_base)]
    if shape.rotary_percent != 1.0:
        flags += ["--rotary-percent", repr(shape.rotary_percent)]
    if shape.rope_scaling is not None:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(shape.rope_scaling)]
    flags += ["--normalization", "RMSNorm", "--norm-epsilon", repr(shape.eps), "--swiglu"]
    if not shape.linear_bias:
        flags.append("--disable-bias-linear")
    if shape.qkv_bias:
        flags.append("--add-qkv-bias")
    if shape.qk_norm:
        flags.append("--qk-layernorm")
    if not shape.tied:
        flags.append("--untie-embeddings-and-output-weights")
    return flags + ["--hidden-dropout", "0", "--attention-dropout", "0"]


# -------------------------------------------------------------- HF names <-> ours
def hf_to_canonical(hf: dict, shape: Shape, rows: int) -> dict:
    """{our TP1 parameter name: tensor} from Hugging Face tensors (fp32, vocabulary padded to `rows`)."""
    import torch

    expected = hf_shapes(shape)

    def take(name):
        if name not in hf:
            raise HFError(f"the weights have no tensor {name} (config.json says {shape.model_type}, {shape.layers} "
                          f"layers, {'tied' if shape.tied else 'untied'} embeddings)")
        if tuple(hf[name].shape) != expected[name]:
            raise HFError(f"the weights' {name} is {list(hf[name].shape)}, config.json's sizes give "
                          f"{list(expected[name])}: the config does not belong to these weights")
        return hf[name].float()

    def pad_rows(t):
        out = torch.zeros((rows,) + tuple(t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    d = shape.head_dim
    sizes = [shape.heads * d, shape.groups * d, shape.groups * d]
    out = {"embedding.word_embeddings.weight": pad_rows(take("model.embed_tokens.weight"))}
    for i in range(shape.layers):
        hf_p, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        att, mlp = hf_p + "self_attn.", hf_p + "mlp."
        if shape.family.fused:
            q, k, v = take(att + "qkv_proj.weight").split(sizes, dim=0)
        else:
            q, k, v = (take(att + n + ".weight") for n in ("q_proj", "k_proj", "v_proj"))
        out[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, shape)
        if shape.qkv_bias or shape.linear_bias:
            qb, kb, vb = (take(att + n + ".bias")[:, None] for n in ("q_proj", "k_proj", "v_proj"))
            out[ours + "self_attention.linear_qkv.bias"] = fuse_qkv(qb, kb, vb, shape)[:, 0]
        if shape.qk_norm:
            out[ours + "self_attention.q_layernorm.weight"] = take(att + "q_norm.weight")
            out[ours + "self_attention.k_layernorm.weight"] = take(att + "k_norm.weight")
        out[ours + "self_attention.linear_proj.weight"] = take(att + "o_proj.weight")
        out[ours + "input_layernorm.weight"] = take(hf_p + "input_layernorm.weight")
        out[ours + "pre_mlp_layernorm.weight"] = take(hf_p + "post_attention_layernorm.weight")
        if shape.family.fused:
            out[ours + "mlp.linear_fc1.weight"] = take(mlp + "gate_up_proj.weight")  # [gate; up] already
        else:
            out[ours + "mlp.linear_fc1.weight"] = torch.cat([take(mlp + "gate_proj.weight"),
                                                             take(mlp + "up_proj.weight")], dim=0)
        out[ours + "mlp.linear_fc2.weight"] = take(mlp + "down_proj.weight")
        if shape.linear_bias:
            out[ours + "self_attention.linear_proj.bias"] = take(att + "o_proj.bias")
            out[ours + "mlp.linear_fc1.bias"] = torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
            out[ours + "mlp.linear_fc2.bias"] = take(mlp + "down_proj.bias")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not shape.tied:
        out["output_layer.weight"] = pad_rows(take("lm_head.weight"))
    return out


def hf_shapes(shape: Shape) -> dict:
    """{Hugging Face name: shape} of a model of `shape` (worked out on the meta device)."""
    import torch

    empty = {n: torch.empty(s, device="meta") for n, s in canonical_shapes(shape, shape.vocab)}
    return {n: tuple(t.shape) for n, t in canonical_to_hf(empty, shape).items()}


def canonical_to_hf(ours: dict, shape: Shape) -> dict:
    """{Hugging Face name: tensor} from our TP1 tensors (vocabulary cut to shape.vocab)."""
    import torch

    out = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"][: shape.vocab]}
    for i in range(shape.layers):
        hf_p, p = f"model.layers.{i}.", f"decoder.layers.{i}."
        att, mlp = hf_p + "self_attn.", hf_p + "mlp."
        q, k, v = split_qkv(ours[p + "self_attention.linear_qkv.weight"], shape)
        if shape.family.fused:
            out[att + "qkv_proj.weight"] = torch.cat([q, k, v], dim=0)
        else:
            out.update({att + "q_proj.weight": q, att + "k_proj.weight": k, att + "v_proj.weight": v})
        if shape.qkv_bias or shape.linear_bias:
            qb, kb, vb = split_qkv(ours[p + "self_attention.linear_qkv.bias"][:, None], shape)
            out.update({att + "q_proj.bias": qb[:, 0], att + "k_proj.bias": kb[:, 0], att + "v_proj.bias": vb[:, 0]})
        if shape.qk_norm:
            out[att + "q_norm.weight"] = ours[p + "self_attention.q_layernorm.weight"]
            out[att + "k_norm.weight"] = ours[p + "self_attention.k_layernorm.weight"]
        out[att + "o_proj.weight"] = ours[p + "self_attention.linear_proj.weight"]
        out[hf_p + "input_layernorm.weight"] = ours[p + "input_layernorm.weight"]
        out[hf_p + "post_attention_layernorm.weight"] = ours[p + "pre_mlp_layernorm.weight"]
        if shape.family.fused:
            out[mlp + "gate_up_proj.weight"] = ours[p + "mlp.linear_fc1.weight"]
        else:
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = ours[p + "mlp.linear_fc1.weight"].chunk(2)
        out[mlp + "down_proj.weight"] = ours[p + "mlp.linear_fc2.weight"]
        if shape.linear_bias:
            out[att + "o_proj.bias"] = ours[p + "self_attention.linear_proj.bias"]
            out[mlp + "gate_proj.bias"], out[mlp + "up_proj.bias"] = ours[p + "mlp.linear_fc1.bias"].chunk(2)
            out[mlp + "down_proj.bias"] = ours[p + "mlp.linear_fc2.bias"]
    out["model.norm.weight"] = ours["decoder.final_layernorm.weight"]
    if not shape.tied:
        out["lm_head.weight"] = ours["output_layer.weight"][: shape.vocab]
    return {k: v.contiguous() for k, v in out.items()}


def fuse_qkv(q, k, v, shape: Shape):
    """megatron-core's fused QKV rows: per query group, its query heads, its key, its value."""
    import torch

    per = shape.heads // shape.groups
    d = shape.head_dim
    q = q.reshape(shape.groups, per * d, -1)
    k = k.reshape(shape.groups, d, -1)
    v = v.reshape(shape.groups, d, -1)
    return torch.cat([q, k, v], dim=1).reshape(shape.groups * (per + 2) * d, -1)


def split_qkv(qkv, shape: Shape):
    per = shape.heads // shape.groups
    d = shape.head_dim
    g = qkv.reshape(shape.groups, (per + 2) * d, -1)
    q, k, v = g[:, : per * d], g[:, per * d : (per + 1) * d], g[:, (per + 1) * d :]
    cols = qkv.shape[-1]
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def canonical_shapes(shape: Shape, rows: int) -> list[tuple[str, tuple]]:
    """Our TP1 parameter names and shapes, in the model's order."""
    qkv_rows = (shape.heads + 2 * shape.groups) * shape.head_dim
    named = [("embedding.word_embeddings.weight", (rows, shape.hidden))]
    for i in range(shape.layers):
        p = f"decoder.layers.{i}."
        named += [(p + "input_layernorm.weight", (shape.hidden,)),
                  (p + "self_attention.linear_proj.weight", (shape.hidden, shape.heads * shape.head_dim))]
        if shape.linear_bias:
            named.append((p + "self_attention.linear_proj.bias", (shape.hidden,)))
        named.append((p + "self_attention.linear_qkv.weight", (qkv_rows, shape.hidden)))
        if shape.qkv_bias or shape.linear_bias:
            named.append((p + "self_attention.linear_qkv.bias", (qkv_rows,)))
        if shape.qk_norm:
            named += [(p + "self_attention.q_layernorm.weight", (shape.head_dim,)),
                      (p + "self_attention.k_layernorm.weight", (shape.head_dim,))]
        named += [(p + "pre_mlp_layernorm.weight", (shape.hidden,)),
                  (p + "mlp.linear_fc1.weight", (2 * shape.ffn, shape.hidden))]
        if shape.linear_bias:
            named.append((p + "mlp.linear_fc1.bias", (2 * shape.ffn,)))
        named.append((p + "mlp.linear_fc2.weight", (shape.hidden, shape.ffn)))
        if shape.linear_bias:
            named.append((p + "mlp.linear_fc2.bias", (shape.hidden,)))
    named.append(("decoder.final_layernorm.weight", (shape.hidden,)))
    if not shape.tied:
        named.append(("output_layer.weight", (rows, shape.hidden)))
    return named


# ------------------------------------------------------ stored flags -> Shape, config.json
def shape_from_args(saved, where: str) -> Shape:
    """The Shape of a checkpoint trained here, from its stored flags (model_type: the family
    its features need, llama where any would do); one line for what no family here holds."""
    get = lambda name, default=None: getattr(saved, name, default)  # noqa: E731
    differences = [("--normalization is not RMSNorm", get("normalization") != "RMSNorm"),
                   ("--swiglu is off", not get("swiglu")),
                   ("--position-embedding-type is not rope", get("position_embedding_type") != "rope"),
                   ("--apply-layernorm-1p is on", bool(get("apply_layernorm_1p"))),
                   ("--rotary-interleaved is on", bool(get("rotary_interleaved")))]
    found = [what for what, differs in differences if differs]
    if found:
        raise HFError(f"{where}: only Llama-architecture models export to Hugging Face, and this one's "
                      f"{found[0]}")
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    linear_bias = not get("disable_bias_linear")
    shape = Shape(model_type="llama", layers=int(get("num_layers")),
                  hidden=hidden, ffn=int(get("ffn_hidden_size")), heads=heads,
                  groups=int(get("num_query_groups") or heads), head_dim=int(get("kv_channels") or hidden // heads),
                  vocab=0, eps=float(get("norm_epsilon", 1e-5)), rope_base=int(get("rotary_base", 10000)),
                  max_positions=int(get("max_position_embeddings") or get("seq_length") or 4096),
                  tied=not get("untie_embeddings_and_output_weights"),
                  qkv_bias=bool(get("add_qkv_bias")) and not linear_bias,
                  rope_scaling=float(get("rope_scaling_factor", 8.0)) if get("use_rope_scaling") else None,
                  qk_norm=bool(get("qk_layernorm")), linear_bias=linear_bias,
                  rotary_percent=float(get("rotary_percent", 1.0)))
    features = [name for name, on in (("--qk-layernorm", shape.qk_norm), ("--add-qkv-bias", shape.qkv_bias),
                                      ("a bias on every linear (no --disable-bias-linear)", shape.linear_bias),
                                      (f"--rotary-percent {shape.rotary_percent:g}", shape.rotary_percent != 1.0))
                if on]
    if len(features) > 1:
        raise HFError(f"{where}: no Hugging Face family here holds {' with '.join(features)} (qwen3: "
                      "--qk-layernorm; qwen2: --add-qkv-bias; llama: biases on every linear; phi3: --rotary-percent)")
    shape.model_type = ("qwen3" if shape.qk_norm else "qwen2" if shape.qkv_bias
                        else "phi3" if shape.rotary_percent != 1.0 else "llama")
    return shape


def fits(model_type: str, shape: Shape) -> bool:
    """Whether the family `model_type` holds this shape exactly (an imported model's own
    family is kept on export where it does)."""
    family = FAMILIES.get(model_type)
    if family is None:
        return False
    return (family.qk_norm == shape.qk_norm and family.qkv_bias == shape.qkv_bias
            and (not shape.linear_bias or family.bias_fields == ("attention_bias", "mlp_bias"))
            and (shape.rotary_percent == 1.0 or family.partial_rotary))


def hf_config(shape: Shape, base: dict | None, dtype: str) -> dict:
    """config.json: the imported model's own, its shape fields set from ours, else a fresh one."""
    cfg = dict(base or {})
    if cfg.get("model_type") != shape.model_type:
        cfg.update(model_type=shape.model_type, architectures=[shape.family.architecture])
    cfg.setdefault("architectures", [shape.family.architecture])
    cfg.update({"hidden_size": shape.hidden, "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
                "num_attention_heads": shape.heads, "num_key_value_heads": shape.groups, "head_dim": shape.head_dim,
                "hidden_act": "silu", "max_position_embeddings": shape.max_positions, "rms_norm_eps": shape.eps,
                "tie_word_embeddings": shape.tied, "vocab_size": shape.vocab, "torch_dtype": dtype, "dtype": dtype})
    for field in ("attention_bias", "mlp_bias"):
        if field in shape.family.bias_fields:
            cfg[field] = shape.linear_bias
        else:
            cfg.pop(field, None)
    rope = {"rope_type": "default", "rope_theta": float(shape.rope_base)}
    if shape.rope_scaling is not None:
        rope.update(LLAMA3_FIXED, rope_type="llama3", factor=shape.rope_scaling)
    cfg.pop("partial_rotary_factor", None)
    if shape.family.partial_rotary:
        rope["partial_rotary_factor"] = cfg["partial_rotary_factor"] = shape.rotary_percent
    cfg.pop("rope_scaling", None)
    cfg["rope_theta"] = float(shape.rope_base)
    cfg["rope_parameters"] = rope
    return cfg
