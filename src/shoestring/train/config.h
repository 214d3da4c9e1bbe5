// Run configuration: one TOML file describes a training run.
//
// Keys follow kohya sd-scripts' names where the concept is the same
// (learning_rate, train_batch_size, max_train_steps, gradient_accumulation_steps,
// gradient_checkpointing, mixed_precision, full_bf16, max_grad_norm,
// save_every_n_steps, seed, optimizer_type, optimizer_args, lr_scheduler,
// lr_warmup_steps, caption_dropout_rate, train_data_dir, resolution,
// output_dir, sample_every_n_steps). Keys are flat; a dotted key such as
// `model.base_channels` may be written either dotted or inside a `[model]` table.
//
// Every key is declared once in a schema (config_schema.cpp) with its type, default,
// allowed range or choices and a one-line help. Unknown keys, wrong types and
// out-of-range values are errors that name the file, line, key and what is
// allowed (and, for unknown keys, the nearest valid key).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "shoestring/models/architecture.h"
#include "shoestring/precision/compute_choice.h"
#include "shoestring/precision/policy.h"

namespace shoestring {

/// A fully resolved training configuration (defaults + file + --set overrides).
struct TrainConfig {
  // ---- data ----
  std::string train_data_dir = "${SHOESTRING_CACHE}/emoji-datasource-twitter-16.0.0";
  /// Twemoji layout: keep only these emoji-data categories (empty: all).
  std::vector<std::string> twemoji_categories;
  int64_t resolution = 32;            ///< pixels, square
  double caption_dropout_rate = 0.1;  ///< probability of an empty caption (for CFG)
  // kohya's tag options (data/caption_processing.h); tiny-unet only.
  bool shuffle_caption = false;           ///< shuffle the tags after the first keep_tokens
  int64_t keep_tokens = 0;                ///< leading tags never shuffled or dropped
  double caption_tag_dropout_rate = 0.0;  ///< probability of dropping each other tag
  int64_t max_caption_length = 16;        ///< tokens incl. <bos>
  // kohya's datasets and aspect-ratio buckets (train/dataset_config.h; data/buckets.h); released models only.
  std::string dataset_config;  ///< kohya's dataset TOML ("" = train_data_dir / in_json)
  std::string in_json;         ///< kohya's fine-tuning metadata JSON, images in train_data_dir ("" = caption files)
  bool enable_bucket = false;  ///< aspect-ratio buckets (kohya's defaults below)
  int64_t min_bucket_reso = 256;
  int64_t max_bucket_reso = 1024;
  int64_t bucket_reso_steps = 64;
  bool bucket_no_upscale = false;
  std::string caption_extension = ".txt";  ///< caption file beside an image (kohya's default is ".caption")
  int64_t dataset_repeats = 1;             ///< kohya's dataset_repeats: num_repeats of the main-config dataset
  bool flip_aug = false;                   ///< also train on mirrored images
  bool random_crop = false;                ///< random instead of centre crop (refused with cached latents)
  int64_t max_train_images = 0;            ///< a seeded subset of this many images (0 = every image)
  int64_t max_train_images_seed = 0;       ///< seed of that subset (independent of `seed`)
  // Caches on disk (train/ldm_cache.h; kohya's names); released models only.
  bool cache_latents_to_disk = false;               ///< VAE latents as safetensors shards in cache_dir/latents
  bool cache_text_encoder_outputs_to_disk = false;  ///< text-encoder outputs in cache_dir/text
  std::string cache_dir;                            ///< "" = .shoestring-cache beside the dataset (ldm_cache_dir)

  // ---- model ----
  /// A registered denoiser architecture (models/architecture.h,
  /// models::denoiser_architectures()): tiny-unet (models::kTinyUNet, the emoji
  /// example's model), sd15, sdxl, ssd1b, sd35m, cascade-c, cascade-c-lite.
  std::string architecture = models::kTinyUNet;
  /// Registered architectures only: the same block structure at test width
  /// (LdmUNetOptions::tiny() and the like), for tests and quick experiments.
  bool tiny = false;
  int64_t base_channels = 64;
  std::vector<int64_t> channel_mult = {1, 2, 4};
  int64_t num_res_blocks = 2;
  std::vector<int64_t> attention_levels = {1, 2};
  int64_t num_heads = 4;
  int64_t norm_groups = 32;  ///< GroupNorm groups (must divide every level's channels)
  int64_t text_dim = 256;    ///< caption encoder width = UNet context_dim
  int64_t text_layers = 2;
  /// Emoji model: the caption's pooled embedding also joins the timestep
  /// embedding (models::TinyUNetOptions::pooled_context).
  bool pooled_context = true;
  /// ResBlocks condition by GroupNorm scale and shift (models::TinyUNetOptions::scale_shift_norm).
  bool scale_shift_norm = true;
  /// Emoji model: "velocity" or "x0" (TinyUNetModelOptions::predict_x0).
  std::string prediction = "x0";
  double dropout = 0.0;

  // ---- objective ----
  std::string timestep_sampling = "logit_normal";  ///< "logit_normal" | "uniform" | "mode"
  double logit_mean = 0.0;
  double logit_std = 1.0;
  double mode_scale = 1.29;               ///< timestep_sampling = "mode" (SD3 paper's mode sampling)
  double training_shift = 1.0;            ///< SD3: t -> s t / (1 + (s - 1) t) on training times (kohya's)
  double pos_emb_random_crop_rate = 0.0;  ///< SD3.5: share of batches with a random crop of pos_embed (kohya's)
  std::string weighting_scheme = "none";  ///< SD3 loss weight per sample: none | sigma_sqrt | cosmap
  /// SD3: the loss on x0 = x_t - t v (kohya; diffusers' --precondition_outputs), i.e. the velocity loss
  /// times t^2; false = the plain velocity loss (OneTrainer).
  bool precondition_outputs = true;

  // ---- optimization ----
  std::string optimizer_type = "AdamW";
  std::vector<std::string> optimizer_args;     ///< "key=value", kohya style
  std::string optimizer_state_dtype = "fp32";  ///< fp32 | bf16 (stochastically rounded)
  bool stochastic_rounding = true;             ///< SR of low-precision weights/state (false: round-to-nearest)
  bool fused_backward_pass = false;            ///< step each parameter inside backward (kohya's name)
  std::string fused_clip_method = "previous_step_norm";  ///< previous_step_norm | two_pass
  std::string gradient_accumulation_dtype = "fp32";      ///< fp32 | bf16_sr (bf16 weights only)
  double learning_rate = 1e-4;
  std::string lr_scheduler = "constant";  ///< constant | constant_with_warmup | cosine
  int64_t lr_warmup_steps = 0;
  int64_t train_batch_size = 1;
  int64_t max_train_steps = 1600;
  int64_t max_train_epochs = 0;  ///< kohya's: sets max_train_steps to epochs x steps per epoch (0 = off)
  double max_train_minutes = 0;  ///< wall-time budget of a run's first invocation; sizes max_train_steps (0 = off)
  int64_t gradient_accumulation_steps = 1;
  double max_grad_norm = 1.0;  ///< 0 disables clipping
  bool gradient_checkpointing = false;
  int64_t attention_chunk_mib = 64;      ///< attention score matrices above this run in query blocks (0 = never)
  bool offload_optimizer_state = false;  ///< optimizer state in host memory, streamed per parameter
  /// Weights of checkpointed blocks (and their gradients and optimizer state)
  /// in host memory, streamed to the device block by block (train/block_streaming.h).
  bool offload_params = false;
  std::string mixed_precision = "no";  ///< no | bf16 | fp16 (compute dtype, fp32 weights)
  bool full_bf16 = false;              ///< bf16 weights, updates stochastically rounded
  bool full_fp16 = false;              ///< fp16 weights (SR updates), fp16 compute, loss scaling
  // ---- precision policy (docs/precision.md) ----
  /// [[precision.rule]] entries, in file order (after the shorthands above).
  std::vector<precision::RuleSpec> precision_rules;
  double overflow_threshold = 0.5;  ///< precision.overflow_threshold: fraction of 65504
  bool auto_upcast = false;         ///< precision.auto_upcast: overflowing fp16 blocks -> fp32
  /// precision.activation_rescale: Stable Cascade's fp16 fix, the factor each
  /// TimestepBlock of the last up group multiplies the stream by (1 = off;
  /// models::StageCImpl::set_activation_rescale).
  double activation_rescale = 1.0;
  std::string bf16_compute = "auto";  ///< precision.bf16_compute: auto | bf16 | fp32 (precision/compute_choice.h)
  double loss_scale_init = 65536.0;   ///< precision.loss_scale_init (GradScaler init_scale)
  int64_t loss_scale_growth_interval = 2000;  ///< precision.loss_scale_growth_interval
  std::string save_precision = "auto";        ///< auto (storage dtype) | fp32 | float | fp16 | bf16
  bool save_precision_force = false;          ///< save even when the range guard finds damage
  double ema_decay = 0.0;                     ///< 0 disables EMA
  int64_t max_nonfinite_steps = 10;           ///< consecutive skipped steps before giving up
  int64_t seed = 42;

  std::string pretrained_model_name_or_path;  ///< base weights (shoestring model.safetensors or a single-file
                                              ///< checkpoint); "" = random init
  std::string vae;  ///< VAE file for registered LDM architectures ("" = the checkpoint's first_stage_model.*)
  // Stable Cascade's frozen parts (kohya's stable-cascade names; "" = random, model.tiny only).
  std::string effnet_checkpoint_path;      ///< stage C latent encoder (effnet_encoder.safetensors)
  std::string previewer_checkpoint_path;   ///< latent previewer for samples (previewer.safetensors)
  std::string text_model_checkpoint_path;  ///< OpenCLIP bigG (SDXL single file or open_clip layout)
  // SD3's text encoders (kohya sd3_train.py's names; "" = from the base file, or random for model.tiny).
  std::string clip_l;                    ///< CLIP-L (text_encoders/clip_l.safetensors)
  std::string clip_g;                    ///< OpenCLIP bigG (text_encoders/clip_g.safetensors)
  std::string t5xxl;                     ///< T5-XXL encoder; "" = no T5 (zero tokens)
  int64_t t5xxl_max_token_length = 256;  ///< T5 tokens per caption (kohya's default)
  std::string
      tokenizer_dir;  ///< folder with CLIP's vocab.json + merges.txt ("" = word tokenizer built from the captions)
  bool v_parameterization = false;  ///< LDM UNets: v-prediction target instead of epsilon (kohya's name)
  // ---- loss and noise options (kohya's names; train/diffusion_loss.h) ----
  std::string loss_type = "l2";           ///< l2 | l1 | huber | smooth_l1
  std::string huber_schedule = "snr";     ///< snr | exponential | constant (huber / smooth_l1)
  double huber_c = 0.1;                   ///< Huber threshold (schedule parameter)
  double huber_scale = 1.0;               ///< multiplies the constant / exponential threshold
  double min_snr_gamma = 0.0;             ///< LDM UNets: min-SNR-gamma weighting; 0 = off
  bool debiased_estimation_loss = false;  ///< LDM UNets: 1/sqrt(SNR) (v: 1/(SNR+1)) weighting
  double noise_offset = 0.0;              ///< LDM UNets: offset noise strength; 0 = off
  double adaptive_noise_scale = 0.0;      ///< LDM UNets: + this x |latent mean| to noise_offset; 0 = off
  int64_t multires_noise_iterations = 0;  ///< LDM UNets: pyramid noise levels; 0 = off
  double multires_noise_discount = 0.3;   ///< LDM UNets: weight of level i is discount^i
  int64_t clip_skip = 1;                  ///< SD 1.x: use the output of the N-th last CLIP layer (kohya's name)
  // ---- LoRA (kohya's names; docs/lora.md) ----
  std::string network_module;             ///< "" (train every weight) | "networks.lora"
  int64_t network_dim = 4;                ///< LoRA rank
  double network_alpha = 1.0;             ///< scale = alpha / rank; 0 = rank
  std::vector<std::string> network_args;  ///< "conv_dim=4", "conv_alpha=1", "train_ff=true"
  bool network_train_unet_only = false;   ///< no LoRA on the text encoder
  std::string network_weights;            ///< LoRA file to start from ("" = fresh)

  // ---- output ----
  std::string output_dir = "runs/emoji";
  int64_t save_every_n_steps = 0;    ///< 0: only at the end
  int64_t save_every_n_epochs = 0;   ///< a checkpoint at the end of every Nth epoch (0: none)
  int64_t save_last_n_steps = 0;     ///< keep step checkpoints of the last N steps only (0: keep all)
  int64_t save_last_n_epochs = 0;    ///< keep the last N epoch checkpoints only (0: keep all)
  int64_t sample_every_n_steps = 0;  ///< 0: only at the end
  std::vector<std::string> sample_prompts = {"grinning face", "blue heart", "pile of poo", "ghost"};
  int64_t sample_seeds = 4;  ///< columns of the sample grid
  int64_t sample_steps = 30;
  double sample_cfg = 4.0;
  std::string sample_sampler =
      "ddim";                      ///< LDM UNets: ddim | euler | euler_a | dpmpp_2m (train/samplers.h), kohya's aliases
  int64_t log_every_n_steps = 10;  ///< progress line cadence when not on a TTY
  /// "" | "tensorboard" (kohya's name): also write TensorBoard event files
  /// into RUN_DIR/logs/ (train/tensorboard.h)
  std::string log_with = "";
  int64_t num_threads = 0;  ///< 0: libtorch default
  /// "auto" | "cpu" | "cuda" | "cuda:N" (core/device.h): where the model, its
  /// gradients and optimizer state live; the dataset and caches stay in host memory.
  std::string device = "auto";
  // ---- several processes (train/run.h; the launch is in dist/launch_env.h) ----
  int64_t zero_stage = 0;  ///< 0 = data parallel; 1, 2, 3 = ZeRO (dist/zero.h)
  /// zero_stage 3: gather the next checkpointed block's weights while the
  /// current one runs (dist::ZeroSharding's prefetch; one more block held).
  bool zero3_prefetch = true;
  double ddp_timeout = 2;  ///< minutes a rank waits for the others (rendezvous, each collective), as kohya
};

/// Parses a TOML config file and applies `--set key=value` overrides (the
/// value is parsed as a TOML value; a bare word is taken as a string).
/// `${SHOESTRING_CACHE}` in path values expands to $SHOESTRING_CACHE or
/// ~/.cache/shoestring.
/// Throws shoestring::Error: unreadable file, TOML syntax error (file:line),
/// unknown key (file:line, nearest valid key), wrong type or out-of-range
/// value (key, value, what is allowed), malformed --set.
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

/// Same as load_config but from TOML text (source_name is used in messages).
TrainConfig parse_config(const std::string& toml_text, const std::string& source_name,
                         const std::vector<std::string>& overrides = {});

/// Renders the resolved config as TOML (every key, with its value) so a run
/// folder records exactly what ran; parse_config(to_toml(c)) == c.
std::string to_toml(const TrainConfig& config);

/// The precision rules of a config: the shorthands (mixed_precision,
/// full_bf16, full_fp16, gradient_checkpointing; see precision::shorthand_rules)
/// followed by the [[precision.rule]] entries, with the compute substitution
/// that precision.bf16_compute chooses for `hardware` (bf16 -> fp32 compute on
/// a CPU without bf16 units under "auto"; precision/compute_choice.h). Throws
/// shoestring::Error as precision::Policy::from_specs, or for a bad
/// precision.bf16_compute.
precision::Policy precision_policy(const TrainConfig& config, const precision::ComputeHardware& hardware);
/// As above, on the hardware the run computes on (compute_hardware(config)).
precision::Policy precision_policy(const TrainConfig& config);
/// The hardware a run of `config` computes on: this machine's CPU
/// (core/cpu_features.h) when its `device` is or resolves to the CPU; a CUDA
/// device counts as having bf16 units (one without them had its bf16
/// settings turned into fp16 by adapt_precision_to_device, train/device_precision.h).
precision::ComputeHardware compute_hardware(const TrainConfig& config);

/// The keys a run's checkpoint depends on (schema flag kResume*) whose value
/// differs between `was` (the run's recorded config.toml) and `now`, each as
/// `key (run: "a", now: "b")`, in schema order. Paths compare after
/// expand_path and canonicalisation; ema_decay compares as "> 0".
std::vector<std::string> resume_differences(const TrainConfig& was, const TrainConfig& now);

/// Every key (but output_dir) whose value differs between `was` and `now`,
/// rendered as resume_differences renders them, in schema order, then the
/// [[precision.rule]] entries when they differ ("precision.rule (run: ...,
/// now: ...)", each rule as {match = "...", storage = "...", ...}): what a
/// resumed run changes (learning rate, loss options, precision, ...) and logs.
std::vector<std::string> changed_keys(const TrainConfig& was, const TrainConfig& now);

/// Keys set away from their defaults that the model family of `config` does
/// not read (schema flags kEmojiModelOnly / kReleasedModelOnly), in schema
/// order. `emoji_model`: the config trains the emoji example's tiny-unet.
std::vector<std::string> ignored_keys(const TrainConfig& config, bool emoji_model);

/// Every valid key, in schema order (for help and tests).
std::vector<std::string> config_keys();

/// Markdown reference of every key: name, default, what is allowed, meaning.
/// docs/config.md is exactly this text (a test keeps them in sync).
std::string config_reference_markdown();

/// Expands ${SHOESTRING_CACHE} (the environment variable, default
/// ~/.cache/shoestring) and a leading ~ (HOME) in a path. Throws
/// shoestring::Error naming the path for any other ${...}: it would
/// otherwise become a folder of that literal name.
std::string expand_path(const std::string& path);

}  // namespace shoestring
