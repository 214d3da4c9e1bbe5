// TensorBoard event files, written without TensorFlow or protobuf: each
// record is TFRecord-framed (tensorflow/core/lib/io/record_writer.cc: the
// length as uint64 little-endian, its masked CRC-32C, the data, the data's
// masked CRC-32C; mask = ((crc >> 15) | (crc << 17)) + 0xa282ead8), and
// holds one tensorflow.Event protobuf (tensorflow/core/util/event.proto),
// encoded by hand: wall_time (1, double), step (2, int64), and one of
// file_version (3, string: "brain.Event:2" opens every file), summary (5:
// Summary.value (1) = {tag (1, string), simple_value (2, float)}) or
// session_log (7: status (1) START = 1, which tells TensorBoard to drop the
// events at and after its step that an earlier invocation wrote: a resume).
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shoestring {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as iSCSI / RFC
/// 3720 and TFRecord use it) of `bytes`: crc32c("123456789") = 0xE3069283.
uint32_t crc32c(std::string_view bytes);

/// TFRecord's masked CRC-32C: ((c >> 15) | (c << 17)) + 0xa282ead8 of c = crc32c(bytes).
uint32_t masked_crc32c(std::string_view bytes);

/// `data` framed as one TFRecord (16 bytes more than `data`).
std::string tfrecord(std::string_view data);

/// An Event holding file_version "brain.Event:2" (the first record of a file).
std::string event_file_version(double wall_time);

/// An Event at `step` whose Summary holds one simple_value per (tag, value).
std::string event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);

/// An Event at `step` holding SessionLog{status: START}: TensorBoard drops
/// the events of earlier files at steps >= `step` (a resumed run's redone steps).
std::string event_session_start(double wall_time, int64_t step);

/// Appends events to one new file `dir/events.out.tfevents.<unix seconds>.<host>.<pid>.<n>`
/// (`dir` created if missing), flushed after each event, so that TensorBoard
/// follows a run while it trains. Throws shoestring::Error naming the file
/// when it cannot be created or written.
class EventFileWriter {
 public:
  /// Opens the file and writes its file_version event.
  explicit EventFileWriter(const std::string& dir);
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  /// Writes `event` (an encoded Event, e.g. event_scalars) as one record and flushes.
  void write(std::string_view event);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_;
};

/// The records of a TFRecord file, each checked against its two masked
/// CRCs. Throws shoestring::Error naming the file and the record's offset
/// for a bad checksum or a record cut short.
std::vector<std::string> read_tfrecords(const std::string& path);

/// Seconds since the Unix epoch, as Event.wall_time counts them.
double wall_time_now();

}  // namespace shoestring
