"""Upstream Megatron-LM's `pretrain_gpt.py` options that this fork's parser does not define,
each with its verdict: refused (one line: why, and what to use instead) or accepted without
effect (listed once at start). Launch scripts written for upstream then parse exactly as
there (same types, nargs, choices, aliases), and nothing they ask for is silently dropped.

Facts (option strings, kind, type, nargs, default, choices) are upstream's at commit d98e8a6;
the verdicts are this fork's. A row whose flag our parser gains later is skipped at
registration (`upstream_flags.add_upstream_flags`); delete it here when that happens.

This module is the one place to look flags up: the verdicts (`FAMILIES`, `HARMLESS_VALUES`)
and `ROWS`, upstream's options in upstream's order, kept as data in two modules
(`upstream_flag_rows_model`, `upstream_flag_rows_run`) for length.
"""
from megatron.training.flags.upstream_flag_rows_model import MODEL_ROWS
from megatron.training.flags.upstream_flag_rows_run import RUN_ROWS

REFUSE, ACCEPT = "refuse", "accept"

# family -> (verdict, text). Refusals: "<why it is not supported here>; <what to use instead>".
# Acceptances: the reason the flag cannot change what the model learns here.
FAMILIES = {
    "alias": (ACCEPT, "alias of a flag this fork defines"),  # registered as that flag's alias: honoured

    # refused: they change the model, the data, the optimisation or the layout
    "moe": (REFUSE, "mixture of experts is not built in this fork (dense GPT layers only); "
                    "drop the MoE flags, or train MoE models with upstream Megatron-LM"),
    "fp8_extra": (REFUSE, "this fine-grained fp8 option is not wired here (the fp8 recipe of --fp8-format covers "
                          "every layer); drop it"),
    "mtp": (REFUSE, "multi-token prediction is not built in this fork (next-token loss only); drop it"),
    "hybrid": (REFUSE, "hybrid, Mamba, linear-attention and heterogeneous-layer models are not built in this fork "
                       "(uniform transformer layers); use upstream Megatron-LM for them"),
    "mla": (REFUSE, "multi-latent attention is not built in this fork; use standard attention "
                    "(--num-query-groups for grouped-query attention)"),
    "attention_variant": (REFUSE, "sparse-attention (DSA) variants are not built in this fork; drop it "
                                  "(dense causal attention)"),
    "mhc": (REFUSE, "hyper-connections are not built in this fork; drop it (standard residual connections)"),
    "mup": (REFUSE, "muP parametrisation is not implemented here; drop it and set --init-method-std and --lr directly"),
    "model": (REFUSE, "this architecture option is not wired into this fork's GPT model; drop it (see "
                      "pretrain_gpt_dcp.py --help for the model flags honoured here)"),
    "no_pe": (REFUSE, "without --position-embedding-type rope it is upstream's deprecated switch (upstream refuses "
                      "it there too); use --position-embedding-type none for no position embedding, or rope"),
    "rope_type": (REFUSE, "YaRN rotary embeddings belong to multi-latent attention, which is not built here (upstream's "
                          "standard attention takes rope only); drop it, or use --rope-type rope"),
    "use_num_layers": (REFUSE, "encoder/decoder layer counts are not read by this GPT; use --num-layers"),
    "use_seq_length": (REFUSE, "encoder/decoder sequence lengths are not read by this GPT; use --seq-length"),
    "encoder_decoder": (REFUSE, "encoder-decoder (T5) models are not built here; drop it (decoder-only GPT)"),
    "init": (REFUSE, "this weight-initialisation option is not wired here; drop it (megatron-core's default "
                     "initialisation, normal with --init-method-std)"),
    "no_init": (ACCEPT, "weights are always initialised, then a --load overwrites them"),
    "precision": (REFUSE, "this precision option is not wired into this fork; use --bf16 or --fp16 "
                          "(see pretrain_gpt_dcp.py --help)"),
    "fp4": (REFUSE, "FP4 training is not supported by this fork; use --bf16"),
    "precision_optimizer": (REFUSE, "the precision-aware optimizer (low-precision optimizer state) is not wired here; "
                                    "drop it (fp32 main parameters and Adam moments)"),
    "grad_precision": (REFUSE, "per-parameter or reduce-scatter fp32 accumulation is not wired here; "
                               "use --accumulate-allreduce-grads-in-fp32 (on by default with --bf16)"),
    "optimizer": (REFUSE, "Muon and Lion optimizers are not in this fork; use --optimizer adam or sgd"),
    "wd_schedule": (REFUSE, "weight-decay schedules and conditions are not wired here; use a constant --weight-decay"),
    "lr_schedule": (REFUSE, "this learning-rate schedule option is not wired here; use --lr-decay-style, "
                            "--lr-warmup-iters and --lr-wsd-decay-iters"),
    "freeze": (REFUSE, "freezing layers is not supported here; drop it (every parameter trains)"),
    "use_micro_batch": (REFUSE, "the old spelling is not wired here; use --micro-batch-size"),
    "use_tp": (REFUSE, "the old spelling is not wired here; use --tensor-model-parallel-size"),
    "use_warmup_iters": (REFUSE, "the old spelling is not wired here; use --lr-warmup-iters"),
    "use_selective": (REFUSE, "the old spelling is not wired here; use --recompute-granularity selective"),
    "use_full_recompute": (REFUSE, "the old spelling is not wired here; use --recompute-granularity full "
                                   "--recompute-method uniform --recompute-num-layers 1"),
    "recompute_modules": (REFUSE, "choosing the recomputed modules is not wired here; use --recompute-granularity "
                                  "selective or full (or --dcp, which picks recompute per micro-batch)"),
    "offload": (REFUSE, "CPU offloading (activations or optimizer) is not wired into this fork; use "
                        "--recompute-granularity to save memory, or --dcp (recompute planned per micro-batch)"),
    "batch_schedule": (REFUSE, "this batch-size ramp-up is not wired here; use --step-batch-size-schedule (upstream's "
                               "replacement of --rampup-batch-size, honoured here) or a fixed --global-batch-size"),
    "decrease_batch": (REFUSE, "shrinking the global batch to a multiple of micro-batch x data-parallel size is not "
                               "wired here; give a --global-batch-size divisible by it (under --dcp any size is a "
                               "token budget)"),
    "skip_iters": (REFUSE, "skipping iterations is not supported here; drop it (every batch trains)"),
    "eval": (REFUSE, "this validation option is not wired here; validation runs --eval-iters batches of "
                     "--global-batch-size every --eval-interval"),
    "data_args": (REFUSE, "phase transitions and per-dataset sequence files are not supported here; use --data-path "
                          "(weight prefix weight prefix ...) with --split, or --train/valid/test-data-path"),
    "doc_masking": (REFUSE, "this dataloader masking switch is not wired here; use --reset-position-ids "
                            "--reset-attention-mask (static) or --dcp (document-masked packing)"),
    "dataloader_type": (REFUSE, "only Megatron's single-pass pretraining sampler exists here; drop it or use "
                                "--dataloader-type single"),
    "fim": (REFUSE, "fill-in-the-middle data transformation is not in this fork; preprocess FIM examples "
                    "into the corpus with tools/preprocess_data.py"),
    "kd": (REFUSE, "distillation from saved logits is not in this fork; drop it (plain language-model loss)"),
    "sft_format": (REFUSE, "the chat template is applied when SFT data is preprocessed here, not by a tokenizer at "
                           "training time; drop it (tools/preprocess_data.py --sft renders the conversations)"),
    "tokenizer": (REFUSE, "this tokenizer option is not supported by this fork's tokenizers; use --tokenizer-type, "
                          "--tokenizer-model, --vocab-file/--merge-file or --vocab-size"),
    "vocab_padding": (REFUSE, "the padded vocabulary is derived here; use --make-vocab-size-divisible-by "
                              "(1 pads only to the tensor-parallel size)"),
    "rl": (REFUSE, "reinforcement learning (GRPO) is not in this fork; use upstream Megatron-LM for RL"),
    "fsdp": (REFUSE, "Megatron FSDP is not wired into this fork; use --use-distributed-optimizer (static) or --dcp, "
                     "whose fixed sharding keeps optimizer state sharded over all ranks"),
    "weight_shards": (REFUSE, "sharding weights over extra groups (weight rematerialisation) is not wired here; "
                              "use --use-distributed-optimizer or --dcp"),
    "pp_layout": (REFUSE, "uneven pipeline layouts are not supported here (layers split evenly over stages); "
                          "use --pipeline-model-parallel-size with --num-layers divisible by it, or --dcp"),
    "vpp": (REFUSE, "virtual pipeline stages (interleaved schedule) are not supported here; use "
                    "--pipeline-model-parallel-size (one stage per rank), or --dcp"),
    "cp_variants": (REFUSE, "only ring (p2p) context parallelism is wired here; use --context-parallel-size "
                            "(or --dcp, which picks cp per sequence)"),
    "dynamic_cp": (REFUSE, "upstream's hybrid/dynamic context parallelism is not wired here; use --dcp, which "
                           "plans cp (and tp, pp) per iteration from the sequence lengths"),
    "rank_order": (REFUSE, "only Megatron's default rank order (tp fastest, then cp, dp, pp) is supported here; drop it"),
    "distopt_instances": (REFUSE, "several distributed-optimizer instances are not supported here; use "
                                  "--use-distributed-optimizer (one instance over data-parallel ranks)"),
    "process_groups": (REFUSE, "fake or lazily built process groups are not supported here; launch real ranks "
                               "with torchrun"),
    "determinism": (REFUSE, "deterministic / batch-invariant kernels are not enforced by this fork; drop it "
                            "(the --dcp equivalence tests pin numerics instead)"),
    "exit_signal": (REFUSE, "only SIGTERM is handled, in the training loop (--exit-signal-handler); drop it"),
    "rerun": (REFUSE, "the rerun state machine (result validation, spiky-loss and large-grad checks, error "
                      "injection) is not in this fork; drop it (NaN iterations are skipped, --max-nan-iterations "
                      "in a row stop training)"),
    "restart": (REFUSE, "in-process restart and the fault-tolerance package are not in this fork; use torchrun "
                        "--max-restarts with --save/--load (resumes from the last checkpoint)"),
    "autoresume": (REFUSE, "ADLR autoresume is not in this fork; use torchrun --max-restarts with --save/--load"),
    "fault_injection": (REFUSE, "fault injection is not in this fork; drop it"),
    "msc": (REFUSE, "the multi-storage client (object storage paths) is not wired here; use local --data-path, "
                    "--save and --load paths"),
    "non_persistent": (REFUSE, "non-persistent (local or in-memory) checkpoints are not in this fork; use --save "
                               "with --save-interval"),
    "ckpt_semantics": (REFUSE, "this checkpoint option is not wired here; drop it (--load resumes the latest "
                               "checkpoint in full; every checkpoint is kept)"),
    "ckpt_args": (REFUSE, "taking parallel sizes or the tokenizer from a checkpoint is not wired here; give them "
                          "as flags (--use-checkpoint-args for the model flags)"),
    "ckpt_format": (REFUSE, "only megatron-core's torch_dist checkpoints (current layout) are written here; "
                            "drop it (--ckpt-format torch_dist)"),
    "ckpt_convert": (REFUSE, "checkpoint conversion is a separate tool here; run tools/convert_dcp_checkpoint.py"),
    "use_finetune": (REFUSE, "a separate pretrained-checkpoint path is not wired here; use --load DIR --finetune"),

    # accepted without effect: absence cannot change what the model learns
    "local_rank": (ACCEPT, "the LOCAL_RANK environment variable is read instead"),
    "comm": (ACCEPT, "a communication performance knob this fork does not use"),
    "kernel": (ACCEPT, "a kernel performance knob this fork does not use"),
    "cuda_graph": (ACCEPT, "CUDA graphs are not used here: speed only"),
    "inference": (ACCEPT, "an inference-engine setting: pretraining never runs the engine"),
    "logging": (ACCEPT, "a logging option this fork does not have"),
    "diagnostic": (ACCEPT, "a diagnostic or profiling option this fork does not have"),
    "dumps": (ACCEPT, "tensor dumps for debugging are not written here"),
    "data_hint": (ACCEPT, "a dataloader hint this fork does not need"),
    "tiktoken": (ACCEPT, "read only by TikTokenizer, not a tokenizer of this fork"),
    "bert_data": (ACCEPT, "read only by BERT/ICT/retrieval models and tools, not by GPT pretraining"),
    "vision": (ACCEPT, "read only by vision models, not by GPT pretraining"),
    "export": (ACCEPT, "an ONNX export setting; no export here"),
    "ckpt_perf": (ACCEPT, "a checkpoint I/O performance knob: saves are synchronous and complete here"),
    "ckpt_always_dist": (ACCEPT, "checkpoints are always torch_dist here"),
    "ckpt_reshardable": (ACCEPT, "optimizer state is always saved fully reshardable here"),
    "ckpt_no_assets": (ACCEPT, "no tokenizer assets are saved here"),
    "msc_off": (ACCEPT, "the multi-storage client is never used here"),
    "experimental": (ACCEPT, "it unlocks upstream's experimental features, none of which exist here"),
    "expert_layout": (ACCEPT, "it sizes the experts' tensor parallelism; a dense model has no experts (the "
                              "mixture-of-experts flags that would add them are refused)"),
}

# Refused flags that ask for nothing in the line they are given in: flag -> (does the line make it
# harmless?, why it is accepted without effect then). Judged after the line is parsed.
CONDITIONS = {
    # upstream: --no-position-embedding only unsets the learned absolute embedding, which rope never has;
    # it refuses the switch with any other --position-embedding-type
    "--no-position-embedding": (
        lambda args: args.position_embedding_type in ("rope", "none") or bool(args.use_rotary_position_embeddings),
        "with rope (or none) there is no learned position embedding to disable, as upstream"),
}

# Values of a refused flag that ask for nothing here (besides upstream's default, always harmless).
HARMLESS_VALUES = {
    "--rerun-mode": ("disabled",),
    "--dataloader-type": ("single",),
    "--dist-ckpt-format": ("torch_dist",),
    "--rope-type": ("rope",),  # upstream's standard attention runs rope: the kind that runs here
}

# (option strings, kind, type, nargs, upstream default, choices, family); kind is value, store_true,
# store_false or bool_pair (--x/--no-x); type is int, float, str, bool or '' (a string).
ROWS = MODEL_ROWS + RUN_ROWS
