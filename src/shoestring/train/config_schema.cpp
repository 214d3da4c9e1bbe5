// The config schema (train/config_schema.h) and what is derived from it:
// the generated key reference, resume differences, family-ignored keys.
#include "shoestring/train/config_schema.h"

#include <filesystem>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/models/architecture.h"
#include "shoestring/train/dataset_config.h"

namespace shoestring {
namespace config_detail {

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      Field{"train_data_dir", &TrainConfig::train_data_dir,
            "dataset folder: Twemoji package (emoji.json) or kohya layout (image + .txt)"}
          .with(kResumePath),
      Field{"twemoji_categories", &TrainConfig::twemoji_categories,
            "Twemoji layout: train only on these emoji-data categories, matched ignoring case, e.g. [\"Smileys & "
            "Emotion\"] (empty: all)"}
          .with(kResumeValue),
      Field{"resolution", &TrainConfig::resolution, "training resolution in pixels (square)", 8, 1024}.with(
          kResumeValue),
      {"caption_dropout_rate", &TrainConfig::caption_dropout_rate,
       "probability of training on an empty caption (classifier-free guidance)", 0, 1},
      {"shuffle_caption", &TrainConfig::shuffle_caption,
       "shuffle a caption's comma-separated tags, after the first keep_tokens, each time it is drawn (kohya's "
       "option; emoji model only: the released models cache text-encoder outputs)"},
      {"keep_tokens", &TrainConfig::keep_tokens,
       "leading comma-separated tags that shuffle_caption and caption_tag_dropout_rate leave in place (kohya's "
       "count of tags)",
       0, 1000},
      {"caption_tag_dropout_rate", &TrainConfig::caption_tag_dropout_rate,
       "probability of dropping each tag after the first keep_tokens each time a caption is drawn (kohya's option; "
       "emoji model only)",
       0, 1},
      Field{"max_caption_length", &TrainConfig::max_caption_length, "caption tokens incl. <bos>", 2, 512}.with(
          kResumeValue),
      Field{"dataset_config", &TrainConfig::dataset_config,
            "kohya's dataset TOML ([general], [[datasets]], [[datasets.subsets]]; keys below under \"Dataset "
            "config\"): replaces train_data_dir and in_json; main-config keys are its fallbacks, as in kohya"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"in_json", &TrainConfig::in_json,
            "kohya's fine-tuning metadata JSON ({image: {caption, tags}}; .jsonl lines with image_path): captions "
            "and tags per image, image paths relative to train_data_dir"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"enable_bucket", &TrainConfig::enable_bucket,
            "aspect-ratio buckets as kohya's: each image trains at the bucket of nearest aspect ratio (area about "
            "resolution^2), resized to cover it and centre-cropped; a batch never mixes buckets"}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"min_bucket_reso", &TrainConfig::min_bucket_reso,
            "smallest bucket side, pixels (rounded down to bucket_reso_steps)", 1, 16384}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"max_bucket_reso", &TrainConfig::max_bucket_reso,
            "largest bucket side, pixels (rounded up to bucket_reso_steps)", 1, 16384}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"bucket_reso_steps", &TrainConfig::bucket_reso_steps,
            "bucket sides are multiples of this (the model's latent grid must divide it)", 1, 4096}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"bucket_no_upscale", &TrainConfig::bucket_no_upscale,
            "buckets from each image's own size (shrunk to the resolution's area when larger, never enlarged); "
            "min_bucket_reso / max_bucket_reso are then ignored, as in kohya"}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"caption_extension", &TrainConfig::caption_extension,
            "caption file of image a.png: a + caption_extension (kohya's own default is \".caption\"); for "
            "train_data_dir with enable_bucket or in_json, and as the dataset_config fallback"}
          .with(kResumeValue),
      Field{"dataset_repeats", &TrainConfig::dataset_repeats,
            "kohya's dataset_repeats: each image is this many entries per epoch (num_repeats of the main-config "
            "dataset and the dataset_config fallback)",
            1, 1e6}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"flip_aug", &TrainConfig::flip_aug,
            "also train on the horizontally mirrored image, drawn with probability 1/2 per use (the LDM families "
            "encode both latents once)"}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"random_crop", &TrainConfig::random_crop,
            "crop buckets at a random instead of the centre offset; refused by the LDM families, which encode "
            "latents once (kohya refuses it with cache_latents)"}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"max_train_images", &TrainConfig::max_train_images,
            "train on a seeded subset of this many of the dataset's images, for quick experiments (the same "
            "max_train_images_seed picks the same images; a larger count keeps the smaller one's); 0 = every image",
            0, 1e12}
          .with(kResumeValue),
      Field{"max_train_images_seed", &TrainConfig::max_train_images_seed,
            "seed of the max_train_images subset (independent of seed, so runs of several seeds share a subset)", 0,
            9.0e18}
          .with(kResumeValue),
      Field{"cache_latents_to_disk", &TrainConfig::cache_latents_to_disk,
            "latent architectures (LDM, SD3.5, Stable Cascade): keep the latents as safetensors shards in "
            "cache_dir/latents, keyed by image content, the latent encoder's weights, bucket, crop, flip and dtype; a "
            "later run (or `shoestring cache`) encodes only "
            "what changed, and training reads them a batch at a time (docs/datasets.md)"}
          .with(kReleasedModelOnly),
      Field{"cache_text_encoder_outputs_to_disk", &TrainConfig::cache_text_encoder_outputs_to_disk,
            "latent architectures: keep the text-encoder outputs (per distinct caption and sample prompt) in "
            "cache_dir/text, keyed by the caption's tokens, the encoders' weights, clip_skip and dtype (SD3: T5's too)"}
          .with(kReleasedModelOnly),
      Field{"cache_dir", &TrainConfig::cache_dir,
            "folder of the disk caches; \"\" = .shoestring-cache in train_data_dir (beside the dataset_config file "
            "when one is set), where kohya keeps its .npz files: beside the images"}
          .with(kReleasedModelOnly),
      Field{"model.architecture", &TrainConfig::architecture,
            "model architecture: the emoji example's tiny-unet, or a released one (docs/architectures.md)", -kInf, kInf,
            models::denoiser_architectures()}
          .with(kResumeValue),
      Field{"model.tiny", &TrainConfig::tiny,
            "released architectures: the same block structure at test width (small channels)"}
          .with(kResumeValue),
      Field{"model.base_channels", &TrainConfig::base_channels, "UNet channels at full resolution", 8, 4096}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.channel_mult", &TrainConfig::channel_mult, "channel multiplier per UNet level", 1, 64}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.num_res_blocks", &TrainConfig::num_res_blocks, "ResBlocks per UNet level", 1, 16}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.attention_levels", &TrainConfig::attention_levels,
            "UNet levels (0 = full resolution) with self- and cross-attention", 0, 16}
          .with(kResumeValue | kEmojiModelOnly),
      Field{"model.num_heads", &TrainConfig::num_heads, "attention heads", 1, 128}.with(kResumeValue | kEmojiModelOnly),
      Field{"model.norm_groups", &TrainConfig::norm_groups, "GroupNorm groups in the UNet", 1, 1024}.with(
          kEmojiModelOnly),
      Field{"model.text_dim", &TrainConfig::text_dim, "caption encoder width (UNet context_dim)", 8, 4096}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.text_layers", &TrainConfig::text_layers, "caption encoder transformer layers", 0, 48}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.pooled_context", &TrainConfig::pooled_context,
            "add the caption's mean embedding to the timestep embedding (GLIDE / SDXL style)"}
          .with(kResumeValue | kEmojiModelOnly),
      Field{"model.scale_shift_norm", &TrainConfig::scale_shift_norm,
            "ResBlocks take the time and caption embedding as scale and shift of their second GroupNorm (ADM's "
            "adaptive group normalization) instead of adding it"}
          .with(kResumeValue | kEmojiModelOnly),
      {"model.dropout", &TrainConfig::dropout, "dropout in ResBlocks", 0, 0.99},
      Field{"model.prediction",
            &TrainConfig::prediction,
            "what the emoji UNet outputs: the flow-matching velocity, or the clean image x0 from which the "
            "velocity (x_t - x0) / max(t, 0.05) is derived (JiT, Li & He 2025); the loss is on the velocity either "
            "way",
            -kInf,
            kInf,
            {"velocity", "x0"}}
          .with(kResumeValue | kEmojiModelOnly),
      Field{"timestep_sampling",
            &TrainConfig::timestep_sampling,
            "flow-matching time distribution: logit_normal (SD3's default), uniform, or mode (SD3 paper's mode "
            "sampling with mode_scale; kohya's weighting_scheme = \"mode\")",
            -kInf,
            kInf,
            {"logit_normal", "uniform", "mode"}}
          .with(kFlowMatchingOnly),
      Field{"logit_mean", &TrainConfig::logit_mean, "logit-normal mean", -10, 10}.with(kFlowMatchingOnly),
      Field{"logit_std", &TrainConfig::logit_std, "logit-normal standard deviation", 1e-3, 10}.with(kFlowMatchingOnly),
      Field{"mode_scale", &TrainConfig::mode_scale,
            "timestep_sampling = \"mode\": its scale (SD3: 1.29; the map stays monotone up to 2 / (pi - 2))", -1, 1.75}
          .with(kFlowMatchingOnly | kReleasedModelOnly),
      Field{"training_shift", &TrainConfig::training_shift,
            "SD3: shift of the training times, t -> s t / (1 + (s - 1) t) (kohya's training_shift; 1 = none)", 1e-3,
            100}
          .with(kFlowMatchingOnly | kReleasedModelOnly),
      Field{"pos_emb_random_crop_rate", &TrainConfig::pos_emb_random_crop_rate,
            "SD3.5 Medium: share of batches whose patch grid takes a random crop of the position embedding "
            "instead of the centre (kohya's pos_emb_random_crop_rate; SD3.5 Medium was trained so); 0 = never",
            0, 1}
          .with(kResumeValue | kFlowMatchingOnly | kReleasedModelOnly),
      Field{"weighting_scheme",
            &TrainConfig::weighting_scheme,
            "SD3: per-sample loss weight (kohya / diffusers): none, sigma_sqrt (1 / t^2) or cosmap "
            "(2 / (pi (1 - 2t + 2t^2)))",
            -kInf,
            kInf,
            {"none", "sigma_sqrt", "cosmap"}}
          .with(kFlowMatchingOnly | kReleasedModelOnly),
      Field{"precondition_outputs", &TrainConfig::precondition_outputs,
            "SD3: take the loss on x0 = x_t - t v (kohya's sd3_train and diffusers' default: the velocity loss "
            "times t^2, which weighting_scheme then multiplies, so sigma_sqrt makes it flat); false = the plain "
            "velocity loss (OneTrainer)"}
          .with(kResumeValue | kFlowMatchingOnly | kReleasedModelOnly),
      Field{"optimizer_type",
            &TrainConfig::optimizer_type,
            "optimizer (kohya name)",
            -kInf,
            kInf,
            {"AdamW", "AdamW8bit", "Adafactor", "Lion", "Compass", "SPARKLES"}}
          .with(kResumeValue),
      {"optimizer_args", &TrainConfig::optimizer_args,
       "optimizer arguments as \"key=value\" strings, e.g. [\"weight_decay=0.01\", \"betas=0.9,0.999\"]"},
      Field{"optimizer_state_dtype",
            &TrainConfig::optimizer_state_dtype,
            "dtype of full-size optimizer state (bf16 is stochastically rounded)",
            -kInf,
            kInf,
            {"fp32", "bf16"}}
          .with(kResumeValue),
      {"stochastic_rounding", &TrainConfig::stochastic_rounding,
       "stochastically round bf16 weight and state updates (false: round-to-nearest, loses small updates)"},
      {"fused_backward_pass", &TrainConfig::fused_backward_pass,
       "apply the optimizer to each parameter inside backward and free its gradient at once"},
      {"fused_clip_method",
       &TrainConfig::fused_clip_method,
       "global-norm clipping with fused_backward_pass: previous step's norm (free) or an exact second "
       "backward (costs one more forward+backward)",
       -kInf,
       kInf,
       {"previous_step_norm", "two_pass"}},
      {"gradient_accumulation_dtype",
       &TrainConfig::gradient_accumulation_dtype,
       "buffer for summing bf16 gradients over micro-batches: fp32, or bf16 with stochastic rounding",
       -kInf,
       kInf,
       {"fp32", "bf16_sr"}},
      {"learning_rate", &TrainConfig::learning_rate, "peak learning rate", 0, 10},
      {"lr_scheduler",
       &TrainConfig::lr_scheduler,
       "learning-rate schedule after warmup",
       -kInf,
       kInf,
       {"constant", "constant_with_warmup", "cosine"}},
      {"lr_warmup_steps", &TrainConfig::lr_warmup_steps, "linear warmup length in optimizer steps", 0, 1e12},
      Field{"train_batch_size", &TrainConfig::train_batch_size, "images per micro-batch", 1, 65536}.with(kResumeValue),
      {"max_train_steps", &TrainConfig::max_train_steps, "optimizer steps to train", 1, 1e12},
      {"max_train_epochs", &TrainConfig::max_train_epochs,
       "train this many epochs (kohya's: max_train_steps becomes epochs x ceil(batches per epoch / "
       "gradient_accumulation_steps), an epoch counting each image num_repeats times; overrides max_train_steps, "
       "as in kohya; --max-steps clears it); 0 = off",
       0, 1e9},
      {"max_train_minutes", &TrainConfig::max_train_minutes,
       "wall-time budget (minutes) of the whole train command: after timing the first steps, max_train_steps "
       "becomes what fits (never more), recorded in the run's config.toml (0 = off)",
       0, 1e7},
      {"gradient_accumulation_steps", &TrainConfig::gradient_accumulation_steps, "micro-batches per optimizer step", 1,
       65536},
      {"max_grad_norm", &TrainConfig::max_grad_norm, "global gradient-norm clip (0 = off)", 0, 1e9},
      {"gradient_checkpointing", &TrainConfig::gradient_checkpointing, "recompute UNet block activations in backward"},
      {"attention_chunk_mib", &TrainConfig::attention_chunk_mib,
       "largest attention score matrix (MiB, per call) computed at once; larger ones run in query blocks "
       "(0 = never chunk)",
       0, 1e9},
      {"offload_optimizer_state", &TrainConfig::offload_optimizer_state,
       "keep optimizer state in host memory and stream it per parameter around each update"},
      {"offload_params", &TrainConfig::offload_params,
       "keep the weights of the checkpointed blocks in host memory and copy each block's to the device for its "
       "forward and its recompute in backward; their gradients and optimizer state stay in host memory and the "
       "optimizer updates them there, with their EMA (DeepSpeed's offload_param; needs gradient_checkpointing; "
       "one process; on CUDA from pinned memory, untested on a GPU so far)"},
      {"mixed_precision",
       &TrainConfig::mixed_precision,
       "compute dtype with fp32 weights (shorthand for a precision rule; fp16 adds loss scaling)",
       -kInf,
       kInf,
       {"no", "bf16", "fp16"}},
      {"full_bf16", &TrainConfig::full_bf16, "bf16 weights and gradients; updates applied with stochastic rounding"},
      {"full_fp16", &TrainConfig::full_fp16,
       "fp16 weights (stochastically rounded updates) and fp16 compute, with dynamic loss scaling"},
      {"precision.overflow_threshold", &TrainConfig::overflow_threshold,
       "fp16 block outputs above this fraction of 65504 (or inf/NaN) count as overflow", 1e-6, 1},
      {"precision.auto_upcast", &TrainConfig::auto_upcast, "move fp16 blocks that overflow to fp32 compute and go on"},
      {"precision.activation_rescale", &TrainConfig::activation_rescale,
       "Stable Cascade's fp16 fix: each TimestepBlock of the last up-block group multiplies the hidden state by this "
       "factor at run time (weights untouched; a power of two scales exactly); it compounds over the group's "
       "TimestepBlocks (8 in the 3.6B release: 0.5 -> 1/256), so keep hidden values well above fp16's subnormals "
       "(6e-5); 1 = off",
       1.0 / 1024, 1},
      {"precision.bf16_compute",
       &TrainConfig::bf16_compute,
       "where rules say bf16 compute: auto = bf16 on hardware with bf16 units (AVX-512 BF16, AMX), fp32 elsewhere "
       "(bf16 weights stay bf16); bf16 = always; fp32 = never",
       -kInf,
       kInf,
       {"auto", "bf16", "fp32"}},
      {"precision.loss_scale_init", &TrainConfig::loss_scale_init,
       "initial dynamic loss scale for fp16 (GradScaler init_scale)", 1, 1e38},
      {"precision.loss_scale_growth_interval", &TrainConfig::loss_scale_growth_interval,
       "clean fp16 steps before the loss scale doubles (GradScaler growth_interval)", 1, 1e12},
      {"save_precision",
       &TrainConfig::save_precision,
       "dtype of the final model.safetensors (auto = storage dtype; float = fp32, as kohya)",
       -kInf,
       kInf,
       {"auto", "fp32", "float", "fp16", "bf16"}},
      {"save_precision_force", &TrainConfig::save_precision_force,
       "save in save_precision even when values overflow or flush to zero (else an error)"},
      Field{"ema_decay", &TrainConfig::ema_decay, "EMA decay per optimizer step (0 = no EMA)", 0, 0.999999}.with(
          kResumeEnabled),
      {"max_nonfinite_steps", &TrainConfig::max_nonfinite_steps,
       "consecutive non-finite steps (skipped) before training stops", 1, 1e9},
      Field{"seed", &TrainConfig::seed, "seed for data order, noise, init and rounding", 0, 9.0e18}.with(kResumeValue),
      Field{"pretrained_model_name_or_path", &TrainConfig::pretrained_model_name_or_path,
            "base weights to start from: a shoestring model.safetensors (tiny-unet), or a single-file checkpoint "
            "(LDM / ComfyUI layout, or a sharded *.safetensors.index.json) for a released architecture; \"\" = random "
            "init"}
          .with(kResumePath),
      Field{"vae", &TrainConfig::vae,
            "VAE weights for an LDM architecture (a file with the VAE alone or under first_stage_model.); \"\" = the "
            "pretrained checkpoint's"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"effnet_checkpoint_path", &TrainConfig::effnet_checkpoint_path,
            "Stable Cascade: the stage C latent encoder (effnet_encoder.safetensors; kohya's name); \"\" = a random "
            "one (model.tiny only)"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"previewer_checkpoint_path", &TrainConfig::previewer_checkpoint_path,
            "Stable Cascade: the latent previewer that decodes samples (previewer.safetensors; kohya's name); \"\" = "
            "a random one (model.tiny only; samples are then noise)"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"text_model_checkpoint_path", &TrainConfig::text_model_checkpoint_path,
            "Stable Cascade: OpenCLIP bigG (ViT-bigG-14 laion2b) in OpenCLIP layout: an SDXL single file "
            "(conditioner.embedders.1.model.*) or a file of the text tower's keys alone; \"\" = a random one "
            "(model.tiny only)"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"clip_l", &TrainConfig::clip_l,
            "SD3: CLIP-L text encoder (text_encoders/clip_l.safetensors, Hugging Face layout; kohya's name); \"\" = "
            "the base file's text_encoders.clip_l (or a random one, model.tiny only)"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"clip_g", &TrainConfig::clip_g,
            "SD3: OpenCLIP bigG text encoder (text_encoders/clip_g.safetensors; Hugging Face or OpenCLIP layout); "
            "\"\" = the base file's text_encoders.clip_g (or a random one, model.tiny only)"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"t5xxl", &TrainConfig::t5xxl,
            "SD3: T5-XXL v1.1 encoder (text_encoders/t5xxl_fp16.safetensors; tokenizer_dir must hold its "
            "spiece.model); \"\" = no T5: 77 zero tokens, as kohya and diffusers condition without it"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"t5xxl_max_token_length", &TrainConfig::t5xxl_max_token_length,
            "SD3: T5 tokens per caption, EOS included (kohya's default 256)", 2, 512}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"tokenizer_dir", &TrainConfig::tokenizer_dir,
            "folder holding CLIP's vocab.json and merges.txt (e.g. ComfyUI's comfy/sd1_tokenizer); \"\" = a word "
            "tokenizer built from the captions"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"v_parameterization", &TrainConfig::v_parameterization,
            "LDM UNets: train the v-prediction target (SD 2.x style) instead of epsilon"}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"loss_type",
            &TrainConfig::loss_type,
            "training loss per element (kohya's conditional_loss): l2 (MSE), l1, huber 2c(sqrt(d^2+c^2)-c) or "
            "smooth_l1 2(sqrt(d^2+c^2)-c), with c from huber_schedule",
            -kInf,
            kInf,
            {"l2", "l1", "huber", "smooth_l1"}},
      Field{"huber_schedule",
            &TrainConfig::huber_schedule,
            "huber / smooth_l1 threshold c per timestep: snr (1-huber_c)/(1+sigma_t)^2+huber_c, exponential "
            "exp(ln(huber_c) t/1000)*huber_scale, constant huber_c*huber_scale; the emoji model needs constant",
            -kInf,
            kInf,
            {"snr", "exponential", "constant"}},
      {"huber_c", &TrainConfig::huber_c,
       "huber / smooth_l1 threshold parameter (kohya's default 0.1); in (0, 1] with the snr and exponential "
       "schedules",
       1e-6, 1e6},
      {"huber_scale", &TrainConfig::huber_scale, "multiplies the constant and exponential huber thresholds", 1e-6, 1e6},
      Field{"min_snr_gamma", &TrainConfig::min_snr_gamma,
            "min-SNR-gamma loss weighting (arXiv 2303.09556): min(SNR, gamma)/SNR, v-prediction min(SNR, "
            "gamma)/(SNR+1); 5 is the paper's value; 0 = off",
            0, 1e6}
          .with(kReleasedModelOnly),
      Field{"debiased_estimation_loss", &TrainConfig::debiased_estimation_loss,
            "debiased estimation loss weighting (arXiv 2310.08442): 1/sqrt(min(SNR, 1000)), v-prediction "
            "1/(min(SNR, 1000)+1)"}
          .with(kReleasedModelOnly),
      Field{"noise_offset", &TrainConfig::noise_offset,
            "offset noise: add this x a per-sample, per-channel normal to the noise (about 0.1 is common); 0 = off", 0,
            10}
          .with(kReleasedModelOnly),
      Field{"adaptive_noise_scale", &TrainConfig::adaptive_noise_scale,
            "add this x |mean of the latent channel| to noise_offset, per sample (needs noise_offset); 0 = off", -10,
            10}
          .with(kReleasedModelOnly),
      Field{"multires_noise_iterations", &TrainConfig::multires_noise_iterations,
            "multi-resolution (pyramid) noise levels (6-10 is common); 0 = off", 0, 64}
          .with(kReleasedModelOnly),
      Field{"multires_noise_discount", &TrainConfig::multires_noise_discount,
            "pyramid noise: level i is weighted discount^i (kohya's default 0.3)", 0, 1}
          .with(kReleasedModelOnly),
      Field{"clip_skip", &TrainConfig::clip_skip, "SD 1.x: condition on the N-th last CLIP layer's output", 1, 12}.with(
          kResumeValue | kReleasedModelOnly),
      Field{"network_module",
            &TrainConfig::network_module,
            "\"networks.lora\": train a LoRA (base weights frozen, output lora.safetensors); \"\": train every weight",
            -kInf,
            kInf,
            {"", "networks.lora"}}
          .with(kResumeValue),
      Field{"network_dim", &TrainConfig::network_dim, "LoRA rank", 1, 65536}.with(kResumeValue),
      Field{"network_alpha", &TrainConfig::network_alpha, "LoRA alpha: the delta is scaled by alpha / rank (0 = rank)",
            0, 1e6}
          .with(kResumeValue),
      Field{"network_args", &TrainConfig::network_args,
            "LoRA arguments as \"key=value\" strings: conv_dim, conv_alpha (LoRA on 3x3 convs), train_ff "
            "(feed-forward layers too)"}
          .with(kResumeValue),
      Field{"network_train_unet_only", &TrainConfig::network_train_unet_only,
            "LoRA on the UNet only, none on the text encoder"}
          .with(kResumeValue),
      {"network_weights", &TrainConfig::network_weights, "kohya LoRA file to start training from (\"\" = new LoRA)"},
      {"output_dir", &TrainConfig::output_dir, "run folder"},
      {"save_every_n_steps", &TrainConfig::save_every_n_steps,
       "checkpoint cadence in optimizer steps (0 = only at the end)", 0, 1e12},
      {"save_every_n_epochs", &TrainConfig::save_every_n_epochs,
       "also checkpoint at the end of every Nth epoch (epoch e ends at step e x steps per epoch; 0 = never)", 0, 1e12},
      {"save_last_n_steps", &TrainConfig::save_last_n_steps,
       "keep only the step checkpoints (save_every_n_steps, the last step) of the last N steps, deleting older "
       "ones after each new checkpoint is committed, as kohya's; never the newest or the one latest.json names "
       "(0 = keep all)",
       0, 1e12},
      {"save_last_n_epochs", &TrainConfig::save_last_n_epochs,
       "keep only the last N epoch checkpoints (save_every_n_epochs), deleting older ones after each new "
       "checkpoint is committed, as kohya's; a checkpoint that is also a kept step checkpoint stays (0 = keep all)",
       0, 1e12},
      {"sample_every_n_steps", &TrainConfig::sample_every_n_steps,
       "sample-grid cadence in optimizer steps (0 = only at the end)", 0, 1e12},
      {"sample_prompts", &TrainConfig::sample_prompts,
       "prompts of the sample grid (one row each), with kohya's inline options: \"PROMPT --n NEGATIVE --w W --h H "
       "--s STEPS --l CFG --d SEED\" (--n, --w, --h: LDM UNets only; the rows of one grid share --w / --h)"},
      {"sample_seeds", &TrainConfig::sample_seeds, "seeds per prompt (grid columns)", 1, 64},
      {"sample_steps", &TrainConfig::sample_steps, "sampler steps (Euler for tiny-unet, DDIM for the LDM UNets)", 1,
       1000},
      {"sample_cfg", &TrainConfig::sample_cfg, "classifier-free guidance scale", 0, 100},
      Field{"sample_sampler",
            &TrainConfig::sample_sampler,
            "LDM UNets' sampler for the sample grids (train/samplers.h): ddim (kohya's default), euler, euler_a, "
            "dpmpp_2m; kohya's k_euler, k_euler_a and dpmsolver++ name the same; the emoji model always integrates "
            "its flow with Euler",
            -kInf,
            kInf,
            {"ddim", "euler", "euler_a", "dpmpp_2m", "k_euler", "k_euler_a", "dpmsolver++"}}
          .with(kReleasedModelOnly),
      {"log_every_n_steps", &TrainConfig::log_every_n_steps, "progress line cadence (no TTY)", 1, 1e9},
      Field{"log_with",
            &TrainConfig::log_with,
            "\"tensorboard\": also write each step's metrics as TensorBoard event files into RUN_DIR/logs/ "
            "(`tensorboard --logdir RUN_DIR/logs`); \"\": metrics.jsonl and report.html only",
            -kInf,
            kInf,
            {"", "tensorboard"}},
      {"num_threads", &TrainConfig::num_threads,
       "intra-op threads (0 = every CPU this process may use, divided among the ranks on this machine)", 0, 1024},
      {"device", &TrainConfig::device,
       "where the step runs: \"auto\" (the first CUDA device when libtorch has CUDA and one is visible, else the "
       "CPU), \"cpu\", \"cuda\" or \"cuda:N\"; the dataset and caches stay in host memory (`--device` on the "
       "command line)"},
      {"zero_stage", &TrainConfig::zero_stage,
       "with several processes (torchrun, `shoestring launch`): 0 = data parallel (each rank's share of the global "
       "batch's mean gradient summed over the ranks); 1 = ZeRO stage 1 (each rank updates, and keeps optimizer state "
       "for, its share of the trainable "
       "tensors, whole tensors balanced by element count); 2 = stage 1 and each gradient reduced to its owner only; "
       "3 = stage 2 and the weights of each checkpointed block kept by their owner only, gathered for the block's "
       "forward and its recompute in backward (needs gradient_checkpointing); one process ignores it",
       0, 3},
      {"zero3_prefetch", &TrainConfig::zero3_prefetch,
       "zero_stage = 3: from the second step on, gather the next checkpointed block's weights while the current "
       "block runs (in the order the first step fetched them), as DeepSpeed's stage-3 prefetch; costs one more "
       "block's weights per rank; false gathers each block when it is needed"},
      {"ddp_timeout", &TrainConfig::ddp_timeout,
       "minutes (as kohya's --ddp_timeout; fractions allowed) a rank waits for the others in the rendezvous and "
       "in each collective before it stops with an error; Gloo's own default is 30 minutes",
       0.1, 1440},
  };
  return fields;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : schema()) {
    if (key == f.key) return &f;
  }
  // A dotted key may also be given without its section ("base_channels").
  for (const auto& f : schema()) {
    std::string k = f.key;
    auto dot = k.rfind('.');
    if (dot != std::string::npos && k.substr(dot + 1) == key) return &f;
  }
  return nullptr;
}

std::string nearest_key(const std::string& key) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& f : schema()) {
    std::string k = f.key;
    size_t d = edit_distance(key, k);
    auto dot = k.rfind('.');
    if (dot != std::string::npos) d = std::min(d, edit_distance(key, k.substr(dot + 1)));
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

std::string expected_text(const Field& f) {
  auto range = [&](const char* what) {
    if (std::isinf(f.min) && std::isinf(f.max)) return std::string(what);
    return fmt::format("{} in [{}, {}]", what, f.min, f.max);
  };
  return std::visit(
      [&](auto m) -> std::string {
        using T = std::decay_t<decltype(std::declval<TrainConfig>().*m)>;
        if constexpr (std::is_same_v<T, bool>) return "true or false";
        if constexpr (std::is_same_v<T, int64_t>) return range("an integer");
        if constexpr (std::is_same_v<T, double>) return range("a number");
        if constexpr (std::is_same_v<T, std::string>) {
          if (f.choices.empty()) return "a string";
          return fmt::format("one of \"{}\"", fmt::join(f.choices, "\", \""));
        }
        if constexpr (std::is_same_v<T, std::vector<int64_t>>) return range("an array of integers");
        if constexpr (std::is_same_v<T, std::vector<std::string>>) return "an array of strings";
      },
      f.member);
}

}  // namespace config_detail

using namespace config_detail;

std::string config_reference_markdown() {
  const TrainConfig defaults;
  std::string out =
      "# Config keys\n\n"
      "A run is described by one TOML file. Keys follow kohya sd-scripts' names where the concept is the\n"
      "same. Keys shown as `section.key` may be written inside a `[section]` table or dotted; the part\n"
      "after the dot alone is accepted too. `--set key=value` overrides any key from the command line.\n"
      "Paths may use `${SHOESTRING_CACHE}` (default `~/.cache/shoestring`) and `~`.\n\n"
      "This page is generated from the schema in `src/shoestring/train/config_schema.cpp`\n"
      "(`config_reference_markdown()`); a test checks it is current.\n\n"
      "| key | default | allowed | meaning |\n|---|---|---|---|\n";
  for (const auto& f : schema()) {
    std::string def = std::visit(
        [&](auto m) -> std::string {
          using T = std::decay_t<decltype(defaults.*m)>;
          const T& v = defaults.*m;
          if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
          if constexpr (std::is_same_v<T, std::string>) return "\"" + v + "\"";
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) return fmt::format("[{}]", fmt::join(v, ", "));
          if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            std::vector<std::string> q;
            for (const auto& s : v) q.push_back("\"" + s + "\"");
            return fmt::format("[{}]", fmt::join(q, ", "));
          }
          if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) return fmt::format("{}", v);
        },
        f.member);
    out += fmt::format("| `{}` | `{}` | {} | {} |\n", f.key, def, expected_text(f), f.help);
  }
  out +=
      "\n## Precision rules\n\n"
      "`[[precision.rule]]` entries (any number, later ones win key by key) set per-module precision; see\n"
      "[precision.md](precision.md). Keys of one rule:\n\n"
      "| key | allowed | meaning |\n|---|---|---|\n"
      "| `match` | a glob (`*` any run, `?` one character), required | module or parameter paths it applies to |\n"
      "| `kind` | a module class (`CascadeResBlock`, `Linear`, ...; `plan --explain` shows each block's) | only "
      "modules of this class count when matching |\n"
      "| `storage` | `fp32`, `bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2` | dtype the weights are kept in (fp8: frozen "
      "only) |\n"
      "| `compute` | `fp32`, `bf16`, `fp16` | dtype the blocks compute in (fp16 is emulated on CPUs) |\n"
      "| `trainable` | true or false | false freezes the weights |\n"
      "| `checkpoint` | true or false | recompute the block's activations in backward |\n"
      "| `master` | `none`, `fp32` | keep an fp32 master copy of low-precision trainable weights |\n\n"
      "`mixed_precision`, `full_bf16`, `full_fp16` and `gradient_checkpointing` are shorthands that expand to\n"
      "rules placed before these.\n";
  out += dataset_config_reference_markdown();
  return out;
}

namespace {

/// The value of `f` in `c` as the resume message shows it: numbers and
/// booleans as fmt prints them, lists as "[a, b]".
std::string render_value(const TrainConfig& c, const Field& f) {
  return std::visit(
      [&](auto m) -> std::string {
        using T = std::decay_t<decltype(c.*m)>;
        if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
          return fmt::format("[{}]", fmt::join(c.*m, ", "));
        } else {
          return fmt::format("{}", c.*m);
        }
      },
      f.member);
}

std::string canonical_path(const std::string& p) {
  if (p.empty()) return p;
  std::error_code ec;
  auto canonical = std::filesystem::weakly_canonical(expand_path(p), ec);
  return ec ? p : canonical.string();
}

}  // namespace

std::vector<std::string> resume_differences(const TrainConfig& was, const TrainConfig& now) {
  std::vector<std::string> diffs;
  for (const auto& f : schema()) {
    std::string key = f.key, a, b;
    if (f.flags & kResumeValue) {
      a = render_value(was, f);
      b = render_value(now, f);
    } else if (f.flags & kResumePath) {
      const auto member = std::get<std::string TrainConfig::*>(f.member);
      a = canonical_path(was.*member);
      b = canonical_path(now.*member);
    } else if (f.flags & kResumeEnabled) {
      const auto member = std::get<double TrainConfig::*>(f.member);
      key += " > 0";
      a = fmt::format("{}", was.*member > 0);
      b = fmt::format("{}", now.*member > 0);
    } else {
      continue;
    }
    if (a != b) diffs.push_back(fmt::format("{} (run: \"{}\", now: \"{}\")", key, a, b));
  }
  return diffs;
}

namespace {

/// The [[precision.rule]] entries on one line: {match = "*", storage = "fp16", ...}, ...
std::string rules_text(const TrainConfig& c) {
  std::vector<std::string> rules;
  for (const precision::RuleSpec& r : c.precision_rules) {
    std::vector<std::string> parts{fmt::format("match = \"{}\"", r.match)};
    if (r.kind) parts.push_back(fmt::format("kind = \"{}\"", *r.kind));
    if (r.storage) parts.push_back(fmt::format("storage = \"{}\"", *r.storage));
    if (r.compute) parts.push_back(fmt::format("compute = \"{}\"", *r.compute));
    if (r.master) parts.push_back(fmt::format("master = \"{}\"", *r.master));
    if (r.trainable) parts.push_back(fmt::format("trainable = {}", *r.trainable));
    if (r.checkpoint) parts.push_back(fmt::format("checkpoint = {}", *r.checkpoint));
    rules.push_back(fmt::format("{{{}}}", fmt::join(parts, ", ")));
  }
  return rules.empty() ? "none" : fmt::format("{}", fmt::join(rules, ", "));
}

}  // namespace

std::vector<std::string> changed_keys(const TrainConfig& was, const TrainConfig& now) {
  std::vector<std::string> diffs;
  for (const auto& f : schema()) {
    const std::string key = f.key;
    if (key == "output_dir") continue;  // a resume names the run folder itself
    const std::string a = render_value(was, f), b = render_value(now, f);
    if (a != b) diffs.push_back(fmt::format("{} (run: \"{}\", now: \"{}\")", key, a, b));
  }
  if (!(was.precision_rules == now.precision_rules)) {
    diffs.push_back(fmt::format("precision.rule (run: {}, now: {})", rules_text(was), rules_text(now)));
  }
  return diffs;
}

std::vector<std::string> ignored_keys(const TrainConfig& config, bool emoji_model) {
  const TrainConfig defaults;
  const bool flow =
      models::find_architecture(config.architecture).default_objective == models::Objective::flow_matching;
  const unsigned not_read = (emoji_model ? kReleasedModelOnly : kEmojiModelOnly) | (flow ? 0u : kFlowMatchingOnly);
  std::vector<std::string> keys;
  for (const auto& f : schema()) {
    if ((f.flags & not_read) && render_value(config, f) != render_value(defaults, f)) keys.push_back(f.key);
  }
  return keys;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const auto& f : schema()) keys.push_back(f.key);
  return keys;
}

}  // namespace shoestring
