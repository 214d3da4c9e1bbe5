// Caption processing at batch time, as kohya's sd-scripts do it: caption
// dropout, tag shuffling with kept leading tags, and tag dropout.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace shoestring {

/// What happens to a caption each time it is drawn into a batch (kohya's
/// option names). A caption is a list of tags separated by ','.
struct CaptionProcessing {
  /// Probability of training on the empty caption instead
  /// (caption_dropout_rate; the unconditional input of classifier-free guidance).
  double dropout_rate = 0.0;
  /// Shuffle the tags after the first keep_tokens (shuffle_caption).
  bool shuffle = false;
  /// Leading tags never shuffled or dropped (keep_tokens; counted in tags).
  int64_t keep_tokens = 0;
  /// Probability of dropping each tag after the first keep_tokens
  /// (caption_tag_dropout_rate).
  double tag_dropout_rate = 0.0;

  /// True when a caption that is not dropped can still change (shuffle or tag dropout).
  bool edits_tags() const { return shuffle || tag_dropout_rate > 0.0; }
};

/// The tags of a caption: split at ',', each trimmed of spaces and tabs;
/// empty tags (",," or a trailing ',') are left out.
std::vector<std::string> caption_tags(std::string_view caption);

/// The captions of one batch, processed as kohya's sd-scripts
/// BaseDataset.process_caption (library/train_util.py) does: each caption is
/// dropped (-> "") with probability dropout_rate; a kept caption, when
/// edits_tags(), is split into tags (caption_tags), the first keep_tokens stay
/// in place, the others are shuffled (shuffle) and each is then kept with
/// probability 1 - tag_dropout_rate, and the tags are joined with ", ".
/// Random numbers come from libtorch's default generator, in a fixed order:
/// first one uniform per caption for the dropout (always drawn, as before tag
/// processing existed, so runs without it are unchanged), then per kept
/// caption a permutation (shuffle) and one uniform per flexible tag (tag
/// dropout). Unlike kohya, empty tags are not kept. Throws shoestring::Error if
/// a rate is outside [0, 1] or keep_tokens < 0.
std::vector<std::string> process_captions(std::vector<std::string> captions, const CaptionProcessing& p);

}  // namespace shoestring
