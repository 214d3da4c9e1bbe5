#include "shoestring/io/tensorboard_events.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// Protobuf wire format (https://protobuf.dev/programming-guides/encoding/).
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian (x86-64, aarch64)
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, 2);  // length-delimited
  put_varint(out, bytes.size());
  out.append(bytes);
}

/// Event's wall_time (1, fixed64 double) and step (2, varint).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, wall_time);
  if (step != 0) {
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  uint32_t c = 0xFFFFFFFFu;
  for (char ch : bytes) c = table[(c ^ static_cast<unsigned char>(ch)) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_fixed(out, static_cast<uint64_t>(data.size()));
  put_fixed(out, masked_crc32c(std::string_view(out.data(), 8)));
  out.append(data);
  put_fixed(out, masked_crc32c(data));
  return out;
}

std::string event_file_version(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_key(value, 2, 5);  // simple_value: fixed32 float
    put_fixed(value, v);
    put_bytes(summary, 1, value);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string event_session_start(double wall_time, int64_t step) {
  std::string log;
  put_key(log, 1, 0);  // SessionLog.status
  put_varint(log, 1);  // START
  std::string e = event_head(wall_time, step);
  put_bytes(e, 7, log);
  return e;
}

std::vector<std::string> read_tfrecords(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<std::string> out;
  size_t at = 0;
  while (at < bytes.size()) {
    if (bytes.size() - at < 12) fail("'{}': record at byte {} is cut short (its header)", path, at);
    uint64_t length = 0;
    uint32_t length_crc = 0, data_crc = 0;
    std::memcpy(&length, bytes.data() + at, 8);
    std::memcpy(&length_crc, bytes.data() + at + 8, 4);
    if (masked_crc32c(std::string_view(bytes.data() + at, 8)) != length_crc) {
      fail("'{}': record at byte {}: the length's checksum does not match", path, at);
    }
    if (length > bytes.size() - at - 12 || bytes.size() - at - 12 - length < 4) {
      fail("'{}': record at byte {} is cut short ({} data bytes announced)", path, at, length);
    }
    const std::string_view data(bytes.data() + at + 12, length);
    std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
    if (masked_crc32c(data) != data_crc) fail("'{}': record at byte {}: the data's checksum does not match", path, at);
    out.emplace_back(data);
    at += 16 + length;
  }
  return out;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

EventFileWriter::EventFileWriter(const std::string& dir) : file_(nullptr, &std::fclose) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  char host[256] = "localhost";
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  host[sizeof(host) - 1] = '\0';
  for (char* p = host; *p; ++p) {
    if (*p == '/') *p = '_';
  }
  const double now = wall_time_now();
  // A new file each time, as PyTorch's SummaryWriter names them: a counter
  // keeps two writers of one process within one second apart.
  static std::atomic<int64_t> counter{0};
  for (int attempt = 0; attempt < 1000 && !file_; ++attempt) {
    path_ = (fs::path(dir) / fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", static_cast<int64_t>(now), host,
                                         static_cast<int64_t>(::getpid()), counter++))
                .string();
    file_.reset(std::fopen(path_.c_str(), "wbx"));  // x: never append to another writer's file
    if (!file_ && errno != EEXIST) break;
  }
  if (!file_) {
    fail("cannot create TensorBoard event file '{}': {}", path_, ec ? ec.message() : std::strerror(errno));
  }
  write(event_file_version(now));
}

void EventFileWriter::write(std::string_view event) {
  const std::string record = tfrecord(event);
  if (std::fwrite(record.data(), 1, record.size(), file_.get()) != record.size() || std::fflush(file_.get()) != 0) {
    fail("cannot write TensorBoard event file '{}'", path_);
  }
}

}  // namespace shoestring
